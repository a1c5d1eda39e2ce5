"""The environment of a job's processes: glibc's mmap threshold at 1 MiB (a block of 1 MiB or
more is mapped on its own and unmapped when freed, a smaller one comes from the heap; checked in a
child process through glibc's ``mallinfo2``, ``hblks``: blocks mapped on their own), a user's own
setting kept, and what Ray's workers start with."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.driver.cluster.environment import ENV_VARS, MMAP_THRESHOLD_BYTES

REPO = Path(__file__).resolve().parents[2]

MAPPED = """
import ctypes
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
counts = []
for size in (512 << 10, 2 << 20):
    before = libc.mallinfo2().hblks
    libc.malloc(size)
    counts.append(libc.mallinfo2().hblks - before)
print(*counts)
"""


def _mapped_in_a_child(user_value: str | None) -> list[int]:
    """Blocks mapped on their own by a 512 KiB and a 2 MiB ``malloc`` in a child of a process that
    ran :func:`defaults_env` (with ``MALLOC_MMAP_THRESHOLD_`` = ``user_value`` before it, or unset)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}
    if user_value is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = user_value
    env["PYTHONPATH"] = str(REPO)
    code = (
        "import subprocess, sys; from trainer.driver.cluster.environment import defaults_env; defaults_env(); "
        f"sys.stdout.write(subprocess.run([sys.executable, '-c', {MAPPED!r}], capture_output=True, text=True, check=True).stdout)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return [int(x) for x in out.stdout.split()]


GLIBC = platform.libc_ver()
needs_mallinfo2 = pytest.mark.skipif(
    GLIBC[0] != "glibc" or tuple(int(x) for x in GLIBC[1].split(".")[:2]) < (2, 33),
    reason=f"glibc >= 2.33 (mallinfo2) needed, this is {GLIBC[0] or 'another C library'} {GLIBC[1]}",
)


@needs_mallinfo2
def test_a_jobs_child_maps_blocks_of_one_mib_or_more_and_keeps_smaller_ones_on_the_heap():
    assert MMAP_THRESHOLD_BYTES == 1 << 20 and "MALLOC_MMAP_THRESHOLD_" in ENV_VARS  # Ray's workers too
    assert _mapped_in_a_child(None) == [0, 1]  # 512 KiB from the heap, 2 MiB mapped


@needs_mallinfo2
def test_a_users_own_threshold_is_kept():
    assert _mapped_in_a_child(str(256 << 10)) == [1, 1]  # 256 KiB: both blocks mapped


def test_ray_workers_take_the_listed_variables_and_wait_passively_when_the_others_yield():
    from trainer.driver.cluster.environment import worker_env

    driver = {"OMP_NUM_THREADS": "1", "HOME": "/root", "MALLOC_MMAP_THRESHOLD_": "1048576"}
    assert worker_env(driver, yield_to_learner=False) == {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "1048576"}
    assert worker_env(driver, yield_to_learner=True) == {
        "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "1048576", "OMP_WAIT_POLICY": "PASSIVE"
    }  # fmt: skip
    own = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}
    assert worker_env(own, yield_to_learner=True) == own  # a policy of the user's own is kept


def test_a_threshold_set_through_glibcs_tunables_is_left_alone(monkeypatch):
    from trainer.driver.cluster.environment import defaults_env

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=262144")
    defaults_env()
    assert "MALLOC_MMAP_THRESHOLD_" not in os.environ
