"""The rollout workers between iterations of the driver loop: scale requests, workers started in
the background, dead or hung workers.

:class:`WorkerSupervisor` keeps the number of workers the job wants and the replacements started so
far. Invariants: a worker removed, dead or hung hands its in-flight training samples to the source as
lost (:meth:`trainer.driver.sources.source.TrajectorySource.note_worker_loss`; the held-out requests
it held are submitted again by the source); replacements never exceed ``rollout.max_restarts`` over
the run; the loop never waits for a placement (workers start in the background and join at the
version current when they are ready); every change is printed and shown as ``/v1/status``
``scale_note`` with the workers then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console

from trainer.driver.cluster.server import StatusBoard
from trainer.driver.config.schema import JobConfig
from trainer.driver.loop import worker_notes
from trainer.driver.publication.fingerprint_check import FingerprintCheck
from trainer.driver.sources.source import TrajectorySource
from trainer.driver.workers.pool import WORKER_REMOVED

if TYPE_CHECKING:
    from trainer.driver.workers.pool import WorkerPool


class WorkerSupervisor:
    """Scale, admit and replace the job's rollout workers (see the module docstring).

    Args:
        cfg: the job config (``rollout.num_workers`` the first wish, ``max_restarts``, ``start_timeout_s``).
        console: where each change is printed.
        pool: the rollout workers.
        source: the trajectory source that is told of each worker's lost samples.
        fingerprints: the check run on workers that joined outside a publication.
    """

    def __init__(
        self,
        cfg: JobConfig,
        console: Console,
        pool: WorkerPool,
        source: TrajectorySource,
        fingerprints: FingerprintCheck,
    ) -> None:
        self.cfg, self.console, self.pool, self.source, self.fingerprints = cfg, console, pool, source, fingerprints
        self.wanted = cfg.rollout.num_workers
        """The number of workers the job wants (``rollout.num_workers``, then each scale request)."""
        self.restarts = 0
        """Replacements started for dead or hung workers over the run."""

    def replace_dead(self, board: StatusBoard) -> None:
        """Rollout workers whose process died, or that hung (no finished trajectory for longer than
        ``rollout.hang_timeout_s`` with samples in flight: killed here): their in-flight training
        samples are lost to the source (reason ``worker_died`` / ``worker_hung``) and replacements
        start, at most ``rollout.max_restarts`` over the run; past that the job goes on with fewer
        and ``scale_note`` says so."""
        self.pool.kill_hung()
        deaths = self.pool.take_deaths()
        if not deaths:
            return
        for lost, reason in deaths.values():
            self.source.note_worker_loss(lost, reason)
        have = len(self.pool) + len(self.pool.starting)
        add = min(self.wanted - have, self.cfg.rollout.max_restarts - self.restarts)
        if add > 0:
            self.pool.request(have + add)  # started in the background: admit_started
            self.restarts += add
        self.report(
            board,
            worker_notes.lost_workers_note(
                self.pool, self.wanted, deaths, self.restarts, self.cfg.rollout.max_restarts
            ),
        )

    def apply_controls(self, board: StatusBoard) -> None:
        """Apply the latest scale request (one that arrives meanwhile stays pending for the next call).
        Extra workers are removed now, their in-flight training samples lost to the source (reason
        ``worker_removed``); new ones start in the background (:meth:`admit_started`)."""
        want = board.take_scale_request()
        if want is None:
            return
        self.wanted = want
        removed = self.pool.request(want)
        for _wid, lost in removed.items():
            self.source.note_worker_loss(lost, WORKER_REMOVED)
        self.report(board, worker_notes.scaled_note(self.pool, want, len(removed)))

    def admit_started(self, board: StatusBoard) -> None:
        """Rollout workers started in the background that are ready join at the current version;
        those not placed and started within ``rollout.start_timeout_s`` are given up (the job goes on
        with fewer). ``scale_note`` says which. Then every worker that applied a publication outside
        the job's publish is fingerprint-checked (:meth:`FingerprintCheck.check_joined_workers`)."""
        joined, gave_up = self.pool.admit_started()
        self.fingerprints.check_joined_workers()
        if not joined and not gave_up:
            return
        self.report(
            board, worker_notes.started_note(self.pool, self.wanted, joined, gave_up, self.cfg.rollout.start_timeout_s)
        )

    def report(self, board: StatusBoard, note: str) -> None:
        """Print ``note`` and show it as ``/v1/status`` ``scale_note`` with the workers now."""
        self.console.print(note)
        board.update(scale_note=note, workers=self.pool.statuses())
