"""The best version kept (``controller.keep_best``), by hand: a :class:`trainer.driver.loop.parts.Job`
and its :class:`trainer.driver.records.keeper.CheckpointKeeper` with stand-in parts run the loop's order of
operations (evaluate before, then per version: the pending evaluation's result, the regular
checkpoint, the next evaluation; evaluate after, the final checkpoint) while a stand-in learner
writes checkpoint folders as the real one lays them out.

Hand-worked run: ``eval_every = 10`` over 40 versions scores 0.20 (v0, before training), 0.50
(v10), 0.84 (v20), 0.56 (v30) and 0.48 (v40, after training). The best is v20 (0.84); with
``keep_checkpoints = 2`` and no ``checkpoint_every`` the run ends with v20 (the best) and v40 (the
final checkpoint, the resume point), and every checkpoint saved only for an evaluation that was not
the best is gone.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from protocol import JobStatus
from trainer.driver.config.schema import load_config
from trainer.driver.loop.parts import Job
from trainer.driver.loop.pinned_eval import PinnedEvaluation
from trainer.driver.loop.report import best_line, best_status, best_summary
from trainer.driver.records.export import ExportError, best_version, checkpoint_tag
from trainer.driver.records.heldout import BestEval, beats, eval_due
from trainer.driver.records.keeper import CheckpointKeeper
from trainer.driver.sources.buffer import TrajectoryBuffer
from trainer.driver.sources.resume import TRAJECTORIES_FILE, write_driver_state
from trainer.driver.sources.source import SourceState
from trainer.learner.checkpoint import (
    BEST_FILE,
    DEEPSPEED_LATEST_FILE,
    FORMAT,
    LATEST_FILE,
    STATE_FILE,
    checkpointed_versions,
    latest_tag,
    read_best,
    read_recovery,
    write_recovery,
)
from vintage_cli.main import app

SCORES = {0: 0.20, 10: 0.50, 20: 0.84, 30: 0.56, 40: 0.48}
"""Mean held-out reward of each evaluated version (the hand-worked run)."""


class Learner:
    """Saves a checkpoint folder as the real learner does: ``v{N}/vintage_state.pt`` (with the
    caller's extra), then DeepSpeed's ``latest`` and ``vintage_latest``; counts the saves."""

    def __init__(self, job: Job):
        self.job, self.saves = job, []

    def save_checkpoint(self, directory: str, extra: dict) -> str:
        v = self.job.version
        folder = Path(directory) / f"v{v}"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"format": FORMAT, "version": v, "settings": {}, "extra": extra}, folder / STATE_FILE)
        (Path(directory) / DEEPSPEED_LATEST_FILE).write_text(f"v{v}")
        (Path(directory) / LATEST_FILE).write_text(f"v{v}")
        self.saves.append(v)
        return str(folder)


class Source:
    """An evaluation at the job's version scores :data:`SCORES` (or ``scores``) at once."""

    def __init__(self, job: Job, scores: dict[int, float]):
        self.job, self.scores, self.running = job, scores, None

    def start_eval(self, tag: str) -> bool:
        self.running = self.job.version
        return True

    def finish_eval(self) -> dict:
        v, self.running = self.running, None
        return {"reward": self.scores[v], "success_rate": 0.5, "episodes": 4, "version": v}

    def state(self) -> SourceState:
        return SourceState({}, [], 0)


def make_job(run_dir: Path, *overrides: str, scores=SCORES, version=0, run_segment=0) -> Job:
    cfg = load_config(
        None,
        [
            f'logging.run_dir="{run_dir}"',
            "controller.total_steps=40",
            "controller.eval_every=10",
            "controller.keep_checkpoints=2",
            *overrides,
        ],
    )
    j = Job.__new__(Job)  # the parts checkpoints and evaluations use
    j.cfg, j.run_dir, j.version, j.run_segment = cfg, run_dir, version, run_segment
    j.times = Counter()
    j.buffer = TrajectoryBuffer(capacity=8, max_staleness=1)
    j.ledger = lambda *a, **k: None
    j.learner, j.source = Learner(j), Source(j, scores)
    j.keeper = CheckpointKeeper(
        cfg, run_dir, j.learner, j.ledger, version=version, run_segment=run_segment,
        driver_state=lambda folder: write_driver_state(folder, j.buffer, j.source),
    )  # fmt: skip
    j.evals = PinnedEvaluation(j.source, j.keeper, j.times, lambda: None, lambda: j.version)
    return j


def run_loop(j: Job, until: int, on_version=None) -> None:
    """The loop's order (trainer.driver.loop.job._loop) from ``j.version`` to ``until``."""
    c = j.cfg.controller
    j.evals.evaluate("before")
    while j.version < until:
        j.version += 1  # the learner's step applied
        j.evals.finish()  # the evaluation pinned to the outgoing version ends before the next publication
        if c.checkpoint_every and j.version % c.checkpoint_every == 0:
            j.checkpoint()
        if eval_due(j.version, c.eval_every, c.total_steps):
            j.evals.start("during")
        if on_version:
            on_version(j)
    j.evals.finish("after") if j.evals.running else j.evals.evaluate("after")
    j.checkpoint()  # the run's final checkpoint


def test_beats_is_higher_and_finite_ties_keep_the_earlier():
    best = None
    became = []
    for v, r in SCORES.items():
        if beats(r, best):
            best = BestEval(v, r, 0, "during", f"/c/v{v}")
            became.append(v)
    assert became == [0, 10, 20] and best.version == 20
    assert not beats(0.84, best) and beats(0.8400001, best)
    assert not beats(float("nan"), None) and beats(0.0, None)


def test_the_best_version_is_kept_through_pruning(tmp_path):
    """keep_checkpoints = 2, no checkpoint_every: each evaluated version is saved when its evaluation
    starts; v0, v10 go once beaten, v30 at its own (lower) result; the final prune keeps v20 (best)
    and v40 (newest, resume point). The resume point moves back to v20 while v30 is removed."""
    ckpt = tmp_path / "checkpoints"
    seen: dict[int, list[int]] = {}
    j = make_job(tmp_path)
    run_loop(j, 40, on_version=lambda j: seen.setdefault(j.version, checkpointed_versions(ckpt)))
    assert j.learner.saves == [0, 10, 20, 30, 40]  # one save per evaluation during training, then the final one
    assert seen[10] == [0, 10] and seen[11] == [10]  # v0 went when v10 (0.50) beat it
    assert seen[21] == [20] and seen[30] == [20, 30] and seen[31] == [20]  # v30 (0.56 < 0.84) went at its result
    assert checkpointed_versions(ckpt) == [20, 40] and latest_tag(ckpt) == "v40"
    assert (j.keeper.best.version, j.keeper.best.held_out, j.keeper.best.tag) == (20, 0.84, "during")
    assert j.keeper.best.checkpoint == str((ckpt / "v20").resolve())
    assert read_best(ckpt)["version"] == 20 and read_best(ckpt)["held_out"] == 0.84
    assert best_summary(j) == {
        "best_version": 20,
        "best_held_out": 0.84,
        "best_checkpoint": str((ckpt / "v20").resolve()),
    }
    assert best_line(j) == f"best held-out: version 20 (mean reward 0.840), checkpoint {(ckpt / 'v20').resolve()}"
    s = JobStatus(learner_version=40, **best_status(j))
    assert (s.best_version, s.best_held_out) == (20, 0.84)
    # each checkpoint carries the best so far in its driver state (v30's: v20, saved before v30 was scored)
    assert torch.load(ckpt / "v40" / STATE_FILE, weights_only=True)["extra"]["best"]["version"] == 20


def test_resume_point_moves_back_when_an_evaluation_checkpoint_goes(tmp_path):
    """Between v30's save (the resume point) and its result, v30 is the newest checkpoint; once it
    goes, both pointers name v20 again."""
    ckpt = tmp_path / "checkpoints"
    pointers = {}

    def look(j):
        pointers[j.version] = (latest_tag(ckpt), (ckpt / DEEPSPEED_LATEST_FILE).read_text())

    run_loop(make_job(tmp_path), 40, on_version=look)
    assert pointers[30] == ("v30", "v30") and pointers[31] == ("v20", "v20")


def test_regular_checkpoints_are_not_saved_twice_and_follow_keep_checkpoints(tmp_path):
    """checkpoint_every = 10: only v0 is saved for its evaluation (v10..v30 are saved anyway); the
    newest 2 regular ones (v30, v40) stay, and v20 as the best."""
    ckpt = tmp_path / "checkpoints"
    j = make_job(tmp_path, "controller.checkpoint_every=10")
    run_loop(j, 40)
    assert j.learner.saves == [0, 10, 20, 30, 40, 40]  # the loop's v40, then the run's final one
    assert checkpointed_versions(ckpt) == [20, 30, 40]
    assert j.keeper.best.version == 20 and not j.keeper.best.saved_for_it


def test_a_tie_keeps_the_earlier_version(tmp_path):
    ckpt = tmp_path / "checkpoints"
    j = make_job(tmp_path, scores={0: 0.2, 10: 0.84, 20: 0.84, 30: 0.84, 40: 0.84})
    run_loop(j, 40)
    assert j.keeper.best.version == 10 and checkpointed_versions(ckpt) == [10, 40]


def test_the_best_can_be_the_evaluation_after_training(tmp_path):
    ckpt = tmp_path / "checkpoints"
    j = make_job(tmp_path, scores={**SCORES, 40: 0.9})
    run_loop(j, 40)
    assert (j.keeper.best.version, j.keeper.best.tag, j.keeper.best.saved_for_it) == (40, "after", False)
    assert checkpointed_versions(ckpt) == [40] and j.learner.saves == [0, 10, 20, 30, 40]


def test_without_keep_best_or_eval_every_nothing_extra_is_saved(tmp_path):
    for i, off in enumerate(["controller.keep_best=false", "controller.eval_every=0"]):
        j = make_job(tmp_path / str(i), off)
        run_loop(j, 40)
        assert j.learner.saves == [40] and j.keeper.best is None
        assert best_summary(j) == {"best_version": None, "best_held_out": None, "best_checkpoint": None}
        assert best_line(j) is None and best_status(j) == {}
        assert read_best(tmp_path / str(i) / "checkpoints") is None


def test_a_resumed_run_compares_against_the_best_so_far(tmp_path):
    """Segment 0 stops after v30's result with v20 the best (0.84) and the resume point; the run
    resumed from that folder at v20 keeps v20 against a tie at v40 (0.84) and replaces it with v50
    (0.90), removing v20, which was saved only for its evaluation."""
    ckpt = tmp_path / "checkpoints"
    j = make_job(tmp_path, "controller.total_steps=60")
    j.evals.evaluate("before")
    for v in (10, 20, 30):
        j.version = v
        j.evals.finish()
        j.evals.start("during")
    j.evals.finish()  # v30's result: not the best, its checkpoint goes; the resume point is v20 again
    assert latest_tag(ckpt) == "v20" and checkpointed_versions(ckpt) == [20]
    r = make_job(
        tmp_path,
        "controller.total_steps=60",
        f'controller.resume_from="{ckpt}"',
        scores={20: 0.84, 30: 0.5, 40: 0.84, 50: 0.9, 60: 0.1},
        version=20,
        run_segment=1,
    )
    b = r.keeper.best
    assert (b.version, b.held_out, b.run_segment, b.saved_for_it) == (20, 0.84, 0, True)
    assert r.keeper.checkpointed_version == 20  # the resume point is this run's own: not saved again
    seen = {}

    def look(r):
        seen.setdefault(r.version, (r.keeper.best.version, checkpointed_versions(ckpt)))

    run_loop(r, 60, on_version=look)
    assert r.learner.saves == [30, 40, 50, 60]  # the before-evaluation of v20 found its checkpoint
    assert seen[41] == (20, [20])  # v40 tied 0.84: the earlier v20 stays, v40 went
    assert seen[51] == (50, [50])  # v50 (0.90) beat it: v20 went
    assert (r.keeper.best.version, r.keeper.best.run_segment) == (50, 1) and checkpointed_versions(ckpt) == [50, 60]


def test_a_fresh_run_drops_an_earlier_runs_record(tmp_path):
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    (ckpt / BEST_FILE).write_text(json.dumps({"version": 3}))
    assert make_job(tmp_path).keeper.best is None and not (ckpt / BEST_FILE).exists()


def test_export_best_resolves_to_the_best_versions_checkpoint(tmp_path):
    run_loop(make_job(tmp_path), 40)
    assert best_version(tmp_path) == 20 and checkpoint_tag(tmp_path, "best") == "v20"
    (tmp_path / "checkpoints" / BEST_FILE).unlink()  # summary.json names it too
    (tmp_path / "summary.json").write_text(json.dumps({"best_version": 20, "best_held_out": 0.84}))
    assert checkpoint_tag(tmp_path, "best") == "v20"
    assert checkpoint_tag(tmp_path, "latest") == "v40" and checkpoint_tag(tmp_path, 40) == "v40"


def test_export_best_without_a_best_version_is_one_line_naming_the_flag_and_run(tmp_path):
    run = tmp_path / "run"
    run_loop(make_job(run, "controller.eval_every=0"), 40)
    (run / "config.resolved.json").write_text(json.dumps({"model": {"path": "tiny", "tiny_seed": 0}}))
    want = (
        f"--version best: '{run}' has no best version (no pinned held-out evaluation was kept: "
        "it needs controller.eval_every > 0 and controller.keep_best = true)"
    )
    with pytest.raises(ExportError) as e:
        checkpoint_tag(run, "best")
    assert str(e.value) == want
    r = CliRunner().invoke(app, ["export", str(run), "--version", "best", "--out", str(tmp_path / "out")])
    assert r.exit_code == 2 and r.output.strip().splitlines() == [f"export error: {want}"]
    assert not (tmp_path / "out").exists()


def test_export_best_names_the_version_when_its_checkpoint_is_gone(tmp_path):
    run_loop(make_job(tmp_path), 40)
    shutil.rmtree(tmp_path / "checkpoints" / "v20")
    with pytest.raises(
        ExportError, match=r"^--version best \(version 20\): not checkpointed in .* \(checkpointed: 40\)$"
    ):
        checkpoint_tag(tmp_path, "best")


def test_a_malformed_record_stops_the_resume_naming_the_field(tmp_path):
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    (ckpt / BEST_FILE).write_text(json.dumps({"version": 20, "held_out": "high"}))
    with pytest.raises(ValueError, match="^vintage_best.json: held_out = 'high' is not a number$"):
        make_job(tmp_path, f'controller.resume_from="{ckpt}"', version=20, run_segment=1)


def test_the_checkpoints_cost_in_seconds_and_bytes(tmp_path, monkeypatch):
    """Saves that take 2, 5 and 3 s on a stand-in clock give a median of 3 s; one folder is the
    state file the stand-in learner writes and the driver's trajectories file (their sizes read back
    from disk); no save: 0 and None."""
    import trainer.driver.records.keeper as keeper_module

    j = make_job(tmp_path)
    assert j.keeper.cost() == {
        "checkpoints": 0, "recovery_checkpoints": 0, "checkpoint_s_median": None, "checkpoint_bytes": 0
    }  # fmt: skip
    ticks = iter([0.0, 2.0, 10.0, 15.0, 20.0, 23.0])  # (start, end) of each save
    monkeypatch.setattr(keeper_module, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: next(ticks))}))
    for v in (1, 2, 3):
        j.version = v
        j.checkpoint()
    files = sorted((tmp_path / "checkpoints" / "v3").iterdir())
    assert [p.name for p in files] == sorted([STATE_FILE, TRAJECTORIES_FILE])
    size = sum(p.stat().st_size for p in files)
    assert j.keeper.cost() == {
        "checkpoints": 3, "recovery_checkpoints": 0, "checkpoint_s_median": 3.0, "checkpoint_bytes": size
    }  # fmt: skip


def run_with_recovery(j: Job, until: int, step_s: float, seen: dict | None = None) -> None:
    """The loop's checkpoint order (trainer.driver.loop.job._loop): a regular checkpoint every
    ``checkpoint_every`` versions, else a recovery one when due; ``step_s`` seconds a version on a
    stand-in clock; ``seen`` gets the checkpoint folders after each version."""
    clock = {"t": 0.0}
    j.keeper.clock, j.keeper._last_save = (lambda: clock["t"]), 0.0
    every = j.cfg.controller.checkpoint_every
    while j.version < until:
        j.version += 1
        clock["t"] += step_s
        if every and j.version % every == 0:
            j.checkpoint()
        elif j.keeper.recovery_due(j.version):
            j.checkpoint(recovery=True)
        if seen is not None:
            seen[j.version] = checkpointed_versions(j.keeper.checkpoints_dir)
    j.checkpoint()  # the run's final checkpoint


def test_a_recovery_checkpoint_gives_way_to_the_next_save(tmp_path):
    """Recovery every 100 s, 30 s a version, a regular checkpoint every 5 versions, 2 kept: a
    recovery checkpoint is due 120 s after a save, at versions 4, 9, 14 and 19; each goes at the next
    regular save and none pushes a regular one out (v14's stays beside v5 and v10); the final
    checkpoint of v19 makes its recovery checkpoint a regular one, so v15 and v19 stay."""
    j = make_job(tmp_path, "controller.eval_every=0", "controller.checkpoint_every=5",
                 "controller.recovery_checkpoint_s=100")  # fmt: skip
    seen: dict[int, list[int]] = {}
    run_with_recovery(j, 19, 30.0, seen)
    assert seen[4] == [4] and seen[5] == [5] and seen[9] == [5, 9] and seen[10] == [5, 10]
    assert seen[14] == [5, 10, 14] and seen[15] == [10, 15] and seen[19] == [10, 15, 19]
    assert checkpointed_versions(tmp_path / "checkpoints") == [15, 19] and latest_tag(tmp_path / "checkpoints") == "v19"
    assert j.keeper.cost()["checkpoints"] == 8 and j.keeper.cost()["recovery_checkpoints"] == 4


def test_recovery_checkpoints_alone_keep_only_the_newest_and_the_best(tmp_path):
    """No regular cadence: recovery checkpoints at versions 4, 8 and 12 (120 s apart), each
    replacing the one before, except v4 while it holds the best evaluation; the final one at 13."""
    j = make_job(tmp_path, "controller.eval_every=0", "controller.recovery_checkpoint_s=100")
    j.keeper.best = BestEval(4, 0.9, 0, "during", str(tmp_path / "checkpoints" / "v4"), False)
    seen: dict[int, list[int]] = {}
    run_with_recovery(j, 13, 30.0, seen)
    assert seen[4] == [4] and seen[8] == [4, 8] and seen[12] == [4, 12]
    assert checkpointed_versions(tmp_path / "checkpoints") == [4, 13]
    assert j.keeper.cost()["recovery_checkpoints"] == 3


def save(j: Job, version: int, **kind: bool) -> None:
    """The job at ``version`` saves its checkpoint (the stand-in learner saves the job's version)."""
    j.version = version
    j.keeper.checkpoint(version, **kind)


def test_a_recovery_checkpoint_that_was_the_best_goes_once_beaten(tmp_path):
    """A recovery save at v5 that its evaluation makes the best stays past the regular save of v6;
    when v10 scores higher it goes like any recovery checkpoint (keep_checkpoints 0 keeps the
    regular ones: v6, v10)."""
    j = make_job(tmp_path, "controller.keep_checkpoints=0", "controller.eval_every=5")
    k = j.keeper
    save(j, 5, for_recovery=True)
    k.note_best({"version": 5, "reward": 0.5, "tag": "during"})
    save(j, 6)
    assert checkpointed_versions(k.checkpoints_dir) == [5, 6] and k.best.version == 5
    save(j, 10)
    k.note_best({"version": 10, "reward": 0.9, "tag": "during"})
    assert checkpointed_versions(k.checkpoints_dir) == [6, 10] and k.best.version == 10


def test_a_run_resumed_from_a_recovery_checkpoint_still_treats_it_as_one(tmp_path):
    """Recovery at v5 is the resume point when the job stops; the job resumed from its own folder
    reads vintage_recovery.json, and its first regular save (v8) removes v5."""
    j = make_job(tmp_path, "controller.keep_checkpoints=0")
    save(j, 5, for_recovery=True)
    assert read_recovery(tmp_path / "checkpoints") == {5}
    ckpt = f'controller.resume_from="{tmp_path / "checkpoints"}"'
    resumed = make_job(tmp_path, "controller.keep_checkpoints=0", ckpt, version=5, run_segment=1)
    save(resumed, 8)
    assert checkpointed_versions(tmp_path / "checkpoints") == [8] and read_recovery(tmp_path / "checkpoints") == set()


def test_an_export_keeps_the_recovery_checkpoint_of_its_version(tmp_path, monkeypatch):
    """A recovery save at v4 then the export of v4: the checkpoint becomes a regular one and stays
    after the recovery save of v8; no version is saved twice."""
    import trainer.driver.records.export as export_module

    monkeypatch.setattr(export_module, "export_run", lambda *a, **k: None)
    j = make_job(tmp_path, "controller.keep_checkpoints=0")
    save(j, 4, for_recovery=True)
    j.keeper.export(4)
    save(j, 8, for_recovery=True)
    assert checkpointed_versions(j.keeper.checkpoints_dir) == [4, 8] and j.learner.saves == [4, 8]


def test_no_recovery_checkpoint_of_a_version_already_saved(tmp_path):
    """600 s after the save of v3 with no step applied since: nothing is due at v3, one is at v4."""
    j = make_job(tmp_path, "controller.recovery_checkpoint_s=600")
    clock = {"t": 0.0}
    j.keeper.clock = lambda: clock["t"]
    j.version = 3
    j.checkpoint()
    clock["t"] = 600.0
    assert not j.keeper.recovery_due(3) and j.keeper.recovery_due(4)


def test_the_recovery_list_round_trips_and_refuses_what_is_not_one(tmp_path):
    write_recovery(tmp_path, {12, 5})
    assert json.loads((tmp_path / "vintage_recovery.json").read_text()) == [5, 12]
    assert read_recovery(tmp_path) == {5, 12}
    write_recovery(tmp_path, set())
    assert not (tmp_path / "vintage_recovery.json").exists() and read_recovery(tmp_path) == set()
    (tmp_path / "vintage_recovery.json").write_text('{"v": 5}')
    with pytest.raises(ValueError, match=r"vintage_recovery.json: not a list of versions: \{'v': 5\}"):
        read_recovery(tmp_path)
