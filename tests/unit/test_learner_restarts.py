"""The in-run learner restart around ``run_job``: which failures restart the run, from where, how
many times, and what the summary says. ``run_job`` is a stand-in here (the logic around it is
under test); the real killed learner is in ``tests/integration/test_faults.py``."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

import trainer.driver.loop.job as job_module
from trainer.driver.config.schema import load_config
from trainer.learner.checkpoint import LATEST_FILE


def config(tmp_path, restarts: int):
    return load_config(
        None,
        ['model.path="tiny"', f'logging.run_dir="{tmp_path}"', "controller.checkpoint_every=1",
         f"controller.max_learner_restarts={restarts}"],
    )  # fmt: skip


def scripted(tmp_path, outcomes: list[BaseException | None], seen: list, saves: bool = True):
    """A run_job that records the resume point it was given and fails as ``outcomes`` say in turn
    (None: finishes, writing its summary as run_job does); with ``saves``, a run that fails has
    saved a checkpoint first (v3 becomes the resume point of an existing checkpoints folder)."""

    def run_job(cfg, console=None):
        seen.append(cfg.controller.resume_from)
        outcome = outcomes.pop(0)
        if outcome is not None:
            if saves and (tmp_path / "checkpoints").is_dir():
                (tmp_path / "checkpoints" / LATEST_FILE).write_text("v3")
            raise outcome
        summary = {"state": "finished", "end_reason": "completed"}
        (tmp_path / "summary.json").write_text(json.dumps(summary))
        return summary

    return run_job


def checkpointed(tmp_path) -> str:
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    (ckpt / LATEST_FILE).write_text("v2")
    return str(ckpt)


def test_a_learner_failure_restarts_the_run_from_its_checkpoint_and_the_summary_counts_it(tmp_path, monkeypatch):
    """Two learner failures with 2 restarts allowed: three starts, the first fresh, the next two
    from ``<run_dir>/checkpoints``; the summary and summary.json say 2."""
    ckpt, seen = checkpointed(tmp_path), []
    died = RuntimeError("learner: killed by the kernel's out-of-memory killer (oom_kill 0 -> 1)")
    monkeypatch.setattr(job_module, "run_job", scripted(tmp_path, [died, died, None], seen))
    summary = job_module.run_with_restarts(config(tmp_path, 2), Console(quiet=True))
    assert seen == [None, ckpt, ckpt]
    assert summary["learner_restarts"] == 2
    assert json.loads((tmp_path / "summary.json").read_text()) == {**summary}


def test_restarts_end_when_used_up_for_other_parts_and_without_a_checkpoint(tmp_path, monkeypatch):
    died = RuntimeError("learner: gone")
    seen: list = []
    monkeypatch.setattr(job_module, "run_job", scripted(tmp_path, [died], seen))
    with pytest.raises(RuntimeError, match="learner: gone"):  # no checkpoint yet
        job_module.run_with_restarts(config(tmp_path, 1), Console(quiet=True))
    checkpointed(tmp_path)
    monkeypatch.setattr(job_module, "run_job", scripted(tmp_path, [died, died], seen := []))
    with pytest.raises(RuntimeError, match="learner: gone"):  # one restart allowed, two failures
        job_module.run_with_restarts(config(tmp_path, 1), Console(quiet=True))
    assert len(seen) == 2
    other = RuntimeError("old-logit service: gone")
    monkeypatch.setattr(job_module, "run_job", scripted(tmp_path, [other], seen := []))
    with pytest.raises(RuntimeError, match="old-logit service"):
        job_module.run_with_restarts(config(tmp_path, 3), Console(quiet=True))
    assert seen == [None]


def test_learner_restarts_need_checkpoints():
    """By default a run restarts its learner once, from recovery checkpoints every 600 s; restarts
    with no checkpoint cadence at all are refused in one line naming the settings."""
    c = load_config(None, ['model.path="tiny"']).controller
    assert (c.max_learner_restarts, c.recovery_checkpoint_s, c.checkpoint_every) == (1, 600.0, 0)
    load_config(None, ['model.path="tiny"', "controller.recovery_checkpoint_s=0", "controller.checkpoint_every=5"])
    refused = r"max_learner_restarts: 1 needs controller.checkpoint_every > 0 or controller.recovery_checkpoint_s > 0"
    with pytest.raises(ValueError, match=refused):
        load_config(None, ['model.path="tiny"', "controller.recovery_checkpoint_s=0"])
    load_config(None, ['model.path="tiny"', "controller.recovery_checkpoint_s=0", "controller.max_learner_restarts=0"])


def test_a_learner_that_fails_to_start_is_not_restarted(tmp_path, monkeypatch):
    """A start-up failure of the learner (summary.json: ``failed: start-up: learner``) would fail
    the same way again: raised at once, one start, even with a checkpoint and restarts left."""
    checkpointed(tmp_path)
    seen: list = []
    timeout = RuntimeError("learner: 1 rank(s) not started within controller.start_timeout_s = 5.0 s")

    def run_job(cfg, console=None):
        seen.append(cfg.controller.resume_from)
        (tmp_path / "summary.json").write_text(json.dumps({"end_reason": "failed: start-up: learner"}))
        raise timeout

    monkeypatch.setattr(job_module, "run_job", run_job)
    with pytest.raises(RuntimeError, match="not started within"):
        job_module.run_with_restarts(config(tmp_path, 2), Console(quiet=True))
    assert seen == [None]


def test_a_checkpoint_an_earlier_run_left_is_not_restarted_from(tmp_path, monkeypatch):
    """The folder holds an earlier run's v2 when a fresh run starts; its learner dies before the run
    saves anything: no restart (it would continue the other run). A run resumed from that folder
    may restart from it."""
    checkpointed(tmp_path)
    died = RuntimeError("learner: the actor died unexpectedly")
    monkeypatch.setattr(job_module, "run_job", scripted(tmp_path, [died], seen := [], saves=False))
    with pytest.raises(RuntimeError, match="actor died"):
        job_module.run_with_restarts(config(tmp_path, 1), Console(quiet=True))
    assert seen == [None]
    resumed = load_config(
        None,
        ['model.path="tiny"', f'logging.run_dir="{tmp_path}"', "controller.checkpoint_every=1",
         f'controller.resume_from="{tmp_path / "checkpoints"}"'],
    )  # fmt: skip
    monkeypatch.setattr(job_module, "run_job", scripted(tmp_path, [died, None], seen := [], saves=False))
    assert job_module.run_with_restarts(resumed, Console(quiet=True))["learner_restarts"] == 1
