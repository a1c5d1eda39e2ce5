"""DeepSpeed's JIT-built CPU op: built once per virtual environment, and never waited on forever.

On CPU, DeepSpeed builds its shared-memory communication op (``deepspeed_shm_comm``) with torch's
C++ extension loader the first time a process group starts, under ``$TORCH_EXTENSIONS_DIR``. The
loader guards a build with a ``lock`` file in the op's folder and waits, without limit, while that
file exists; a build killed midway leaves it behind and every later learner start hangs.

* :func:`prebuild_cpu_comm_op` builds the op ahead of time (``make install`` calls it);
* :func:`clear_stale_build_locks` (called before every learner start, and before the prebuild)
  removes a lock that no live build holds: one older than
  ``min_age_s`` while no process has its working directory in the op's folder (ninja and the
  compiler run there for the whole build).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def extensions_dir() -> Path:
    """``$TORCH_EXTENSIONS_DIR``, or the per-venv default the job sets (``<sys.prefix>/torch_extensions``)."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path(sys.prefix) / "torch_extensions")


def _busy_dirs() -> set[Path]:
    import psutil

    out = set()
    for p in psutil.process_iter(["cwd"]):
        cwd = p.info.get("cwd")
        if cwd:
            out.add(Path(cwd))
    return out


def clear_stale_build_locks(root: Path | None = None, min_age_s: float = 30.0) -> list[Path]:
    """Remove ``<root>/*/lock`` files that no live build holds; returns the removed paths.

    A lock is stale when it is older than ``min_age_s`` seconds and no process has its working
    directory in (or below) that op's folder.
    """
    root = root or extensions_dir()
    locks = [p for p in root.glob("*/lock") if time.time() - p.stat().st_mtime > min_age_s] if root.is_dir() else []
    if not locks:
        return []
    busy = _busy_dirs()
    removed = []
    for lock in locks:
        folder = lock.parent.resolve()
        if not any(d == folder or folder in d.parents for d in busy):
            lock.unlink(missing_ok=True)
            removed.append(lock)
    return removed


def prebuild_cpu_comm_op() -> str | None:
    """Build (or load the cached build of) DeepSpeed's CPU communication op; returns its name.

    Returns None when the accelerator is not the CPU or DeepSpeed marks the op incompatible.
    """
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return None
    clear_stale_build_locks()
    from deepspeed.comm.torch import build_shm_op

    return "deepspeed_shm_comm" if build_shm_op() is not None else None


if __name__ == "__main__":  # pragma: no cover - `make install`
    print("DeepSpeed CPU comm op:", prebuild_cpu_comm_op() or "not needed here")
