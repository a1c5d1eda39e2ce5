"""Cores to whoever needs them: torch thread counts per part of a job and the CPU priority of the
parts that yield to the learner.

A job's processes on one machine are the learner's ranks, the rollout workers and the old-logit
service. :func:`plan_threads` splits the machine's cores between them (pure; hand-checked in
``tests/unit/test_cores.py``):

- **small box** (fewer cores than processes, e.g. 2 cores for learner + worker + service): the
  learner trains on every core (``cores // learner_ranks`` threads per rank) and the rollout
  workers and the old-logit service run one thread each at Linux's idle CPU priority
  (``SCHED_IDLE``, :func:`yield_cpu`), so they use only the cycles a learner step leaves (its
  serial parts, and every gap between steps) instead of slowing it down;
- **otherwise** every other process keeps its threads (1 each unless set) on cores of its own and
  the learner's ranks share the rest; nobody yields.

Explicit settings override either rule. :func:`torch_threads` sets torch's intra-op threads of the
calling thread for a block (the learner wraps each training step in it). Imports torch lazily.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

AUTO = "auto"
Threads = int | Literal["auto"]
"""A thread-count setting: a whole number >= 1 or ``"auto"`` (:func:`plan_threads` decides)."""
Yield = bool | Literal["auto"]


def available_cores() -> int:
    """CPUs this process may run on (its affinity mask; ``os.cpu_count()`` where there is none), >= 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def check_threads(field: str, value: object) -> Threads:
    """``value`` as a thread-count setting, or a one-line ``ValueError`` naming ``field`` and the value.

    Accepts ``"auto"`` and integers >= 1 (bools and floats are refused). Example:
    ``check_threads("learner.threads", 0)`` raises ``learner.threads: must be "auto" or a whole
    number >= 1, got 0``.
    """
    if value == AUTO or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value  # type: ignore[return-value]
    raise ValueError(f'{field}: must be "auto" or a whole number >= 1, got {value!r}')


@dataclass(frozen=True)
class ThreadPlan:
    """Torch threads per process of each part and whether the non-learner parts yield.

    Attributes:
        cores: the cores the job's processes share.
        learner: intra-op threads of each learner rank during a training step.
        rollout: intra-op threads of each rollout worker's generation thread.
        oldlogit: intra-op threads of the old-logit service.
        yield_to_learner: rollout workers and the old-logit service run at idle CPU priority.
    """

    cores: int
    learner: int
    rollout: int
    oldlogit: int
    yield_to_learner: bool


def plan_threads(
    cores: int,
    *,
    learner: Threads = AUTO,
    rollout: Threads = AUTO,
    oldlogit: Threads = AUTO,
    yield_to_learner: Yield = AUTO,
    learner_ranks: int = 1,
    rollout_workers: int = 1,
    oldlogit_service: bool = True,
) -> ThreadPlan:
    """The :class:`ThreadPlan` for ``cores`` cores shared by ``learner_ranks`` learner ranks,
    ``rollout_workers`` rollout workers and (``oldlogit_service``) the old-logit service.

    Rule for ``"auto"`` (see the module docstring): ``rollout`` and ``oldlogit`` 1;
    ``yield_to_learner`` when ``cores < learner_ranks + rollout_workers + oldlogit_service``;
    ``learner`` ``cores // learner_ranks`` when yielding, else
    ``(cores - rollout_workers * rollout - oldlogit_service * oldlogit) // learner_ranks``, at least 1.
    Examples: 2 cores, 1 rank, 1 worker, a service: learner 2, rollout 1, oldlogit 1, yield;
    16 cores, 2 ranks, 4 workers, a service: learner 5, rollout 1, oldlogit 1, no yield.

    Raises:
        ValueError: ``cores`` or ``learner_ranks`` < 1, ``rollout_workers`` < 0, or an explicit thread
            count above ``cores`` (one line naming the setting and both values).
    """
    if cores < 1:
        raise ValueError(f"machine.cores: must be >= 1, got {cores}")
    if learner_ranks < 1 or rollout_workers < 0:
        raise ValueError(f"learner ranks must be >= 1 and rollout workers >= 0, got {learner_ranks}, {rollout_workers}")
    for field, value in (("learner.threads", learner), ("rollout.threads", rollout), ("oldlogit.threads", oldlogit)):
        check_threads(field, value)
        if value != AUTO and int(value) > cores:
            raise ValueError(f"{field}: {value} threads > machine.cores = {cores}")
    r = 1 if rollout == AUTO else int(rollout)
    o = 1 if oldlogit == AUTO else int(oldlogit)
    processes = learner_ranks + rollout_workers + int(oldlogit_service)
    y = cores < processes if yield_to_learner == AUTO else bool(yield_to_learner)
    if learner == AUTO:
        free = cores if y else cores - rollout_workers * r - int(oldlogit_service) * o
        lt = max(1, free // learner_ranks)
    else:
        lt = int(learner)
    return ThreadPlan(cores=cores, learner=lt, rollout=r, oldlogit=o, yield_to_learner=y)


def set_torch_threads(n: int) -> None:
    """Set torch's intra-op threads of the calling thread to ``n`` (>= 1).

    Calls torch's own setter underneath ``torch.set_num_threads``: vLLM's CPU worker replaces that
    Python name with a no-op in its process, and the rollout worker must still set its count.

    Raises:
        ValueError: ``n`` < 1.
    """
    import torch

    if n < 1:
        raise ValueError(f"threads: must be >= 1, got {n}")
    torch._C.set_num_threads(int(n))  # the builtin behind torch.set_num_threads


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads on the calling thread, then restore the count it had.

    Raises:
        ValueError: ``n`` < 1.
    """
    import torch

    before = torch.get_num_threads()
    set_torch_threads(n)
    try:
        yield
    finally:
        set_torch_threads(before)


def yield_cpu() -> int:
    """Put every thread of this process under Linux's ``SCHED_IDLE`` policy (sched(7): it runs
    only on CPU time that normal-priority threads leave); threads created afterwards inherit it.
    Needs no privilege. Returns the number of threads changed (0 where the OS has no such policy;
    a thread that ended meanwhile is skipped)."""
    if not hasattr(os, "SCHED_IDLE"):
        return 0
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    done = 0
    for tid in tids:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            done += 1
        except (ProcessLookupError, PermissionError):
            continue
    return done


def shared_box_warning(plan: ThreadPlan, load: float) -> str | None:
    """A one-line warning when the machine is busy with other work while the plan gives the learner
    more than one thread or has the other parts yield, else None.

    Both assume the job has the cores to itself: an OpenMP learner whose threads share cores with
    other processes waits at every barrier for the one that lost its core, and idle-priority parts
    yield to every other process too. ``load``: the 1-minute load average before the job starts
    (``os.getloadavg()[0]``, runnable threads); busy means ``load >= 1`` (a core's worth of work).
    Example: learner 2, yield, load 14.0 on 2 cores -> a warning naming ``learner.threads=1`` and
    ``machine.yield_to_learner=false``; load 0.3 -> None.
    """
    if load < 1.0 or (plan.learner == 1 and not plan.yield_to_learner):
        return None
    return (
        f"machine: load average {load:.1f} on {plan.cores} cores before the job starts: other work shares them, "
        f"and the thread plan (learner {plan.learner} threads, yield_to_learner {str(plan.yield_to_learner).lower()}) "
        "assumes the cores are the job's; on a shared box set learner.threads=1 and machine.yield_to_learner=false"
    )
