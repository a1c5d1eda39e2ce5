"""The machine facts every benchmark's JSON records next to its numbers."""

from __future__ import annotations

import os
import platform
import time

import torch


def machine_facts(t0: float) -> dict:
    """torch version and threads, CPU architecture and count, Python version, and the wall seconds
    since ``t0`` (a ``time.perf_counter()`` reading taken when the benchmark started)."""
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "wall_s": time.perf_counter() - t0,
    }
