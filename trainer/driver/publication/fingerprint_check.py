"""A job's check that its consumers serve the weights published to them, and what each version should serve.

:class:`FingerprintCheck` is the job's (:attr:`trainer.driver.loop.parts.Job.fingerprints`): the job tells
it of each publication (:meth:`FingerprintCheck.published`), the publication's apply asks it to
check every consumer (:meth:`FingerprintCheck.check_fingerprints`), the worker controls to check
the workers that applied a publication on their own (:meth:`FingerprintCheck.check_joined_workers`),
and the intake and the buffer judge trajectories against :attr:`FingerprintCheck.expected`
(:func:`trainer.driver.loop.parts.intake_refusal`, :meth:`FingerprintCheck.drop_mismatched`). The
rules (what a report should say, which reports cannot be judged) are
:mod:`trainer.driver.publication.fingerprints`'; this object applies them to the job's rollout pool and
old-logit route, restarts what differs and counts it.

Invariants: every consumer found serving other weights than the version published to it is
restarted (a rollout worker killed as ``fingerprint_mismatch`` and replaced like a dead one; the
old-logit service killed for Ray to restart and given the publication again, while
``oldlogit.max_restarts`` > 0) and counted once in :attr:`FingerprintCheck.mismatches`; a report
that cannot be judged is counted once in :attr:`FingerprintCheck.unverified` (a rollout worker is
also restarted as a mismatch with ``rollout.unverified_fingerprint = "mismatch"``; the service
never is for it); a rollout worker that did not answer stays marked unverified and is asked again;
:attr:`FingerprintCheck.expected` holds no version older than ``controller.max_staleness`` behind
the last publication.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray
from rich.console import Console

from protocol import WeightManifest
from trainer.driver.config.schema import JobConfig
from trainer.driver.publication.fingerprints import (
    FINGERPRINT_MISMATCH,
    expected_entries,
    is_mismatch,
    is_unverified,
    mismatched_workers,
    prune_expected,
    trajectory_mismatch,
    unverified_workers,
)
from trainer.driver.publication.routes import Route, ScorerWeights

if TYPE_CHECKING:
    from trainer.driver.sources.buffer import TrajectoryBuffer
    from trainer.driver.workers.pool import WorkerPool


class FingerprintCheck:
    """Checks what a job's consumers serve after a publication (see the module docstring).

    Args:
        cfg: the job config (``rollout.unverified_fingerprint``, ``oldlogit.max_restarts``,
            ``controller.max_staleness``).
        console: where restarts and unjudged reports are named.
        pool: the rollout workers (:class:`trainer.driver.workers.pool.WorkerPool`): their reports, and
            ``kill`` for a mismatched one.
        route: the old-logit route (:mod:`trainer.driver.publication.routes`): the service's calls and handle.
    """

    def __init__(self, cfg: JobConfig, console: Console, pool: WorkerPool, route: Route):
        self.cfg, self.console, self.pool, self.route = cfg, console, pool, route
        self.mismatches = 0
        """Consumers found serving other weights than the version published to them, restarted."""
        self.unverified = 0
        """Consumer reports, after a publication was applied, whose served fingerprint could not be
        judged (:func:`trainer.driver.publication.fingerprints.is_unverified`), one per report: restarted as
        mismatches too with ``rollout.unverified_fingerprint = "mismatch"``."""
        self.expected: dict = {}
        """What each published version should serve (:data:`trainer.driver.publication.fingerprints.ExpectedFingerprints`):
        trajectories served otherwise are dropped as ``fingerprint_mismatch``. Versions older than
        ``controller.max_staleness`` behind are pruned at each publication (:meth:`published`)."""

    def published(self, manifest: WeightManifest) -> None:
        """``manifest`` is being published (no publication is being applied now): drop the versions
        no trajectory may be trained on any more from :attr:`expected`, and expect ``manifest``'s
        fingerprint of full weights (known before any worker applies it)."""
        self.expected = prune_expected(self.expected, manifest.version - self.cfg.controller.max_staleness)
        self.expected.update(expected_entries(manifest, {}))

    def drop_mismatched(self, buffer: TrajectoryBuffer) -> list[str]:
        """Drop every trajectory buffered or held in ``buffer`` whose served fingerprint differs from
        what its version should serve (:attr:`expected`, learned after it arrived: an adapter
        version's merge is known once its worker's report is checked), as ``fingerprint_mismatch``;
        returns their ids."""
        if not self.expected:
            return []
        expected = dict(self.expected)  # the publication thread may add entries meanwhile
        return buffer.drop_if(lambda t: trajectory_mismatch(t, expected), FINGERPRINT_MISMATCH)

    def check_fingerprints(self, manifest: WeightManifest, scorer_weights: ScorerWeights | None) -> None:
        """After a publication is applied, restart every consumer that serves other weights than
        it (:mod:`trainer.driver.publication.fingerprints`) and count each in :attr:`mismatches`: a rollout
        worker is killed and replaced like a dead one (:meth:`trainer.driver.loop.supervision.WorkerSupervisor.replace_dead`,
        its in-flight samples dropped as ``fingerprint_mismatch``); the old-logit service is killed
        for Ray to restart it (only while ``oldlogit.max_restarts`` > 0; otherwise it is counted and
        named on the console) and given the publication again. A worker that did not answer is
        checked later (:meth:`check_joined_workers`). A consumer whose report cannot be judged is
        counted in :attr:`unverified` (a rollout worker is restarted as a mismatch with
        ``rollout.unverified_fingerprint = "mismatch"``; the service never is for it)."""
        reports = self.pool.fingerprints()
        for wid in self.pool.worker_ids():
            if wid not in reports:
                self.pool.mark_unverified(wid, manifest)
        self.restart_mismatched(manifest, reports)
        calls = self.route.calls
        if scorer_weights is None or calls is None:
            return
        report = calls.call("fingerprint")
        if is_unverified(scorer_weights[0], report, merges_adapters=False):
            self.unverified += 1
            self.console.print(
                f"[yellow]old-logit service: served fingerprint of v{manifest.version} cannot be read, not checked"
            )
        if not is_mismatch(scorer_weights[0], report, merges_adapters=False):
            return
        self.mismatches += 1
        if self.cfg.oldlogit.max_restarts == 0:
            self.console.print(
                "[yellow]old-logit service: served fingerprint differs (oldlogit.max_restarts = 0: kept)"
            )
            return
        self.console.print(
            f"[yellow]old-logit service: served fingerprint differs from v{manifest.version}, restarting"
        )
        ray.kill(self.route.oldlogit, no_restart=False)
        calls.call("update_weights", *scorer_weights)

    def restart_mismatched(self, manifest: WeightManifest, reports: dict[str, dict[str, Any]]) -> list[str]:
        """Kill the workers of ``reports`` (their fingerprint reports after applying ``manifest``)
        that serve other weights (:func:`trainer.driver.publication.fingerprints.mismatched_workers`), to be
        replaced like dead ones, count them in :attr:`mismatches`, and note what the others vouch
        for in :attr:`expected`. Those whose report cannot be judged are counted in
        :attr:`unverified`, and with ``rollout.unverified_fingerprint = "mismatch"`` killed and
        counted as mismatched too. Returns the killed ids."""
        unverified = unverified_workers(manifest, reports)
        self.unverified += len(unverified)
        setting = self.cfg.rollout.unverified_fingerprint if unverified else "count"
        bad = mismatched_workers(manifest, reports, setting)
        if unverified:
            self.console.print(
                f"[yellow]{', '.join(unverified)}: served fingerprint of v{manifest.version} cannot be read, "
                + ("restarting" if setting == "mismatch" else "not checked")
            )
        self.expected.update(expected_entries(manifest, reports))
        if bad:
            self.pool.kill(bad, FINGERPRINT_MISMATCH)
        if differs := [w for w in bad if w not in unverified]:
            self.console.print(
                f"[yellow]{', '.join(differs)}: served fingerprint differs from v{manifest.version}, restarting"
            )
        self.mismatches += len(bad)
        return bad

    def check_joined_workers(self) -> list[str]:
        """Check the rollout workers that applied a publication outside a publish (a joiner's
        catch-up, a late worker's update taken in later: :meth:`WorkerPool.take_unverified`) as
        :meth:`check_fingerprints` checks a publication's: a mismatched one is killed, replaced like
        a dead one (:meth:`trainer.driver.loop.supervision.WorkerSupervisor.replace_dead`) and counted. One that
        does not answer is asked again next time. Returns the killed ids."""
        pending = self.pool.take_unverified()
        if not pending:
            return []
        reports = self.pool.fingerprints(sorted(pending))
        for wid in pending.keys() - reports.keys():
            self.pool.mark_unverified(wid, pending[wid])
        return [w for wid, r in sorted(reports.items()) for w in self.restart_mismatched(pending[wid], {wid: r})]
