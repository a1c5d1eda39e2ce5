"""Whether the kernel killed a part for memory, said in one line.

A Ray actor killed by the kernel's out-of-memory killer dies with ``The actor died unexpectedly``
and nothing that names memory. The kernel counts every such kill in ``/proc/vmstat`` (``oom_kill``,
machine-wide, since boot): the job reads the counter when it starts and again when a part dies, and
a rise means the kernel killed a process meanwhile - on a machine that runs one job, that part.
"""

from __future__ import annotations

from pathlib import Path

VMSTAT = Path("/proc/vmstat")
MEMINFO = Path("/proc/meminfo")

GIB = 1024**3


class KilledForMemory(RuntimeError):
    """A part of the job died and the kernel's OOM kill count rose meanwhile; the message is the
    one-line report of :func:`killed_for_memory`."""


def _proc_number(path: Path, key: str) -> int | None:
    """The first number after ``key`` on the line of ``path`` whose first field is ``key`` (a
    ``/proc`` table of ``name value [unit]`` lines); None where the file or the line is missing."""
    try:
        for line in path.read_text().splitlines():
            fields = line.split()
            if fields and fields[0] == key:
                return int(fields[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def oom_kill_count(vmstat: Path = VMSTAT) -> int | None:
    """The kernel's count of out-of-memory kills since boot (``oom_kill`` in ``/proc/vmstat``); None
    where the file or the field is missing (not Linux, an old kernel)."""
    return _proc_number(vmstat, "oom_kill")


def total_memory_bytes(meminfo: Path = MEMINFO) -> int | None:
    """The machine's memory in bytes (``MemTotal`` of ``/proc/meminfo``, given in KiB); None where
    unreadable."""
    kib = _proc_number(meminfo, "MemTotal:")
    return None if kib is None else kib * 1024


def killed_for_memory(
    part: str,
    kills_before: int | None,
    kills_after: int | None,
    held_bytes: float | None = None,
    total_bytes: int | None = None,
) -> str | None:
    """The one-line report of a part that died while the kernel's OOM kill count rose, or None when
    it did not rise (or either count is unknown).

    Example: ``killed_for_memory("learner", 0, 1, 8.9 * GIB, 24 * GIB)`` ->
    ``"learner: killed by the kernel's out-of-memory killer (oom_kill 0 -> 1); it held 8.9 GiB
    resident at its last step, of 24.0 GiB on this machine"``.
    """
    if kills_before is None or kills_after is None or kills_after <= kills_before:
        return None
    line = f"{part}: killed by the kernel's out-of-memory killer (oom_kill {kills_before} -> {kills_after})"
    if held_bytes is not None:
        line += f"; it held {held_bytes / GIB:.1f} GiB resident at its last step"
        if total_bytes is not None:
            line += f", of {total_bytes / GIB:.1f} GiB on this machine"
    return line
