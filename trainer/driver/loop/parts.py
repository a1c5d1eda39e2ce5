"""The parts of one running job and what each line of the driver loop does with them.

:class:`Job` holds the learner, the old-logit route, the rollout worker pool, the trajectory buffer
and the trajectory source, started by :func:`trainer.driver.loop.assembly.start_job`; the loop
(:func:`trainer.driver.loop.job._loop`) calls its operations in order: admit (:meth:`Job.top_up`),
collect, take, train, take ahead, wait, publish, checkpoint; between iterations its
:attr:`Job.workers` (:mod:`trainer.driver.loop.supervision`) scale, admit and replace rollout
workers, and its :attr:`Job.evals` (:mod:`trainer.driver.loop.pinned_eval`) run held-out
evaluations pinned to a version.

Invariants: the learner's version rises by exactly one per applied step and is published whole to
every consumer before the next version is published (one publication is applied at a time); a
batch stays held in the buffer until its step starts, and a batch taken ahead whose step never
started goes back unconsumed; every trajectory that reaches :meth:`Job.collect` enters the buffer
or is refused with a reason (:func:`intake_refusal`), and its fate is in the ledger by id
(:mod:`trainer.driver.records.ledger`); with ``controller.dynamic_sampling`` a whole group of equal rewards is
dropped as ``filtered`` right after the intake that completed it, within :func:`filter_bound` per
version (:meth:`TrajectoryBuffer.filter_groups`); a checkpoint keeps every finished trajectory not yet consumed
(:meth:`Job.checkpoint`); with ``controller.keep_best`` the version of the best pinned held-out
evaluation stays checkpointed, and keep_checkpoints never prunes it (the job's checkpoints are its
:attr:`Job.keeper`, :class:`trainer.driver.records.keeper.CheckpointKeeper`); every consumer found serving
other weights than published to it is restarted and counted (:attr:`Job.fingerprints`,
:class:`trainer.driver.publication.fingerprint_check.FingerprintCheck`).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from rich.console import Console

from oldlogit_service.calls import PendingCall
from protocol import OldLogitAnswer, OldLogitServiceStatus, Trajectory
from trainer.driver.config.schema import JobConfig
from trainer.driver.loop.pinned_eval import PinnedEvaluation
from trainer.driver.loop.supervision import WorkerSupervisor
from trainer.driver.publication.fingerprint_check import FingerprintCheck
from trainer.driver.publication.fingerprints import FINGERPRINT_MISMATCH, ExpectedFingerprints, trajectory_mismatch
from trainer.driver.publication.publisher import Publisher
from trainer.driver.publication.routes import Route
from trainer.driver.records.keeper import CheckpointKeeper
from trainer.driver.records.ledger import Ledger
from trainer.driver.sources.buffer import TrajectoryBuffer
from trainer.driver.sources.resume import write_driver_state
from trainer.driver.sources.source import TrajectorySource

if TYPE_CHECKING:
    from trainer.driver.workers.pool import WorkerPool
    from trainer.learner import LearnerGroup


def intake_refusal(t: Trajectory, vocab_size: int, expected: ExpectedFingerprints | None = None) -> str | None:
    """Why a finished trajectory cannot enter the buffer (the buffer's drop reason), or None.

    ``aborted``: its generation was aborted; ``token_id_out_of_vocab``: a token id is ``>= vocab_size``
    (the model config's ``vocab_size``, rows of the learner's embedding), which no forward can score;
    ``fingerprint_mismatch``: its worker served other weights than its version's (``expected``,
    :func:`trainer.driver.publication.fingerprints.trajectory_mismatch`).
    """
    if t.finish_reason == "abort":
        return "aborted"
    if int(t.token_ids.max()) >= vocab_size:
        return "token_id_out_of_vocab"
    if expected and trajectory_mismatch(t, expected):
        return FINGERPRINT_MISMATCH
    return None


def filter_bound(cfg: JobConfig) -> int:
    """Groups of equal rewards dynamic sampling may drop per learner version (one training step):
    ``controller.max_filtered_groups_per_step``, or ``2 * controller.batch_groups`` when unset.

    Example: 4 groups per batch, unset: up to 8 groups dropped per version, so at most 12 groups
    are generated for one batch of 4 (plus what the staleness bound lets run ahead).
    """
    c = cfg.controller
    return c.max_filtered_groups_per_step if c.max_filtered_groups_per_step is not None else 2 * c.batch_groups


@dataclass
class TakenBatch:
    """A batch out of the buffer (held there until its step starts) and the route's pending answer."""

    trajectories: list[Trajectory]
    old_logits: PendingCall | None
    """The snapshot route's call for the per-token answer (:class:`protocol.OldLogitAnswer`), None on
    other routes; ``old_logits.ref`` is the reference the learner resolves."""
    ahead: bool
    """Taken for the next version while the learner trained on the batch before."""
    waited_s: float | None = None
    """Seconds the driver waited for the answer; None until it has waited (:meth:`Job.await_old_logits`)."""
    answer: OldLogitAnswer | None = None
    """The answer once waited for (None on routes without one): the exact/proxy flags of ``samples.jsonl``."""


@dataclass
class TrainStep:
    """One launched learner step."""

    batch: TakenBatch
    refs: list[ray.ObjectRef]
    """One reference per rank to its metrics (rank 0's first)."""
    started: float
    """``time.perf_counter()`` at the launch."""
    old_logits_s: float
    """Seconds the driver waited for the batch's answer before the launch."""

    def done(self, timeout_s: float) -> bool:
        """Whether rank 0 has finished, waiting at most ``timeout_s`` seconds."""
        ready, _ = ray.wait(self.refs[:1], timeout=timeout_s)
        return bool(ready)


class Job:
    """The parts of one running job and the bookkeeping the loop needs (see the module docstring).

    Args:
        cfg: the job config.
        console: where the job's lines are printed.
        model_path: the HF model folder every consumer starts from (version 0).
        vocab_size: the model config's ``vocab_size`` (rows of the learner's embedding).
        learner: the learner ranks (:class:`trainer.learner.LearnerGroup`).
        route: the old-logit route (:mod:`trainer.driver.publication.routes`).
        pool: the rollout workers (:class:`trainer.driver.workers.pool.WorkerPool`).
        buffer: the trajectory buffer (resumed state loaded).
        version: the learner's version at the start (the resumed one, else 0).
        run_segment: 0 for a fresh run, +1 at every resume.
        source: builds the trajectory source over this job (its pool, buffer and version).
        ledger: where the fate of every finished trajectory is recorded (the buffer's ``ledger``).
    """

    def __init__(
        self,
        cfg: JobConfig,
        console: Console,
        *,
        model_path: Path,
        vocab_size: int,
        learner: LearnerGroup,
        route: Route,
        pool: WorkerPool,
        buffer: TrajectoryBuffer,
        version: int,
        run_segment: int,
        source: Callable[[Job], TrajectorySource],
        ledger: Ledger,
    ):
        self.cfg, self.console = cfg, console
        self.run_dir = Path(cfg.logging.run_dir)
        self.model_path, self.vocab_size = model_path, vocab_size
        s = cfg.rollout.sampling
        self.group_size, self.batch_size = s.n, cfg.controller.batch_groups * s.n
        self.learner, self.route, self.pool, self.buffer = learner, route, pool, buffer
        self.version = version
        """The learner's version: the number of rollout batches it has trained on (one published update each)."""
        self.keeper = CheckpointKeeper(
            cfg, self.run_dir, learner, ledger, version=version, run_segment=run_segment,
            driver_state=lambda folder: write_driver_state(folder, self.buffer, self.source),
        )  # fmt: skip
        """The run's checkpoints and the best version's (:mod:`trainer.driver.records.keeper`)."""
        self.run_segment = run_segment
        """0 for a fresh run, +1 at every resume: (segment, version) names one set of weights even
        when a resumed run re-reaches a version number it had passed before the resume point."""
        self.times = Counter()
        self.train_steps = self.taken_ahead = 0
        self.retaken = 0
        """Batches taken ahead and returned to train a group on its last chance (:meth:`confirm_ahead`)."""
        self.first_launch: float | None = None  # perf_counter at the first learner step's launch
        self.tokens_exact = self.tokens_total = 0
        self.learner_rss_bytes: float | None = None
        """The learner's resident bytes at its last step (rank 0), for the report of a kill for memory."""
        self.peak_rss: dict[str, float] = {}
        """The largest resident bytes seen at a step, by part (:func:`trainer.driver.loop.report.part_memory`)."""
        self.fingerprints = FingerprintCheck(cfg, console, pool, route)
        """What each consumer serves, checked after each publication; what each version should serve
        (:mod:`trainer.driver.publication.fingerprint_check`)."""
        self.ledger = ledger
        self.publisher = Publisher(cfg, learner, route, pool, self.fingerprints, ledger, self.times)
        """Publications of the learner's versions, one applied at a time (:mod:`trainer.driver.publication.publisher`)."""
        self.source: TrajectorySource = source(self)
        """Where training trajectories come from (:mod:`trainer.driver.sources.source`): it admits, collects and evaluates."""
        self.workers = WorkerSupervisor(cfg, console, pool, self.source, self.fingerprints)
        """Scale requests, workers started in the background, dead or hung workers (:mod:`trainer.driver.loop.supervision`)."""
        self.evals = PinnedEvaluation(self.source, self.keeper, self.times, self.publisher.wait, lambda: self.version)
        """Held-out evaluations pinned to a version (:mod:`trainer.driver.loop.pinned_eval`)."""

    # -- the parts of one iteration (the loop in :func:`trainer.driver.loop.job._loop` calls them in order) --

    @property
    def admission_version(self) -> int:
        """The version the staleness admission rule counts from: the learner's, or the one the
        rollout workers still serve while a publication is being applied, whichever is older
        (:func:`trainer.driver.sources.buffer.admission_capacity`)."""
        return min(self.version, self.publisher.served_version)

    def top_up(self) -> None:
        """Admit: the source submits as much new work as the staleness admission rule allows."""
        self.source.top_up()

    def collect(self, timer: str = "old_logits") -> None:
        """Move finished training trajectories into the buffer (the route attaches exact pi_old first).

        The seconds the route spends attaching go to ``times[timer]``. With
        ``controller.dynamic_sampling``, the groups this intake made whole are then judged, and those
        of equal rewards dropped as ``filtered`` (:meth:`TrajectoryBuffer.filter_groups`, bound
        :func:`filter_bound` per learner version); their places go to new prompts at the next admission.
        """
        got = self.source.poll()
        t0 = time.perf_counter()
        got = self.route.attach(got, self.cfg.rollout.sampling.temperature)
        self.times[timer] += time.perf_counter() - t0
        offered: list[str] = []
        for t in got:
            refused = intake_refusal(t, self.vocab_size, self.fingerprints.expected)
            if refused:
                self.buffer.reject(refused, t.trajectory_id)
            elif self.buffer.offer(t):
                offered.append(t.group_id)
        if self.cfg.controller.dynamic_sampling and offered:
            self.buffer.filter_groups(offered, self.version, self.cfg.rollout.sampling.n, filter_bound(self.cfg))

    def take(self, ahead: bool = False) -> TakenBatch | None:
        """A batch for the learner's version (``ahead``: for the next one) and the route's pending answer.

        The batch stays held in the buffer until :meth:`async_train`; ahead, trajectories too stale
        for the next version are passed over, not dropped (:meth:`TrajectoryBuffer.take_ahead`).
        Trajectories whose worker served other weights than their version's are dropped first
        (:meth:`FingerprintCheck.drop_mismatched`). None when the buffer has no full batch.
        """
        self.fingerprints.drop_mismatched(self.buffer)
        v = self.version + int(ahead)
        if ahead:
            batch = self.buffer.take_ahead(self.batch_size, v, self.group_size)
        else:
            batch = self.buffer.take(self.batch_size, v, self.group_size, hold=True)
        if batch is None:
            return None
        self.taken_ahead += int(ahead)
        return TakenBatch(batch, self.route.async_old_logits(batch, v, self.cfg.rollout.sampling.temperature), ahead)

    def confirm_ahead(self, taken: TakenBatch | None) -> TakenBatch | None:
        """``taken`` (a batch taken ahead), to be trained at the learner's version now, or None: the
        rest of it goes back to the buffer, unconsumed, and the loop takes a batch again.

        First the trajectories finished since it was taken are collected (:meth:`collect`). It goes
        back when a trajectory of it is dropped by :meth:`FingerprintCheck.drop_mismatched` (the
        groups it broke are no longer whole), or when it passes over a group on its last chance
        (:meth:`TrajectoryBuffer.passes_over_last_chance`: a member that finished after the batch
        was taken made its group whole, and the group would be stale at the next version); the
        retake trains that group and leaves a younger one to the next batch (counted in
        :attr:`retaken`; its old logits are asked for again)."""
        if taken is None:
            return None
        self.collect()
        self.fingerprints.drop_mismatched(self.buffer)
        held = self.buffer.held_ids()
        whole = all(t.trajectory_id in held for t in taken.trajectories)
        if whole and not self.buffer.passes_over_last_chance(self.version, self.group_size):
            return taken
        self.retaken += int(whole)
        self.buffer.put_back([t for t in taken.trajectories if t.trajectory_id in held])
        return None

    def await_old_logits(self, taken: TakenBatch | None) -> None:
        """Wait until the route's answer for ``taken`` is ready (once; nothing when there is none).

        The wait is ``taken.waited_s`` and counts as ``times["old_logits"]``; the service's own
        scoring seconds beyond it (``OldLogitAnswer.seconds``: scoring hidden behind the learner)
        count as ``times["old_logits_overlapped"]``. A service that is restarting is waited for and
        asked again (:class:`oldlogit_service.calls.ServiceCalls`).

        Raises:
            oldlogit_service.calls.ServiceNotBack: the service did not come back within
                ``oldlogit.restart_timeout_s``.
        """
        if taken is None or taken.waited_s is not None:
            return
        t0 = time.perf_counter()
        answer = None if taken.old_logits is None else taken.old_logits.result()
        taken.waited_s, taken.answer = time.perf_counter() - t0, answer
        self.times["old_logits"] += taken.waited_s
        if answer is not None:
            self.times["old_logits_overlapped"] += max(0.0, float(answer.seconds) - taken.waited_s)

    def async_train(self, taken: TakenBatch) -> TrainStep:
        """Launch one learner step on ``taken`` with its answer, after waiting for the answer.

        The batch counts as consumed from here. The learner gets the answer's reference (Ray
        resolves it in the learner process). Nothing is published.
        """
        self.await_old_logits(taken)
        self.buffer.consume(taken.trajectories)
        t0 = time.perf_counter()
        if self.first_launch is None:
            self.first_launch = t0
        refs = self.learner.async_train_step(
            taken.trajectories, taken.old_logits.ref if taken.old_logits is not None else None
        )
        return TrainStep(taken, refs, t0, taken.waited_s or 0.0)

    def take_ahead(self, step: TrainStep) -> TakenBatch | None:
        """While ``step`` trains: collect finished trajectories and take the next batch ahead (for the
        learner's version + 1), until one is taken or the step has finished (then None: the next
        batch is taken at the new version). None at once when ``controller.max_staleness`` is 0 (no
        batch is consumable at V+1 before V+1 is published) or when V+1 is the last version
        (``controller.total_steps``). Room the admission rule opens meanwhile (the last publication
        applied, places freed by groups dynamic sampling drops) is admitted at once (:meth:`top_up`),
        so its new work runs while the learner trains."""
        c = self.cfg.controller
        if c.max_staleness == 0 or self.version + 1 >= c.total_steps:
            return None
        while True:
            nxt = self.take(ahead=True)
            if nxt is not None or step.done(timeout_s=0.2):
                return nxt
            self.collect(timer="old_logits_overlapped")
            self.top_up()

    def finish_train(self, step: TrainStep) -> dict[str, Any]:
        """Wait for ``step``; the learner's metrics (rank 0).

        On an applied step ``self.version`` moves to the learner's new version; nothing is published.
        The metrics gain ``old_logits_s`` (wait for the answer before the launch), ``train_s`` (launch
        to metrics), wall seconds, and ``taken_ahead`` (the batch was taken ahead).

        While it waits, room the admission rule opens (the last publication applied to every
        worker, :attr:`admission_version`) is admitted at once (:meth:`top_up`).

        Raises:
            ray.exceptions.RayActorError: a learner rank died.
        """
        while not step.done(timeout_s=0.2):
            self.top_up()
        m = ray.get(step.refs)[0]
        train_s = time.perf_counter() - step.started
        self.times["train"] += train_s
        self.train_steps += 1
        if m["applied"]:
            self.version = int(m["version"])
        m.update(old_logits_s=step.old_logits_s, train_s=train_s, taken_ahead=step.batch.ahead)
        return m

    def return_taken(self, taken: TakenBatch | None) -> None:
        """A batch taken ahead whose step never started (the loop stopped): back to the buffer, unconsumed."""
        if taken is not None:
            self.buffer.put_back(taken.trajectories)

    def oldlogit_status(self) -> OldLogitServiceStatus | None:
        """The old-logit service's :class:`protocol.OldLogitServiceStatus` now (None without one); a
        new service process since the last call counts as a restart (``ServiceCalls.restarts``).

        Raises:
            oldlogit_service.calls.ServiceNotBack: the service did not come back within
                ``oldlogit.restart_timeout_s``.
        """
        calls = self.route.calls
        return calls.status() if calls is not None else None

    def checkpoint(self, recovery: bool = False) -> str:
        """Save the current version's checkpoint and return its folder
        (:meth:`CheckpointKeeper.checkpoint`: the learner's state, every finished trajectory not yet
        consumed (:func:`trainer.driver.sources.resume.write_driver_state`), the best so far; older ones
        pruned); ``recovery``: a recovery checkpoint, which the next save replaces."""
        return self.keeper.checkpoint(self.version, for_recovery=recovery)

    def export(self) -> Path:
        """A Hugging Face folder of the current version at ``<run_dir>/exports/v{version}``
        (:meth:`CheckpointKeeper.export`), checkpointing the version first if needed."""
        return self.keeper.export(self.version)

    def shutdown(self) -> None:
        """Stop every part, each even when the one before failed: wait for the publication being
        applied, close the source, stop the workers and the learner, kill the old-logit service."""
        with contextlib.suppress(Exception):
            self.publisher.wait()
        with contextlib.suppress(Exception):
            self.source.close()
        with contextlib.suppress(Exception):
            self.pool.shutdown()
        with contextlib.suppress(Exception):
            self.learner.shutdown()
        if self.route.oldlogit is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.route.oldlogit)
        self.ledger.close()
