"""Processes this process started and stops however it ends: a normal exit, SIGTERM, SIGINT, SIGHUP.

An owner (the object that starts a cluster, a node or a server) calls :func:`own` with a key and a
function that stops exactly what it started, by the PIDs or the process group it recorded (never by
name), and :func:`disown` once it has stopped it itself. Every owned stop runs once, latest first,
at interpreter exit (``atexit``) and on each of :data:`SIGNALS` that this process does not ignore;
the signal then goes on to the handler that was there before (a Python handler is called; the
default action is taken by restoring it and raising the signal again, so the exit status still
says which signal ended the process). A signal this process ignores (``nohup`` ignores SIGHUP)
stops nothing. Handlers are installed only from the main thread; ``atexit`` covers the others.

Stops must be idempotent: one may run again when a signal arrives while its owner is stopping.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import psutil

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_owned: dict[Hashable, Callable[[], None]] = {}
_previous: dict[int, Any] = {}
_at_exit = False


def own(key: Hashable, stop: Callable[[], None]) -> None:
    """Run ``stop()`` when this process exits or is ended by one of :data:`SIGNALS`, unless
    :func:`disown` of ``key`` came first. A second ``own`` of the same key replaces the first."""
    global _at_exit
    if not _at_exit:
        atexit.register(stop_owned)
        _at_exit = True
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            current = signal.getsignal(s)
            if current is not _on_signal and current is not signal.SIG_IGN:
                _previous[s] = current  # replaced since (ray.init installs its own SIGTERM handler): chain to it
                signal.signal(s, _on_signal)
    _owned[key] = stop


def disown(key: Hashable) -> None:
    """Forget ``key``'s stop (its owner stopped it, or handed it over); unknown keys are ignored."""
    _owned.pop(key, None)


def owned_keys() -> list[Hashable]:
    """The keys whose stops are still to run, oldest first."""
    return list(_owned)


def stop_owned() -> None:
    """Run every owned stop once, latest first (a node before the head it joined); a stop that
    raises does not keep the others from running."""
    while _owned:
        _, stop = _owned.popitem()
        with contextlib.suppress(Exception):
            stop()


def _on_signal(signum: int, frame: Any) -> None:
    stop_owned()
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)  # None (set outside Python) is treated as the default
    os.kill(os.getpid(), signum)


def alive(p: psutil.Process) -> bool:
    """True while ``p`` (the very process recorded: psutil compares its start time, so a reused
    PID is not it) runs; a zombie has ended."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def with_descendants(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """``procs`` and every living descendant of each, each process once."""
    out: dict[int, psutil.Process] = {}
    for p in procs:
        out.setdefault(p.pid, p)
        with contextlib.suppress(psutil.Error):
            for c in p.children(recursive=True):
                out.setdefault(c.pid, c)
    return list(out.values())


def group_members(pgid: int) -> list[psutil.Process]:
    """The living (not zombie) processes of process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return []
    out = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(p.pid) == pgid and alive(p):
                out.append(p)
    return out


def stop_processes(
    procs: Iterable[psutil.Process], timeout_s: float = 10.0, first: int = signal.SIGTERM, pgid: int | None = None
) -> None:
    """Stop ``procs``, their descendants and, with ``pgid``, every member of that process group (and
    theirs), also one that joins while they stop (a dying parent's restarted child): ``first``,
    then SIGKILL to whatever outlives ``timeout_s`` seconds (so at most about ``2 * timeout_s`` in
    all). Processes already gone are skipped; nothing else is signalled."""
    targets = with_descendants(procs)
    for sig in (first, signal.SIGKILL):
        signalled: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while True:
            if pgid is not None:
                known = {p.pid for p in targets}
                targets += [p for p in with_descendants(group_members(pgid)) if p.pid not in known]
            for p in targets:
                if p.pid not in signalled:
                    signalled.add(p.pid)
                    with contextlib.suppress(psutil.Error):
                        p.send_signal(sig)  # psutil refuses a PID reused by another process
            targets = [p for p in targets if alive(p)]
            if not targets:
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(0.2)


def stop_group(pid: int, timeout_s: float = 30.0, first: int = signal.SIGTERM) -> None:
    """Stop the process group led by ``pid`` (a process started with ``start_new_session``) and the
    descendants of its members that made groups of their own (Ray's workers do): ``first``, then
    SIGKILL after ``timeout_s``."""
    stop_processes([], timeout_s, first, pgid=pid)
