"""The process environment a vintage job runs with: defaults and the variables passed to Ray workers.

Imports neither Ray nor the driver, so test fixtures and tools can apply the same defaults.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

ENV_VARS = (
    "OMP_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "GOMP_SPINCOUNT",
    "DS_ACCELERATOR",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "TOKENIZERS_PARALLELISM",
    "VINTAGE_CACHE_DIR",
    "HF_HUB_DISABLE_PROGRESS_BARS",
    "VLLM_LOGGING_LEVEL",
    "TRANSFORMERS_VERBOSITY",
    "TORCH_EXTENSIONS_DIR",
    "PYTHONWARNINGS",
    "TORCH_CPP_LOG_LEVEL",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_ARENA_MAX",
    "GLIBC_TUNABLES",
)
"""Variables every Ray worker of the job takes from the driver's environment where they are set:
threads and how idle OpenMP threads wait, offline hubs, log levels, the DeepSpeed build folder and
glibc's allocator settings."""


MMAP_THRESHOLD_BYTES = 1 << 20
"""glibc's ``MALLOC_MMAP_THRESHOLD_`` for the job's processes: blocks of at least this many bytes
(activations, gradients, logit chunks) are mapped on their own and returned to the system when
freed. Left unset, glibc raises its threshold up to 32 MiB after the first large frees and keeps
freed heap blocks resident (measured in docs/benchmarks.md, "A whole job's memory"). glibc reads it
when a process starts, so it reaches the Ray workers and their children, not the running driver.
Not set where the environment sets a threshold of its own: ``MALLOC_MMAP_THRESHOLD_`` (33554432,
the ceiling glibc's own threshold rises to, comes closest to glibc's behaviour) or
``glibc.malloc.mmap_threshold`` in ``GLIBC_TUNABLES``."""


def worker_env(environ: Mapping[str, str], yield_to_learner: bool) -> dict[str, str]:
    """The variables every Ray worker of a job starts with: those of :data:`ENV_VARS` set in
    ``environ`` (the driver's), and ``OMP_WAIT_POLICY=PASSIVE`` where the thread plan has the other
    parts yield to the learner (:class:`modelkit.cores.ThreadPlan`) and ``environ`` sets no policy.

    Passive waiting: an OpenMP thread out of work sleeps at once instead of spinning for a while
    (libgomp's default), so the learner's idle threads between parallel regions leave their core to
    the rollout workers and the old-logit service, which run at idle priority and would otherwise
    find no core free while the learner trains. Example: ``{"OMP_NUM_THREADS": "1", "HOME": "/root"}``
    with yielding -> ``{"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}``."""
    env = {k: environ[k] for k in ENV_VARS if k in environ}
    if yield_to_learner:
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def defaults_env() -> None:
    """Set the job's environment defaults (threads, offline hubs, Ray's memory monitor off, one DeepSpeed
    JIT build per virtual environment, glibc's mmap threshold, the DeepSpeed accelerator) where the
    variable is unset."""
    for k, v in (
        ("OMP_NUM_THREADS", "1"),
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("TOKENIZERS_PARALLELISM", "false"),
        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
        ("RAY_memory_monitor_refresh_ms", "0"),
        ("VLLM_LOGGING_LEVEL", "ERROR"),
        ("TRANSFORMERS_VERBOSITY", "error"),
        # library deprecation notices (torch.distributed, transformers) are not the user's business
        ("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning"),
        # torch's C++ log below ERROR (vLLM CPU's NUMA-binding notice at every engine start)
        ("TORCH_CPP_LOG_LEVEL", "ERROR"),
        # DeepSpeed's JIT ops (the CPU comm op) build once per virtual environment: two venvs
        # sharing ~/.cache/torch_extensions invalidate each other's build on every learner start.
        ("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions")),
        ("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD_BYTES)),
    ):
        if k == "MALLOC_MMAP_THRESHOLD_" and "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
            continue  # the environment's own threshold, set the tunables' way
        os.environ.setdefault(k, v)
    try:
        import torch

        os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    except ImportError:  # pragma: no cover
        pass
