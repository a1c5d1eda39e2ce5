"""A job's checkpoints: saving one, exporting one, and which ones stay (retention and the best version).

:class:`CheckpointKeeper` is the job's (:attr:`trainer.driver.loop.parts.Job.keeper`); the loop saves
through :meth:`trainer.driver.loop.parts.Job.checkpoint` / :meth:`~trainer.driver.loop.parts.Job.export`, and the
job's evaluations tell it when an evaluation starts (:meth:`CheckpointKeeper.save_for_eval`) and
what it scored (:meth:`CheckpointKeeper.note_best`). It is given what it needs, not the job: the
learner (whose ``save_checkpoint`` writes the folder), the config, the run folder, the ledger and
``driver_state``, a callable that writes the driver's share of a checkpoint.

Invariants: a checkpoint ``<run_dir>/checkpoints/v{N}`` holds the learner's state and the driver
state (every finished trajectory not yet consumed, written by ``driver_state`` before the learner
moves the checkpoint pointer; the buffer's accounting; the source's cursor), ``run_segment`` and
the best pinned evaluation so far, and each save puts a ``checkpoint`` line in the ledger; with
``controller.keep_best`` (:attr:`CheckpointKeeper.keeps_best`) the version of the best pinned
held-out evaluation stays checkpointed and ``keep_checkpoints`` never prunes it; a checkpoint saved
only for an evaluation lives until that evaluation's result and stays only while it is the best;
``<run_dir>/checkpoints/vintage_best.json`` names the current best; a best whose checkpoint is in
another run's folder (a run resumed from there) is compared against but never removed; a recovery
checkpoint (``controller.recovery_checkpoint_s``) never counts against ``keep_checkpoints`` and
stays only while it is the resume point or the best, or until a regular save (an export's
included) of its version makes it a regular one; ``<run_dir>/checkpoints/vintage_recovery.json``
lists them, so a resumed run still knows them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.driver.config.schema import JobConfig
from trainer.driver.records.heldout import BestEval, beats

if TYPE_CHECKING:
    from trainer.driver.records.ledger import Ledger
    from trainer.learner import LearnerGroup


class CheckpointKeeper:
    """Saves a job's checkpoints and keeps the right ones (see the module docstring).

    Args:
        cfg: the job config (``controller.resume_from``, ``keep_best``, ``eval_every``, ``keep_checkpoints``).
        run_dir: the run folder (``logging.run_dir``); checkpoints go to ``<run_dir>/checkpoints``.
        learner: saves a checkpoint folder (``save_checkpoint(directory, extra) -> folder``).
        ledger: where each save's ``checkpoint`` line goes (:class:`trainer.driver.records.ledger.Ledger`).
        version: the learner's version at the start (the resumed one, else 0).
        run_segment: 0 for a fresh run, +1 at every resume.
        driver_state: given a checkpoint's folder, writes the finished trajectories not yet consumed
            there and returns the driver's state to save (``{"buffer": {..., "buffered_ids"},
            "source": {..., "held_back_ids"}}``, :func:`trainer.driver.sources.resume.write_driver_state`).
    """

    def __init__(
        self,
        cfg: JobConfig,
        run_dir: Path,
        learner: LearnerGroup,
        ledger: Ledger,
        *,
        version: int,
        run_segment: int,
        driver_state: Callable[[Path], dict[str, Any]],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg, self.run_dir, self.learner, self.ledger = cfg, Path(run_dir), learner, ledger
        self.run_segment, self.driver_state = run_segment, driver_state
        self.checkpointed_version: int | None = None
        """The version of this run's last checkpoint (None before the first; a run resumed from its
        own checkpoints folder starts with the resume point)."""
        resumed_from = cfg.controller.resume_from
        if resumed_from and Path(resumed_from).resolve() == self.checkpoints_dir.resolve():
            self.checkpointed_version = version
        self._saved_for_eval: int | None = None
        """A version checkpointed only because its evaluation started (:meth:`save_for_eval`), until
        the evaluation's result decides whether the checkpoint stays (:meth:`note_best`)."""
        self.saves: list[tuple[float, int, bool]] = []
        """``(seconds, bytes on disk, for recovery)`` of each checkpoint this run saved, in order (:meth:`cost`)."""
        self.clock = clock
        self._last_save = clock()
        """When this run last saved a checkpoint (``clock`` seconds; the job's start before the first)."""
        self._recovery: set[int] = self._starting_recovery()
        """Versions whose checkpoints were saved only for recovery (:meth:`recovery_due`) and are on disk."""
        self.best: BestEval | None = self.starting_best()
        """The best pinned held-out evaluation so far, whose version's checkpoint is kept
        (:attr:`keeps_best`, :meth:`note_best`); None before the first, or without the setting."""

    @property
    def checkpoints_dir(self) -> Path:
        """``<run_dir>/checkpoints``."""
        return self.run_dir / "checkpoints"

    @property
    def keeps_best(self) -> bool:
        """Whether the best pinned evaluation's checkpoint is kept: ``controller.keep_best`` with
        ``controller.eval_every > 0``."""
        c = self.cfg.controller
        return c.keep_best and c.eval_every > 0

    def _starting_recovery(self) -> set[int]:
        """The recovery checkpoints on disk when the job starts: those the checkpoints folder lists
        when the run resumes from its own folder; none otherwise."""
        from trainer.learner.checkpoint import checkpointed_versions, read_recovery

        if self.checkpointed_version is None:  # not resumed from this run's own folder
            return set()
        return read_recovery(self.checkpoints_dir) & set(checkpointed_versions(self.checkpoints_dir))

    def recovery_due(self, version: int) -> bool:
        """Whether to save a recovery checkpoint of ``version`` now: ``controller.recovery_checkpoint_s``
        (> 0) seconds have passed since this run's last checkpoint (or the job's start), and the
        version is not checkpointed already."""
        every = self.cfg.controller.recovery_checkpoint_s
        return every > 0 and self.clock() - self._last_save >= every and self.checkpointed_version != version

    def checkpoint(self, version: int, for_eval: bool = False, for_recovery: bool = False) -> str:
        """Save ``<run_dir>/checkpoints/v{version}`` (``version``: the learner's now) and return its
        folder: the learner's state (weights, optimizer, version, EWMA), the driver state
        (``driver_state``: the buffer's accounting, the source's cursor, and every finished
        trajectory not yet consumed - buffered, held in a batch taken ahead (saved as buffered, at
        the front: the resumed job takes it again) or held back by the source - in
        :data:`trainer.driver.sources.resume.TRAJECTORIES_FILE`, written before the learner moves the
        checkpoint pointer), ``run_segment`` and the best pinned evaluation so far (``best``,
        :attr:`best` as a dict, or None). The ledger gets a ``checkpoint`` line naming the saved
        ids. Older checkpoints are then removed by the retention rule (:meth:`prune`).

        ``for_eval``: saved only because the version's held-out evaluation started
        (:meth:`save_for_eval`): nothing is pruned, and :meth:`note_best` removes it again unless
        the evaluation is the best. A regular save of that version makes it a regular checkpoint.

        ``for_recovery``: saved because :meth:`recovery_due`: it never counts against
        ``keep_checkpoints`` and :meth:`prune` removes it once it is neither the resume point nor
        the best, unless a regular save of its version came first.
        """
        from trainer.learner.checkpoint import version_tag

        t0 = time.perf_counter()
        directory, tag = self.checkpoints_dir, version_tag(version)
        extra = {
            **self.driver_state(directory / tag),
            "run_segment": self.run_segment,
            "best": asdict(self.best) if self.best is not None else None,
        }
        folder = self.learner.save_checkpoint(str(directory), extra)
        self.saves.append((time.perf_counter() - t0, folder_bytes(Path(folder)), for_recovery))
        self._last_save = self.clock()
        self.checkpointed_version = version
        self.ledger("checkpoint", extra["buffer"]["buffered_ids"], tag=tag, held_back=extra["source"]["held_back_ids"])
        if for_eval:
            self._saved_for_eval = version
            return folder
        if for_recovery:
            self._recovery.add(version)
        else:
            self._recovery.discard(version)  # saved as a regular checkpoint: it follows keep_checkpoints
        if self._saved_for_eval == version:
            self._saved_for_eval = None
        if self.best is not None and self.best.saved_for_it and self.best.checkpoint == str(self._folder(version)):
            self._set_best(replace(self.best, saved_for_it=False))
        self.prune()
        return folder

    def cost(self) -> dict[str, float | int | None]:
        """What this run's checkpoints cost: ``checkpoints`` (saves), ``recovery_checkpoints`` (of
        them, for recovery: :meth:`recovery_due`), ``checkpoint_s_median`` (wall
        seconds of one save: the driver's state, the learner's folder, the ledger line) and
        ``checkpoint_bytes`` (one folder on disk, the last; 0 and None before the first save)."""
        if not self.saves:
            return {"checkpoints": 0, "recovery_checkpoints": 0, "checkpoint_s_median": None, "checkpoint_bytes": 0}
        return {
            "checkpoints": len(self.saves),
            "recovery_checkpoints": sum(recovery for _, _, recovery in self.saves),
            "checkpoint_s_median": statistics.median(s for s, _, _ in self.saves),
            "checkpoint_bytes": self.saves[-1][1],
        }

    def save_for_eval(self, version: int) -> None:
        """A held-out evaluation of ``version`` has started: with :attr:`keeps_best`, checkpoint the
        version (``for_eval``, :meth:`checkpoint`) unless a checkpoint of it exists already, so that
        its weights are on disk when its result arrives (:meth:`note_best`)."""
        if self.keeps_best and self.checkpointed_version != version:
            self.checkpoint(version, for_eval=True)

    def export(self, version: int) -> Path:
        """A Hugging Face folder of ``version`` (the learner's now) at ``<run_dir>/exports/v{version}``
        (:func:`trainer.driver.records.export.export_run`), checkpointing the version first if needed."""
        from trainer.driver.records.export import export_run

        if self.checkpointed_version != version:
            self.checkpoint(version)
        elif version in self._recovery:  # the export's version stays, as a regular checkpoint
            self._recovery.discard(version)
            self.prune()
        out = self.run_dir / "exports" / f"v{version}"
        export_run(self.run_dir, out, version, overwrite=True)
        return out

    # -- the best pinned held-out evaluation's checkpoint (controller.keep_best) ---------------------

    def _folder(self, version: int) -> Path:
        """Version ``version``'s checkpoint folder in this run, as an absolute path."""
        from trainer.learner.checkpoint import version_tag

        return self.checkpoints_dir.resolve() / version_tag(version)

    def _own(self, best: BestEval | None) -> bool:
        """``best``'s checkpoint is in this run's checkpoints folder (a run resumed from another
        folder may keep comparing against a best there, but never removes it)."""
        return best is not None and Path(best.checkpoint).resolve().parent == self.checkpoints_dir.resolve()

    def _set_best(self, best: BestEval | None) -> None:
        """Make ``best`` the best so far and record it in ``<run_dir>/checkpoints/vintage_best.json``."""
        from trainer.learner.checkpoint import write_best

        self.best = best
        write_best(self.checkpoints_dir, asdict(best) if best is not None else None)

    def starting_best(self) -> BestEval | None:
        """The best so far when the job starts. A fresh run: None, and a record left in its run
        folder by an earlier run is removed. A resumed run with :attr:`keeps_best`: the record of the
        checkpoints folder it resumed from while that version's checkpoint is there (a run resumed
        from another folder records it in its own and never removes it); None otherwise.

        Raises:
            ValueError: the record is malformed (the message names the file or the field).
        """
        from trainer.learner.checkpoint import STATE_FILE, read_best, write_best

        resumed_from = self.cfg.controller.resume_from
        if not resumed_from:
            write_best(self.checkpoints_dir, None)
            return None
        record = read_best(resumed_from) if self.keeps_best else None
        if record is None:
            return None
        best = BestEval.from_record(record)
        if not (Path(best.checkpoint) / STATE_FILE).is_file():
            return None
        if not self._own(best):
            best = replace(best, saved_for_it=False)
            write_best(self.checkpoints_dir, asdict(best))
        return best

    def note_best(self, scores: dict[str, Any]) -> None:
        """Keep the checkpoint of the best pinned held-out evaluation (:attr:`keeps_best`), given one
        evaluation's result ``scores`` (:meth:`trainer.driver.loop.pinned_eval.PinnedEvaluation.finish`: ``version``,
        ``reward``, ``tag``).

        Rule: an evaluation whose mean reward beats the best so far (:func:`trainer.driver.records.heldout.beats`:
        higher and finite; ties keep the earlier version) becomes the best. A checkpoint saved only
        for an evaluation (:meth:`save_for_eval`) goes again when that evaluation is not the best, and
        a best's such checkpoint goes when another version beats it; regular checkpoints
        (``checkpoint_every``, ``export_every``, the final one) follow ``keep_checkpoints``, which
        never prunes the best (:meth:`prune`).
        """
        pending, self._saved_for_eval = self._saved_for_eval, None
        old = self.best
        if self.keeps_best and scores and beats(float(scores["reward"]), old):
            v = int(scores["version"])
            folder = str(self._folder(v))
            # saved only for evaluations: this one's, or the same checkpoint's when it was scored before
            only_for_eval = pending == v or (old is not None and old.checkpoint == folder and old.saved_for_it)
            self._set_best(
                BestEval(v, float(scores["reward"]), self.run_segment, str(scores["tag"]), folder, only_for_eval)
            )
        if pending is not None and (self.best is None or self.best.checkpoint != str(self._folder(pending))):
            self._drop(pending)
        if self.best is not old:
            if old is not None and old.saved_for_it and old.checkpoint != self.best.checkpoint and self._own(old):
                self._drop(old.version)
            self.prune()  # a regular checkpoint that was the best follows keep_checkpoints again

    def prune(self) -> list[int]:
        """Remove the checkpoints the retention rule lets go
        (:func:`trainer.learner.checkpoint.checkpoints_to_remove`): the newest
        ``controller.keep_checkpoints`` regular ones, the resume point and the best version stay;
        recovery checkpoints do not count among the regular ones. Returns the versions removed."""
        from trainer.learner.checkpoint import prune_checkpoints, write_recovery

        best = self.best if self._own(self.best) else None
        kept = best.version if best is not None else None
        extra = (best.version,) if best is not None and best.saved_for_it else ()
        gone = prune_checkpoints(
            self.checkpoints_dir, self.cfg.controller.keep_checkpoints, kept, extra + tuple(sorted(self._recovery))
        )
        self._recovery -= set(gone)
        write_recovery(self.checkpoints_dir, self._recovery)
        return gone

    def _drop(self, version: int) -> None:
        """Remove ``version``'s checkpoint, saved only for an evaluation that is not (or no longer)
        the best; the resume point moves back to the newest one left
        (:func:`trainer.learner.checkpoint.remove_checkpoint`)."""
        from trainer.learner.checkpoint import remove_checkpoint

        remove_checkpoint(self.checkpoints_dir, version)
        if self.checkpointed_version == version:
            self.checkpointed_version = None


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder`` (recursively; 0 for a missing folder)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
