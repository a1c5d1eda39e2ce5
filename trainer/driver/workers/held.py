"""Which requests each rollout worker holds, and which were lost with a worker.

A worker holds a request from the moment it takes the request's samples until their trajectories
are polled; a trajectory's id names its request (:func:`rollout.worker.request_of`). When a worker
is lost, the ids it held are kept, with the reason, until a caller takes them, so a caller waiting
for one resubmits it instead of waiting for a result nothing will deliver. Plain bookkeeping: the
caller holds its own lock around every call.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from protocol import Trajectory
from rollout.worker import request_of

LOST_REQUESTS_KEPT = 65536
"""Ids of lost requests kept until taken (oldest dropped first, so a job whose driver never asks
keeps a bounded list)."""


class HeldRequests:
    """Per worker, ``{request id: samples not polled yet}``; the evaluation requests among them; the
    ``(request id, reason)`` of requests lost with a worker, oldest first.

    Args:
        kept: most lost ids kept until taken.
    """

    def __init__(self, kept: int = LOST_REQUESTS_KEPT) -> None:
        self.by_worker: dict[str, dict[str, int]] = {}
        self._eval: set[str] = set()
        self._lost: deque[tuple[str, str]] = deque(maxlen=kept)

    def hold(self, wid: str, request_id: str, n: int, purpose: str = "train") -> None:
        """``wid`` took ``n`` samples of ``request_id``, a request of ``purpose`` ("train" or "eval")."""
        if n > 0:
            held = self.by_worker.setdefault(wid, {})
            held[request_id] = held.get(request_id, 0) + n
            if purpose == "eval":
                self._eval.add(request_id)

    def release(self, wid: str, trajectories: Sequence[Trajectory]) -> None:
        """``wid`` delivered ``trajectories``: each frees one sample of its request there."""
        held = self.by_worker.get(wid)
        if not held:
            return
        for t in trajectories:
            rid = request_of(t.trajectory_id, held)
            if rid in held:
                held[rid] -= 1
                if held[rid] <= 0:
                    del held[rid]
                    self._eval.discard(rid)

    def lose(self, wid: str, reason: str) -> int:
        """Every request ``wid`` held becomes lost with ``reason``; returns how many of its samples
        were of evaluation requests."""
        held = self.by_worker.pop(wid, {})
        self._lost.extend((rid, reason) for rid in held)
        evals = [rid for rid in held if rid in self._eval]
        self._eval.difference_update(evals)
        return sum(held[rid] for rid in evals)

    def take_lost(self) -> list[tuple[str, str]]:
        """``(request id, reason)`` of the requests lost since the last call, in the order lost; each once."""
        out = list(self._lost)
        self._lost.clear()
        return out
