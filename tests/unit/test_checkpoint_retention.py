"""Which checkpoints ``controller.keep_checkpoints`` removes, by hand, on folders laid out as the
learner writes them (``v{N}/vintage_state.pt`` marks a complete one, ``vintage_latest`` the resume point)."""

from __future__ import annotations

import pytest

from trainer.driver.config import load_config
from trainer.learner.checkpoint import (
    LATEST_FILE,
    STATE_FILE,
    checkpointed_versions,
    checkpoints_to_remove,
    prune_checkpoints,
)


def test_the_newest_stay_and_the_resume_point_too():
    assert checkpoints_to_remove([2, 4, 6, 8], latest=8, keep=2) == [2, 4]
    assert checkpoints_to_remove([2, 4, 6, 8], latest=4, keep=1) == [2, 6]
    assert checkpoints_to_remove([2, 4, 6, 8], latest=8, keep=0) == []  # 0: every one stays
    assert checkpoints_to_remove([2], latest=None, keep=3) == []


def test_prune_removes_only_complete_checkpoints_outside_the_kept_ones(tmp_path):
    for v in (1, 2, 3, 4):
        (tmp_path / f"v{v}").mkdir()
        (tmp_path / f"v{v}" / STATE_FILE).write_bytes(b"x")
    (tmp_path / "v5").mkdir()  # a save cut off before its state file: not a checkpoint, left alone
    (tmp_path / LATEST_FILE).write_text("v4")
    (tmp_path / "latest").write_text("v4")  # DeepSpeed's own pointer
    assert prune_checkpoints(tmp_path, keep=2) == [1, 2]
    assert checkpointed_versions(tmp_path) == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "v3", "v4", "v5", LATEST_FILE]
    assert prune_checkpoints(tmp_path, keep=0) == []


def test_the_setting_refuses_a_negative_count():
    assert load_config(None, ["controller.keep_checkpoints=3"]).controller.keep_checkpoints == 3
    with pytest.raises(ValueError, match="keep_checkpoints"):
        load_config(None, ["controller.keep_checkpoints=-1"])
