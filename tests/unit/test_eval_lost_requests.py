"""Held-out evaluation requests held by a rollout worker that is lost (scaled down, died, hung,
killed for a fingerprint mismatch) are sent again, at most three times each, and never counted as
lost training samples: the driver's real :class:`WorkerPool`, :class:`EnvSource` and
:class:`WorkerSupervisor`, with stand-ins only for the Ray actor handles and Ray's ``get``/``wait``/``kill``
on them (every remote call answers at once)."""

from __future__ import annotations

import numpy as np
import pytest
import ray
from rich.console import Console

import trainer.driver.workers.pool as pool_module
from protocol import Trajectory, WorkerStatus
from rollout.engine import EngineConfig
from rollout.worker import sample_id
from trainer.driver.cluster.server import StatusBoard
from trainer.driver.config.schema import load_config
from trainer.driver.loop.supervision import WorkerSupervisor
from trainer.driver.publication.fingerprint_check import FingerprintCheck
from trainer.driver.publication.fingerprints import FINGERPRINT_MISMATCH
from trainer.driver.records.heldout import EVAL_RESUBMITS, EvalLostError, eval_record
from trainer.driver.sources.buffer import TrajectoryBuffer
from trainer.driver.sources.source import EnvSource
from trainer.driver.workers.pool import WORKER_DIED, WORKER_HUNG, WorkerPool


class Ref:
    """What a stand-in remote call returns: its answer (or the error ``ray.get`` raises), ready at once."""

    def __init__(self, value=None, error: BaseException | None = None):
        self.value, self.error = value, error


class FakeRay:
    """``ray.get``, ``ray.wait`` and ``ray.kill`` over :class:`Ref` answers and :class:`Worker` handles."""

    exceptions = ray.exceptions

    @staticmethod
    def get(ref: Ref, timeout=None):
        if ref.error is not None:
            raise ref.error
        return ref.value

    @staticmethod
    def wait(refs, num_returns=1, timeout=None):
        return list(refs), []

    @staticmethod
    def kill(actor, no_restart=True):
        actor.dead = True


class Call:
    def __init__(self, worker: Worker, fn):
        self.worker, self.fn = worker, fn

    def remote(self, *args):
        if self.worker.dead:
            return Ref(error=ray.exceptions.RayActorError())
        return Ref(self.fn(*args))


class Worker:
    """A rollout worker's actor handle: takes every request; :meth:`finish` makes a sample's
    trajectory ready for the next poll; once ``dead``, every call fails as Ray's would."""

    def __init__(self, wid: str):
        self.wid, self.took, self.ready, self.dead = wid, [], [], False
        self.submit = Call(self, self._submit)
        self.poll = Call(self, self._poll)
        self.close = Call(self, lambda: None)
        self.status = Call(self, lambda: WorkerStatus(worker_id=wid, policy_version=0, in_flight=0))

    def _submit(self, reqs):
        self.took += reqs
        return sum(r.sampling.n for r in reqs)

    def _poll(self):
        out, self.ready = self.ready, []
        return out

    def finish(self, request_id: str) -> None:
        """Every sample of the request ``request_id`` it took last is done (reward 0.5)."""
        r = next(r for r in reversed(self.took) if r.request_id == request_id)
        for i in range(r.sampling.n):
            self.ready.append(trajectory(sample_id(r.request_id, i, r.sampling.n), r, self.wid))


def trajectory(tid: str, request, wid: str) -> Trajectory:
    return Trajectory(
        trajectory_id=tid,
        group_id=request.group_id,
        worker_id=wid,
        token_ids=np.arange(3),
        loss_mask=[0, 1, 1],
        behav_logprobs=[0.0, -0.5, -0.5],
        versions=[-1, 0, 0],
        policy_version=0,
        prompt_len=1,
        finish_reason="stop",
        reward=0.5,
        purpose=request.purpose,
    )


def parts(workers: int, *overrides: str) -> tuple[WorkerPool, EnvSource, WorkerSupervisor, StatusBoard]:
    """A pool of ``workers`` stand-in workers, the env source over it at version 0 (training groups
    of one sample, one group per held-out seed is ``eval-during-<seed>``), and the job's controls."""
    cfg = load_config(
        None,
        [
            "env.train_seeds=10",
            "rollout.sampling.n=1",
            "controller.max_staleness=0",
            "rollout.max_restarts=0",  # no replacement: nothing is launched
            f"rollout.num_workers={workers}",
            *overrides,
        ],
    )
    pool = WorkerPool(EngineConfig(kind="transformers", model_path="unused"))
    for i in range(workers):
        add_worker(pool, i)
    buffer = TrajectoryBuffer(capacity=16, max_staleness=0)
    source = EnvSource(cfg, pool, buffer, lambda: 0)
    console = Console(quiet=True)
    return (
        pool,
        source,
        WorkerSupervisor(cfg, console, pool, source, FingerprintCheck(cfg, console, pool, None)),
        StatusBoard(),
    )


def add_worker(pool: WorkerPool, i: int) -> Worker:
    """Worker ``rollout-<i>`` joins the pool's table (as :meth:`WorkerPool.admit_started` adds it)."""
    w = Worker(f"rollout-{i}")
    pool.workers[w.wid], pool.in_flight[w.wid], pool.last_progress[w.wid] = w, 0, pool.clock()
    return w


def took(w: Worker) -> list[str]:
    return [r.request_id for r in w.took]


def test_lost_eval_requests_are_sent_again_and_never_counted_as_training_samples(monkeypatch):
    """Three workers each take one training sample and one held-out request; rollout-2 is scaled
    away, then rollout-1 dies. Their training samples are dropped with the reason (one each); their
    held-out requests go to rollout-0, which finishes everything: the evaluation scores all three
    episodes, counts two resubmissions, and the buffer's identity holds throughout."""
    monkeypatch.setattr(pool_module, "ray", FakeRay)
    pool, source, j, board = parts(3, "controller.batch_groups=3", "env.eval_prompts=3")
    w0, w1, w2 = (pool.workers[f"rollout-{i}"] for i in range(3))
    source.top_up()  # 3 training groups of 1 sample: one per worker
    assert source.start_eval("during")  # 3 held-out requests: one per worker
    assert [took(w) for w in (w0, w1, w2)] == [
        ["v0-0-0", "eval-during-10"],
        ["v0-1-1", "eval-during-11"],
        ["v0-2-2", "eval-during-12"],
    ]
    assert source.buffer.submitted == 3 and source.buffer.in_flight == 3  # held-out samples are not training samples

    board.request_scale(2)
    j.apply_controls(board)  # rollout-2 is removed: its training sample is lost, its held-out request is not
    assert dict(source.buffer.dropped) == {"worker_removed": 1} and source.buffer.accounting_ok()
    assert source.poll() == [] and took(w0)[-1] == "eval-during-12"  # sent again at once, to rollout-0

    w1.dead = True
    assert source.poll() == []  # rollout-1 is found dead: its held-out request goes to rollout-0 too
    j.replace_dead(board)
    assert dict(source.buffer.dropped) == {"worker_removed": 1, "worker_died": 1}
    assert source.buffer.in_flight == 1 and source.buffer.accounting_ok()  # rollout-0's training sample
    assert board.status().scale_note.startswith("rollout worker(s) rollout-1 died (1 samples lost)")
    assert took(w0) == ["v0-0-0", "eval-during-10", "eval-during-12", "eval-during-11"]
    assert source._eval.resubmitted == {"eval-during-12": 1, "eval-during-11": 1}

    for rid in took(w0):
        w0.finish(rid)
    scores = source.finish_eval()
    assert (scores["episodes"], scores["reward"], scores["resubmitted"]) == (3, 0.5, 2)
    assert eval_record("during", scores, 1.0, 0.5)["eval_resubmitted"] == 2
    (train,) = source.poll()  # held back while the evaluation finished
    assert train.trajectory_id == "v0-0-0" and source.buffer.offer(train)
    assert source.buffer.in_flight == 0 and source.buffer.accounting_ok()
    assert pool.take_lost_requests() == []  # every lost id was taken by the source


def test_an_eval_request_lost_more_than_three_times_fails_the_evaluation_naming_it(monkeypatch):
    """The one held-out request is sent again after each of three losses (hung, fingerprint
    mismatch, died); the fourth loss fails the evaluation with a line naming the request and why."""
    monkeypatch.setattr(pool_module, "ray", FakeRay)
    pool, source, _, _ = parts(1, "env.eval_prompts=1")
    assert source.start_eval("during")
    reasons = [WORKER_HUNG, FINGERPRINT_MISMATCH, WORKER_DIED, FINGERPRINT_MISMATCH]
    assert EVAL_RESUBMITS == 3 == len(reasons) - 1
    for i, reason in enumerate(reasons):
        holder = pool.workers[f"rollout-{i}"]
        assert took(holder) == ["eval-during-10"]
        nxt = add_worker(pool, i + 1)
        pool.kill([holder.wid], reason)
        if i < EVAL_RESUBMITS:
            assert source.poll() == [] and took(nxt) == ["eval-during-10"]
            assert source._eval.resubmitted == {"eval-during-10": i + 1}
    with pytest.raises(EvalLostError) as e:
        source.poll()
    assert str(e.value) == (
        "held-out evaluation 'during': request eval-during-10 was lost with its rollout worker "
        "(fingerprint_mismatch) after 3 resubmissions, the most allowed"
    )
    assert pool.take_deaths() == {f"rollout-{i}": (0, r) for i, r in enumerate(reasons)}  # no training sample
