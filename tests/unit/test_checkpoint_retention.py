"""Which checkpoints ``controller.keep_checkpoints`` removes, by hand, on folders laid out as the
learner writes them (``v{N}/vintage_state.pt`` marks a complete one, ``vintage_latest`` the resume point).
The retention rule keeps the newest N regular checkpoints, the resume point and the best version
(``controller.keep_best``)."""

from __future__ import annotations

import pytest

from trainer.driver.config.schema import load_config
from trainer.learner.checkpoint import (
    DEEPSPEED_LATEST_FILE,
    LATEST_FILE,
    STATE_FILE,
    checkpointed_versions,
    checkpoints_to_remove,
    latest_tag,
    prune_checkpoints,
    remove_checkpoint,
)


def lay_out(folder, versions, latest):
    for v in versions:
        (folder / f"v{v}").mkdir()
        (folder / f"v{v}" / STATE_FILE).write_bytes(b"x")
    (folder / LATEST_FILE).write_text(f"v{latest}")
    (folder / DEEPSPEED_LATEST_FILE).write_text(f"v{latest}")


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


def test_the_best_is_never_pruned():
    """Evaluated at 0, 10, 20, 30, 40 with 0.20, 0.50, 0.84, 0.56, 0.48: the best is v20. Checkpoints
    v10..v40 (checkpoint_every = 10), keep 2, resume point v40: v30 and v40 are the newest, v20 the best."""
    assert checkpoints_to_remove([10, 20, 30, 40], latest=40, keep=2, best=20) == [10]
    assert checkpoints_to_remove([10, 20, 30, 40], latest=40, keep=2) == [10, 20]  # without a best
    assert checkpoints_to_remove([10, 20, 30, 40], latest=40, keep=1, best=40) == [10, 20, 30]  # newest and best
    assert checkpoints_to_remove([10, 20, 30, 40], latest=40, keep=0, best=20) == []  # 0: every one stays


def test_a_checkpoint_saved_only_for_its_evaluation_is_not_among_the_newest():
    """v20 was saved only because it was evaluated (no checkpoint_every at 20); regular v10, v30,
    v40 with keep 2: the two newest regular ones stay, and v20 while it is the best."""
    assert checkpoints_to_remove([10, 20, 30, 40], latest=40, keep=2, best=20, extra=(20,)) == [10]
    assert checkpoints_to_remove([10, 20, 25, 30], latest=30, keep=2, best=20, extra=(20,)) == [10]
    # an evaluation-only checkpoint that is not the best goes even when every regular one stays
    assert checkpoints_to_remove([10, 20, 30], latest=30, keep=0, best=10, extra=(20,)) == [20]


def test_prune_keeps_the_best(tmp_path):
    lay_out(tmp_path, (10, 20, 30, 40), latest=40)
    assert prune_checkpoints(tmp_path, keep=1, best=20) == [10, 30]
    assert checkpointed_versions(tmp_path) == [20, 40]


def test_removing_the_resume_point_moves_both_pointers_back(tmp_path):
    """v30 (the resume point) goes: vintage_latest and DeepSpeed's latest name v20, the newest left;
    removing a checkpoint that is not the resume point leaves the pointers; the last one removes them."""
    lay_out(tmp_path, (10, 20, 30), latest=30)
    assert remove_checkpoint(tmp_path, 30) == "v20"
    assert latest_tag(tmp_path) == "v20" and (tmp_path / DEEPSPEED_LATEST_FILE).read_text() == "v20"
    assert checkpointed_versions(tmp_path) == [10, 20]
    assert remove_checkpoint(tmp_path, 10) == "v20" and latest_tag(tmp_path) == "v20"
    assert remove_checkpoint(tmp_path, 20) is None
    assert latest_tag(tmp_path) is None and not (tmp_path / DEEPSPEED_LATEST_FILE).exists()
    assert checkpointed_versions(tmp_path) == []
