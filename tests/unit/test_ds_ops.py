"""A DeepSpeed build lock that no live build holds is cleared; one in use is kept."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from trainer.learner.ds_ops import clear_stale_build_locks


def _lock(folder, age_s):
    folder.mkdir(parents=True)
    lock = folder / "lock"
    lock.write_text("")
    t = time.time() - age_s
    os.utime(lock, (t, t))
    return lock


def test_stale_lock_removed_fresh_and_busy_locks_kept(tmp_path):
    stale = _lock(tmp_path / "op_a", age_s=120)
    fresh = _lock(tmp_path / "op_b", age_s=1)  # a build may be starting: too young to judge
    busy = _lock(tmp_path / "op_c", age_s=120)
    # a live "build": a process whose working directory is the op's folder
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=busy.parent)
    try:
        time.sleep(0.2)
        removed = clear_stale_build_locks(tmp_path, min_age_s=30)
    finally:
        proc.kill()
        proc.wait()
    assert removed == [stale]
    assert not stale.exists() and fresh.exists() and busy.exists()
    assert clear_stale_build_locks(tmp_path / "missing") == []
