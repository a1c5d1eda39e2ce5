"""Resident memory of a process and the processes it started (an engine's own subprocesses
included), for the parts of a job to report what they hold."""

from __future__ import annotations

import os

import psutil


def tree_rss_bytes(pid: int | None = None) -> int:
    """Resident set size, bytes, of process ``pid`` (default: this one) plus its children,
    recursively, as the kernel counts each (pages shared between them are counted once per
    process, so the sum can exceed what they hold together). Processes that exit meanwhile are left
    out; 0 when ``pid`` itself is gone."""
    try:
        root = psutil.Process(pid if pid is not None else os.getpid())
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total
