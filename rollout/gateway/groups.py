"""GRPO groups of gateway sessions: held until they fill, or released short of ``n`` with a stated baseline.

The trainer normalises rewards within a group of ``n = rollout.sampling.n`` trajectories sharing a
``group_id`` and takes only whole groups. Sessions that end are held here by ``group_id``:

* a group with ``n`` ended sessions is released at once, as it is (the learner's configured
  estimator, GRPO by default, computes its advantages);
* a group that has not filled ``wait_s`` seconds after its first session ended (agents that opened
  fewer than ``n`` sessions with that ``group_id``, or whose other sessions were dropped) is
  released *partial*: every trajectory of it carries :attr:`protocol.Trajectory.baseline`, the
  buffer takes the group as it is, and its advantage is ``reward - baseline``;
* a session opened without a ``group_id`` (its group is its own id, no other session can join it)
  is released partial at its end, without waiting.

Baselines of a partial group of ``k`` sessions (each session counted once, whatever its number of
segments; every segment of a session gets its session's baseline):

* ``k >= 2``: the mean reward of the group's *other* sessions (leave-one-out, RLOO: Ahmadian et
  al. 2024, "Back to basics");
* ``k = 1``: the mean reward of the last :data:`BASELINE_WINDOW` sessions released before it (any
  group); 0 when none was released yet (plain REINFORCE for that session).

Neither baseline depends on the session's own reward, so ``reward - baseline`` is an unbiased
policy-gradient weight (a baseline independent of the action adds no bias: Williams 1992;
Sutton and Barto 2018, section 13.4), and neither is 0 by construction for a session alone: a
group of one under GRPO would get advantage 0 (``r - mean(r)``) and teach nothing, which also
holds for a lone session that split into segments sharing its reward. The advantage is not
divided by a standard deviation (Dr. GRPO's form, Liu et al. 2025): a group of one has none, and a
window's spread mixes different tasks.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

BASELINE_WINDOW = 32
"""Rewards of the most recently released sessions kept for the baseline of a group of one."""


@dataclass
class _Held:
    first_ended: float
    """Clock reading when the group's first held session ended, seconds."""
    sessions: list[Any] = field(default_factory=list)


class GroupGate:
    """Ended training sessions held by group (see the module docstring); not thread-safe (the
    gateway calls it under its lock).

    Args:
        group_size: sessions of a full group (``rollout.sampling.n``), >= 1.
        wait_s: longest wait for a group to fill after its first session ended, seconds (> 0).
        clock: seconds (monotonic).

    Sessions are :class:`rollout.gateway.sessions.EndedSession` (``group_id``, ``session_id``,
    ``reward``, ``trajectories``); a released partial group's trajectories are copies carrying
    ``baseline``.

    Raises:
        ValueError: ``group_size < 1`` or ``wait_s`` not a positive finite number (names the setting).
    """

    def __init__(self, group_size: int = 1, wait_s: float = 120.0, clock: Callable[[], float] = time.monotonic):
        if group_size < 1:
            raise ValueError(f"rollout.sampling.n: must be >= 1, got {group_size!r}")
        if not (isinstance(wait_s, int | float) and 0 < wait_s < float("inf")):
            raise ValueError(f"gateway.group_wait_s: must be a positive number of seconds, got {wait_s!r}")
        self.group_size, self.wait_s, self.clock = group_size, float(wait_s), clock
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._recent: deque[float] = deque(maxlen=BASELINE_WINDOW)
        self.groups_full = 0
        self.groups_partial = 0
        """Groups released short of ``group_size`` (with baselines)."""
        self.sessions_partial = 0
        """Sessions released in partial groups."""

    @property
    def waiting(self) -> int:
        """Sessions held now, waiting for their group to fill."""
        return sum(len(h.sessions) for h in self._held.values())

    def add(self, ended: Any, alone: bool = False) -> list[Any]:
        """Hold one ended session; returns what is released by it (its group once full, or the
        session itself when ``alone``: opened without a ``group_id``)."""
        if alone and self.group_size > 1:
            return self._release([ended], partial=True)
        h = self._held.setdefault(ended.group_id, _Held(self.clock()))
        h.sessions.append(ended)
        if len(h.sessions) >= self.group_size:
            del self._held[ended.group_id]
            return self._release(h.sessions, partial=False)
        return []

    def held(self) -> list[Any]:
        """The sessions held now, group by group in the order their groups began to wait."""
        return [s for h in self._held.values() for s in h.sessions]

    def release_restored(self, sessions: list[Any]) -> list[Any]:
        """Release ``sessions`` held for their groups before a restart, now, group by group (in
        order of first appearance): a group of ``group_size`` as it is, a smaller one partial with
        its baselines. Their groups' other sessions were in flight at the restart and never end,
        so waiting for them would only delay the ones kept."""
        by_group: OrderedDict[str, list[Any]] = OrderedDict()
        for s in sessions:
            by_group.setdefault(s.group_id, []).append(s)
        out: list[Any] = []
        for group in by_group.values():
            out += self._release(group, partial=len(group) < self.group_size)
        return out

    def due(self) -> list[Any]:
        """Release every group that waited ``wait_s`` or longer since its first session ended, oldest first."""
        now = self.clock()
        late = [g for g, h in self._held.items() if now - h.first_ended >= self.wait_s]
        out: list[Any] = []
        for g in late:
            out += self._release(self._held.pop(g).sessions, partial=True)
        return out

    def _release(self, sessions: list[Any], partial: bool) -> list[Any]:
        if partial:
            bases = self.baselines([s.reward for s in sessions])
            for s, b in zip(sessions, bases, strict=True):
                s.trajectories = [t.model_copy(update={"baseline": b}) for t in s.trajectories]
            self.groups_partial += 1
            self.sessions_partial += len(sessions)
        else:
            self.groups_full += 1
        self._recent.extend(s.reward for s in sessions)
        return sessions

    def baselines(self, rewards: list[float]) -> list[float]:
        """Baselines of a partial group with these session rewards (module docstring): leave-one-out
        means for two or more, the recent-reward mean (0 with none) for one.

        Example: rewards ``[1.0, 0.0, 0.5]`` give ``[0.25, 0.75, 0.5]`` (the mean of the other two).
        """
        k = len(rewards)
        if k >= 2:
            total = sum(rewards)
            return [(total - r) / (k - 1) for r in rewards]
        return [sum(self._recent) / len(self._recent) if self._recent else 0.0] * k
