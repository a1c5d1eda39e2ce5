"""Trajectory sources: where the driver's training trajectories come from.

The loop asks its source, chosen once when the job is assembled, the same things whatever the kind:

==========================  ===================================  ==================================
operation                   :class:`EnvSource` (the built-in     :class:`AgentSource` (agents
                            env loop over the worker pool)       through the gateway)
==========================  ===================================  ==================================
``top_up``                  submits groups of env seeds          starts agent episodes (sessions)
``poll``                    the pool's finished trajectories     ended sessions' trajectories
``start_eval``              submits the held-out env seeds, one  runs the agent on its held-out
                            sample each, and returns             tasks at once (blocking)
``finish_eval``             waits for the episodes (they come    returns the scores kept
                            back with ``poll``); their scores
``note_worker_loss``        drops the training samples           nothing: sessions end on their own
                            (worker's reason)
``status``                  None                                 the gateway's sessions and calls
``state``                   next env seed, seeds in flight,      no cursor (task ids continue from
                            held-back trajectories               the session count), held sessions
``restore``                 both, from a checkpoint              the held sessions
``close``                   forgets a running evaluation (the    forgets the kept scores, stops the
                            job stops the pool)                  agents and the gateway
==========================  ===================================  ==================================

Invariants: admission follows the staleness rule
(:func:`trainer.driver.sources.buffer.admission_capacity`) over trajectories submitted and not dropped, so
the places of a group dropped by dynamic sampling (``controller.dynamic_sampling``, drop reason
``filtered``) go to new prompts (new env seeds, new agent tasks) at the next admission; every trajectory a source admits is noted
submitted on the job's buffer and ends polled, dropped with a reason, or in flight (the buffer's
accounting, :meth:`TrajectoryBuffer.accounting_ok`); ``poll`` never returns an evaluation
trajectory, and evaluation samples are never in the buffer's accounting: a held-out request lost
with its rollout worker is submitted again (at most :data:`trainer.driver.records.heldout.EVAL_RESUBMITS`
times, counted in the evaluation's ``resubmitted`` score), never dropped as a training sample. The driver loop is the
only caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from protocol import EnvRef, GatewayStatus, RolloutRequest, Trajectory
from trainer.driver.config.schema import JobConfig
from trainer.driver.records.heldout import PendingEval, held_out_requests, held_out_scores
from trainer.driver.sources.buffer import TrajectoryBuffer, admission_capacity

if TYPE_CHECKING:
    from trainer.driver.sources.agent_runner import AgentRunner
    from trainer.driver.workers.pool import WorkerPool


@dataclass(frozen=True)
class SourceState:
    """What a checkpoint keeps of a trajectory source."""

    cursor: dict[str, Any]
    """Where the source goes on after a resume (plain values, saved in the checkpoint's state)."""
    pending: list[Trajectory]
    """Finished training trajectories taken from the workers that ``poll`` has not returned yet
    (saved with the checkpoint; still in flight for the buffer's accounting)."""
    units: int
    """How many of the buffer's in-flight units ``pending`` stands for (a trajectory each, or a
    session each where the buffer counts sessions)."""


class TrajectorySource(Protocol):
    """What the driver loop needs from a source of training trajectories (see the module docstring)."""

    def top_up(self) -> None:
        """Admit as much new work as the staleness admission rule allows now."""

    def poll(self) -> list[Trajectory]:
        """Training trajectories finished since the last call (accounting kept)."""

    def start_eval(self, tag: str) -> bool:
        """Start a held-out evaluation at the current version (False: nothing to evaluate); the
        driver publishes nothing until :meth:`finish_eval` returned. ``tag`` names it (``"before"``,
        ``"during"``, ``"after"``)."""

    def finish_eval(self) -> dict[str, float]:
        """Wait for the running evaluation; its scores (``reward``, ``success_rate``, ``episodes``,
        ``resubmitted`` (held-out requests submitted again because the rollout worker holding them was
        lost), ...; ``{}`` when none runs)."""

    def note_worker_loss(self, samples: int, reason: str) -> None:
        """``samples`` training samples in flight on a rollout worker that was lost (``reason``:
        ``worker_died``, ``worker_hung``, ``worker_removed``, ``fingerprint_mismatch``) are lost;
        evaluation samples are not among them (the pool leaves them out)."""

    def status(self) -> GatewayStatus | None:
        """The source's own ``/v1/status`` record (``JobStatus.gateway``); None when it has none."""

    def state(self) -> SourceState:
        """What a checkpoint keeps of the source (:class:`SourceState`)."""

    def restore(self, cursor: dict[str, Any], pending: list[Trajectory]) -> None:
        """Go on from a checkpoint's ``cursor`` and ``pending`` trajectories (returned by the next ``poll``)."""

    def close(self) -> None:
        """Forget a running evaluation and stop what the source started (the job stops the worker
        pool itself)."""


def make_requests(
    cfg: JobConfig, seeds: list[int], prefix: str, version: int, n: int | None = None
) -> list[RolloutRequest]:
    """One request (a group of ``sampling.n`` samples, or ``n``) per env seed."""
    sampling = cfg.rollout.sampling if n is None else cfg.rollout.sampling.model_copy(update={"n": n})
    return [
        RolloutRequest(
            request_id=f"{prefix}{s}",
            group_id=f"{prefix}{s}",
            env=EnvRef(path=cfg.env.path, kwargs=cfg.env.kwargs, seed=s),
            sampling=sampling,
            admitted_version=version,
        )
        for s in seeds
    ]


class EnvSource:
    """The built-in environment loop: groups of ``rollout.sampling.n`` samples of one env seed,
    submitted to the rollout workers and polled back from them.

    Training seeds run through ``0 .. env.train_seeds - 1`` in turn: the cursor ``next_seed`` moves by
    one per group a worker took (a group no worker took keeps its seed for the next submission), and
    a checkpoint saves it (a checkpoint without one goes on from its submission count). A checkpoint
    also saves the seeds of the groups whose samples were not all back (in flight, or lost with a
    worker): a resumed job submits those first, so the prompts that were generating when the run
    stopped are generated again rather than skipped (skipping them would bias the resumed run
    toward the prompts with short rollouts), then goes on from ``next_seed``. Held-out seeds are
    the ``env.eval_prompts`` after them (:mod:`trainer.driver.records.heldout`). An evaluation either runs beside training (:meth:`start_eval`:
    its episodes are picked out of each :meth:`poll`, and :meth:`finish_eval` waits for the rest) or
    blocks (:meth:`evaluate`); its requests held by a rollout worker that is lost are submitted
    again (:meth:`_send_eval`); training trajectories that finish while :meth:`finish_eval` waits are
    held back and returned by the next :meth:`poll` (a checkpoint saves them too). Request and group ids are ``v{version}-{seed}-{n}``
    (``n``: the submission count), from run segment 1 on prefixed ``r{segment}.``: the ids of a resumed
    segment never repeat those the segment before sampled after the checkpoint.

    Args:
        cfg: the job config.
        pool: the rollout workers (``submit``, ``poll``, ``len``).
        buffer: the job's trajectory buffer (admission and accounting).
        version: the learner's current version.
        segment: the job's run segment (0 for a fresh run).
        admission_version: the version the admission rule counts from (the oldest the rollout
            workers still serve, :attr:`trainer.driver.loop.parts.Job.admission_version`); default ``version``.
    """

    def __init__(
        self,
        cfg: JobConfig,
        pool: WorkerPool,
        buffer: TrajectoryBuffer,
        version: Callable[[], int],
        segment: int = 0,
        admission_version: Callable[[], int] | None = None,
    ):
        self.cfg, self.pool, self.buffer, self.version = cfg, pool, buffer, version
        self.admission_version = admission_version or version
        s = cfg.rollout.sampling
        self.group_size, self.batch_size = s.n, cfg.controller.batch_groups * s.n
        self.next_seed = buffer.submitted
        """Index of the next training group; its env seed is ``next_seed % env.train_seeds``."""
        self.id_prefix = f"r{segment}." if segment else ""
        self._open: dict[str, list[int]] = {}
        """Training groups submitted whose samples are not all polled: group id -> [seed, samples left]."""
        self._regenerate: list[int] = []
        """Seeds of a checkpoint's open groups, submitted before ``next_seed`` moves on."""
        self._held_back: list[Trajectory] = []  # training trajectories polled during an evaluation
        self._eval: PendingEval | None = None  # the evaluation whose requests are out

    def top_up(self) -> None:
        """Submit as many new groups as the staleness admission rule allows (none without a worker)."""
        v = self.version()
        room = admission_capacity(
            self.admission_version(), self.cfg.controller.max_staleness, self.batch_size, self.buffer.scheduled
        )
        groups = room // self.group_size
        if groups and len(self.pool):
            again = self._regenerate[:groups]
            seeds = again + [(self.next_seed + i) % self.cfg.env.train_seeds for i in range(groups - len(again))]
            reqs = make_requests(self.cfg, seeds, f"{self.id_prefix}v{v}-", v)
            # request ids must be unique: the seed may repeat, the submission counter does not
            reqs = [
                r.model_copy(
                    update={
                        "request_id": f"{r.request_id}-{self.buffer.submitted + i}",
                        "group_id": f"{r.group_id}-{self.buffer.submitted + i}",
                    }
                )
                for i, r in enumerate(reqs)
            ]
            sent = self.pool.submit(reqs)  # samples, requests taken in order
            taken = -(-sent // self.group_size)
            self._open.update(
                (r.group_id, [seed, self.group_size]) for r, seed in zip(reqs[:taken], seeds, strict=False)
            )
            self.next_seed += max(0, taken - len(again))
            self._regenerate = self._regenerate[min(taken, len(again)) :]
            self.buffer.note_submitted(sent)

    def poll(self) -> list[Trajectory]:
        """Those held back during an evaluation, then the pool's finished training trajectories; the
        running evaluation's episodes are kept for it (and its requests no worker took are sent again)."""
        polled = self._sort(self.pool.poll())
        self._send_eval()
        got, self._held_back = self._held_back + polled, []
        return got

    def start_eval(self, tag: str) -> bool:
        """Submit the held-out requests at the current version (:func:`trainer.driver.records.heldout.held_out_requests`)
        and return without waiting; False (nothing started) without held-out seeds or workers.

        Raises:
            RuntimeError: an evaluation is already running.
        """
        if self._eval is not None:
            raise RuntimeError(f"held-out evaluation {self._eval.tag!r} is still running")
        if self.cfg.env.eval_prompts == 0 or not len(self.pool):
            return False
        reqs = held_out_requests(self.cfg, tag, self.version())
        self._eval = PendingEval(tag, self.version(), reqs, list(reqs))
        self._send_eval()
        return True

    @property
    def eval_running(self) -> bool:
        """An evaluation was started and not finished."""
        return self._eval is not None

    def finish_eval(self) -> dict[str, float]:
        """Wait for the running evaluation's episodes and score them (:func:`trainer.driver.records.heldout.held_out_scores`:
        mean reward, success rate (reward > 0.5), count, the version every sampled token carries),
        plus ``resubmitted`` (its requests submitted again after their worker was lost); ``{}`` when
        none runs. Training trajectories that finish meanwhile are held back for the next
        :meth:`poll`. While it waits, hung workers are killed (:meth:`WorkerPool.kill_hung`; the job
        reports and replaces them at its next controls) and the requests they held are sent again.

        Raises:
            TimeoutError: not every evaluation episode finished within ``env.eval_timeout_s`` of its
                start (a rollout worker failed or hung); the message names the field and the count received.
            trainer.driver.records.heldout.OffVersionError: an episode holds a token of another version.
            trainer.driver.records.heldout.EvalLostError: a request was lost with its worker once more after
                :data:`trainer.driver.records.heldout.EVAL_RESUBMITS` resubmissions.
        """
        e = self._eval
        if e is None:
            return {}
        timeout = self.cfg.env.eval_timeout_s
        while True:
            self._held_back += self._sort(self.pool.poll())
            if e.done:
                break
            self.pool.kill_hung()
            self._send_eval()
            if time.perf_counter() - e.started > timeout:
                raise TimeoutError(
                    f"env.eval_timeout_s: held-out evaluation {e.tag!r} got {len(e.got)} of {len(e.requests)} "
                    f"episodes in {timeout:g} s (a rollout worker failed or hung)"
                )
            time.sleep(0.2)
        self._eval = None
        return {**held_out_scores(e.got, e.version), "resubmitted": sum(e.resubmitted.values())}

    def evaluate(self, tag: str) -> dict[str, float]:
        """:meth:`start_eval` then :meth:`finish_eval`: the held-out scores at the current version;
        ``{}`` without held-out seeds or workers (``vintage eval env`` and tests evaluate this way)."""
        return self.finish_eval() if self.start_eval(tag) else {}

    def abandon_eval(self) -> None:
        """Forget the running evaluation (the job stops); its episodes are discarded when they arrive."""
        self._eval = None

    def _send_eval(self) -> None:
        """Submit the running evaluation's requests no worker took yet (one sample each, in order),
        those a lost rollout worker held included (:meth:`WorkerPool.take_lost`, put back by
        :meth:`PendingEval.put_back`, each counted in the evaluation's ``resubmitted``). The other lost ids
        (training requests, whose samples :meth:`note_worker_loss` drops) are passed over. Nothing
        without a running evaluation: a request can only be lost while its evaluation runs, since
        an evaluation ends with every episode back.

        Raises:
            trainer.driver.records.heldout.EvalLostError: a request was lost once more after
                :data:`trainer.driver.records.heldout.EVAL_RESUBMITS` resubmissions.
        """
        e = self._eval
        if e is None:
            return
        for request_id, reason in self.pool.take_lost():
            e.put_back(request_id, reason)
        if e.unsent:
            e.unsent = e.unsent[self.pool.submit(e.unsent) :]

    def _sort(self, polled: list[Trajectory]) -> list[Trajectory]:
        """The training trajectories of ``polled``; the running evaluation's episodes go to it (each
        once: :meth:`PendingEval.take`), and those of an abandoned one are discarded. Each training
        trajectory closes one sample of its open group."""
        train = []
        for t in polled:
            if t.purpose != "eval":
                train.append(t)
                left = self._open.get(t.group_id)
                if left is not None:
                    left[1] -= 1
                    if left[1] <= 0:
                        del self._open[t.group_id]
            elif self._eval is not None:
                self._eval.take(t)
        return train

    def note_worker_loss(self, samples: int, reason: str) -> None:
        """Each training sample was one submitted trajectory: dropped with the worker's reason."""
        self.buffer.note_lost(samples, reason)

    def status(self) -> GatewayStatus | None:
        """None: nothing of its own to report."""
        return None

    def state(self) -> SourceState:
        """Cursor ``{"next_seed", "in_flight_seeds"}`` (the seeds of the open groups, oldest first,
        after those of a resume still to submit); pending: the training trajectories held back
        during an evaluation, one unit each."""
        in_flight = self._regenerate + [seed for seed, _ in self._open.values()]
        cursor = {"next_seed": self.next_seed, "in_flight_seeds": in_flight}
        return SourceState(cursor, list(self._held_back), len(self._held_back))

    def restore(self, cursor: dict[str, Any], pending: list[Trajectory]) -> None:
        """Continue at ``cursor["next_seed"]`` (when saved), after submitting the groups of
        ``cursor["in_flight_seeds"]`` again; ``pending`` comes first in the next :meth:`poll`."""
        self.next_seed = int(cursor.get("next_seed", self.next_seed))
        self._regenerate = [int(x) for x in cursor.get("in_flight_seeds", [])]
        self._held_back = list(pending)

    def close(self) -> None:
        """Forget a running evaluation (:meth:`abandon_eval`); nothing else of its own to stop."""
        self.abandon_eval()


class AgentSource:
    """Agents through the OpenAI-compatible gateway: the :class:`trainer.driver.sources.agent_runner.AgentRunner`
    of the job's ``[agent]`` section admits, collects and evaluates (see its module docstring).

    The buffer counts sessions (a split session's segments too), not samples: a sample lost with its
    rollout worker is a call of some session, and that session still ends, emitted or dropped with
    a reason, so the lost samples are not counted here.

    Dynamic sampling applies to the gateway's groups as to the env loop's (both group by
    ``group_id``): a full group is released at once, every segment in one poll, and judged whole;
    a group released short of ``rollout.sampling.n`` with a baseline is never filtered.
    """

    def __init__(self, runner: AgentRunner):
        self.runner = runner
        self._scores: dict[str, float] | None = None  # of the evaluation start_eval ran

    def top_up(self) -> None:
        """Start as many new task groups as admission and ``agent.concurrency`` allow."""
        self.runner.top_up()

    def poll(self) -> list[Trajectory]:
        """Trajectories of the training sessions ended since the last call (:meth:`AgentRunner.poll`)."""
        return self.runner.poll()

    def start_eval(self, tag: str) -> bool:
        """Run the agent on its held-out tasks now (:meth:`AgentRunner.evaluate`), blocking (the
        agents' episodes are not polled by the loop), and keep its scores for :meth:`finish_eval`;
        False when there is nothing to evaluate."""
        self._scores = self.runner.evaluate(tag)
        if not self._scores:
            self._scores = None
        return self._scores is not None

    def finish_eval(self) -> dict[str, float]:
        """The scores :meth:`start_eval` kept (``{}`` when none)."""
        out, self._scores = self._scores or {}, None
        return out

    def abandon_eval(self) -> None:
        """Forget the kept scores."""
        self._scores = None

    def note_worker_loss(self, samples: int, reason: str) -> None:
        """Nothing: the sessions whose calls were lost end on their own (see the class docstring)."""

    def state(self) -> SourceState:
        """Cursor ``{}`` (task ids go on from the buffer's session count, :class:`AgentRunner`);
        pending: the trajectories of ended sessions the gateway holds for their groups (every
        segment), one unit per session (the buffer counts a session once until its segments are polled)."""
        held = self.runner.gateway.held_sessions()
        return SourceState({}, [t for e in held for t in e.trajectories], len(held))

    def restore(self, cursor: dict[str, Any], pending: list[Trajectory]) -> None:
        """The sessions held at the checkpoint go to the next :meth:`poll`, their groups released at
        once (:meth:`rollout.gateway.sessions.SessionTable.restore_held`); task ids need no cursor."""
        self.runner.gateway.restore_held(pending)

    def status(self) -> GatewayStatus | None:
        """The gateway's sessions, calls and their accounting."""
        return self.runner.gateway.status()

    def close(self) -> None:
        """Forget the kept scores, cancel running episodes, stop the gateway and the agents' loop."""
        self.abandon_eval()
        self.runner.close()
