"""Held-out evaluations pinned to one version, run beside training.

:class:`PinnedEvaluation` starts an evaluation once every consumer serves the current version and
collects its scores later. Invariants: nothing is published while an evaluation runs (the loop
finishes it before its next publication), so every episode is sampled by the pinned version alone,
which the source checks token by token; the seconds the loop waited count as ``eval``, the rest of
the evaluation's seconds (run beside training) as ``eval_overlapped``; with
``controller.keep_best`` the pinned version is checkpointed while its episodes run, so its weights
are on disk when its result arrives (:class:`trainer.driver.records.keeper.CheckpointKeeper`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from trainer.driver.records.keeper import CheckpointKeeper
from trainer.driver.sources.source import TrajectorySource


class PinnedEvaluation:
    """The job's held-out evaluations (see the module docstring).

    Args:
        source: the trajectory source that sends the held-out episodes and scores them.
        keeper: the job's checkpoints (the evaluated version saved, the best one noted).
        times: the job's time counters (``eval``, ``eval_overlapped`` seconds added here).
        wait_published: blocks until every consumer applied the last publication.
        version: the learner's current version.
    """

    def __init__(
        self,
        source: TrajectorySource,
        keeper: CheckpointKeeper,
        times: Counter,
        wait_published: Callable[[], None],
        version: Callable[[], int],
    ) -> None:
        self.source, self.keeper, self.times = source, keeper, times
        self.wait_published, self.version = wait_published, version
        self._tag, self._started, self._blocked = "", 0.0, 0.0
        self._running = False
        self.resubmitted = 0
        """Held-out requests submitted again over the run's finished evaluations because the rollout
        worker holding them was lost (the sum of their ``resubmitted`` scores)."""

    def evaluate(self, tag: str) -> dict[str, float]:
        """Held-out scores at the current version, blocking: :meth:`start` then :meth:`finish`
        (``{}`` when there is nothing to evaluate).

        Raises:
            TimeoutError: the env loop's episodes did not all finish within ``env.eval_timeout_s``.
        """
        return self.finish() if self.start(tag) else {}

    def start(self, tag: str) -> bool:
        """Start an evaluation pinned to the current version once every consumer applied it; returns
        without waiting for the episodes (the agent source runs its evaluation here, blocking).
        False when there is nothing to evaluate. The version is checkpointed for ``keep_best`` while
        the episodes run, except after training (``tag = "after"``: the run's final checkpoint saves
        it)."""
        self.wait_published()  # every worker serves the version being evaluated
        self._tag, self._started = tag, time.perf_counter()
        started = self._running = self.source.start_eval(tag)
        self._blocked = time.perf_counter() - self._started
        if started and tag != "after":
            self.keeper.save_for_eval(self.version())  # saved while the episodes run
        return started

    @property
    def running(self) -> bool:
        """An evaluation was started and not finished (the next publication must wait for it)."""
        return self._running

    def abandon(self) -> None:
        """Forget the running evaluation (the job stops; the source forgets it when it closes)."""
        self._running = False

    def finish(self, tag: str | None = None) -> dict[str, float]:
        """Wait for the running evaluation: its scores (``reward``, ``success_rate``, ``episodes``,
        ``version``) plus ``tag`` (``tag`` or the one it started with), ``seconds`` (from its start)
        and ``waited_s`` (what of it the loop waited: this call and :meth:`start`); ``{}`` when none
        runs.

        Raises:
            TimeoutError: its episodes did not all finish within ``env.eval_timeout_s`` of its start.
            trainer.driver.records.heldout.OffVersionError: an episode holds a token of another version.
            trainer.driver.records.heldout.EvalLostError: a request was lost with its rollout worker once
                more after :data:`trainer.driver.records.heldout.EVAL_RESUBMITS` resubmissions.
        """
        if not self._running:
            return {}
        t0 = time.perf_counter()
        scores = self.source.finish_eval()
        self._running = False
        self.resubmitted += int(scores.get("resubmitted", 0))
        waited = time.perf_counter() - t0 + self._blocked
        seconds = time.perf_counter() - self._started
        self.times["eval"] += waited
        self.times["eval_overlapped"] += max(0.0, seconds - waited)
        # the agent source's scores carry no version: its evaluation blocked the loop, so it is the current one
        result = {"version": self.version(), **scores, "tag": tag or self._tag, "seconds": seconds, "waited_s": waited}
        self.keeper.note_best(result)
        return result
