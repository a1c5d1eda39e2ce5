"""Bounded trajectory buffer with staleness admission and complete accounting.

Invariants (checked by :meth:`TrajectoryBuffer.accounting_ok` and the tests):

* every trajectory that is submitted ends in exactly one of: consumed, dropped (with a reason),
  buffered, or still in flight, so ``submitted == consumed + sum(dropped) + buffered + in_flight``;
* a consumed trajectory's staleness ``consuming version - oldest token version`` is never above
  ``max_staleness`` (queue time counts: staleness is checked when the batch is taken, not on arrival);
* an offer to a full buffer is refused (backpressure) and counted as ``dropped["buffer_full"]``; a
  caller that wants to retry keeps its trajectory, nothing vanishes silently.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from protocol import NO_VERSION, Trajectory


def sequence_staleness(traj: Trajectory, consuming_version: int) -> int:
    """Staleness of a trajectory when consumed at ``consuming_version``: that minus its oldest token version.

    Example: tokens at ``[4, 4, 4, 5, 5]`` consumed at 5 have staleness 1; all at 4
    consumed at 7 have staleness 3. A trajectory with no sampled token has staleness 0.
    """
    oldest = traj.min_version()
    return 0 if oldest == NO_VERSION else consuming_version - oldest


def admission_capacity(learner_version: int, max_staleness: int, batch_size: int, submitted: int) -> int:
    """How many more trajectories may be submitted now without breaking the staleness bound.

    A trajectory submitted while the learner is at version ``V`` samples its first token at ``>= V``;
    it is consumed by step ``ceil((submitted+1)/B)``. Bounding ``submitted <= (V + max_staleness + 1) * B``
    means the batch that consumes it starts at most ``max_staleness`` versions after its admission
    (AReaL's rule, Fu et al., 2025, Sec. 5.1). ``max_staleness = 0`` gives one batch per version: the
    synchronous baseline.
    """
    return max(0, (learner_version + max_staleness + 1) * batch_size - submitted)


@dataclass
class TrajectoryBuffer:
    """FIFO of finished trajectories, bounded by ``capacity``, taken in batches at a consuming version."""

    capacity: int
    max_staleness: int
    submitted: int = 0
    consumed: int = 0
    dropped: Counter = field(default_factory=Counter)
    in_flight: int = 0
    _items: OrderedDict = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {self.capacity}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {self.max_staleness}")

    def __len__(self) -> int:
        return len(self._items)

    def note_submitted(self, n: int) -> None:
        """Record ``n`` trajectories handed to rollout workers (now in flight)."""
        self.submitted += n
        self.in_flight += n

    def note_lost(self, n: int, reason: str) -> None:
        """Record ``n`` in-flight trajectories that will never arrive (worker removed, aborted...)."""
        n = min(n, self.in_flight)
        self.in_flight -= n
        self.dropped[reason] += n

    def reject(self, reason: str) -> None:
        """Record an arrived trajectory that will not be buffered (e.g. ``aborted`` by its worker)."""
        self.in_flight = max(0, self.in_flight - 1)
        self.dropped[reason] += 1

    def offer(self, traj: Trajectory) -> bool:
        """Add a finished trajectory. Returns False (and counts ``buffer_full``) when full."""
        self.in_flight = max(0, self.in_flight - 1)
        if len(self._items) >= self.capacity:
            self.dropped["buffer_full"] += 1
            return False
        if traj.trajectory_id in self._items:
            raise ValueError(f"trajectory_id: {traj.trajectory_id!r} offered twice")
        self._items[traj.trajectory_id] = traj
        return True

    def drop_stale(self, consuming_version: int) -> int:
        """Drop every buffered trajectory whose staleness at ``consuming_version`` exceeds the bound."""
        stale = [k for k, t in self._items.items() if sequence_staleness(t, consuming_version) > self.max_staleness]
        for k in stale:
            del self._items[k]
        self.dropped["stale"] += len(stale)
        return len(stale)

    def take(self, n: int, consuming_version: int, group_size: int = 1) -> list[Trajectory] | None:
        """Take ``n`` trajectories (whole groups of ``group_size``) for the step at ``consuming_version``.

        Stale trajectories are dropped first. Returns None (taking nothing) if fewer than ``n``
        trajectories in complete groups are available.
        """
        self.drop_stale(consuming_version)
        groups: OrderedDict[str, list[str]] = OrderedDict()
        for k, t in self._items.items():
            groups.setdefault(t.group_id, []).append(k)
        chosen: list[str] = []
        for keys in groups.values():
            if len(keys) >= group_size and len(chosen) + group_size <= n:
                chosen += keys[:group_size]
        if len(chosen) < n:
            return None
        batch = [self._items.pop(k) for k in chosen]
        self.consumed += len(batch)
        return batch

    def staleness_histogram(self, consuming_version: int) -> dict[int, int]:
        """``{staleness: count}`` of what is buffered, were it consumed at ``consuming_version``."""
        return dict(sorted(Counter(sequence_staleness(t, consuming_version) for t in self._items.values()).items()))

    def accounting_ok(self) -> bool:
        """``submitted == consumed + dropped + buffered + in_flight``."""
        return self.submitted == self.consumed + sum(self.dropped.values()) + len(self._items) + self.in_flight

    def state_dict(self) -> dict:
        """Counters for checkpoints (buffered trajectories are not saved; they count as dropped on resume)."""
        return {"submitted": self.submitted, "consumed": self.consumed, "dropped": dict(self.dropped)}

    def load_state_dict(self, state: dict) -> None:
        lost = state["submitted"] - state["consumed"] - sum(state["dropped"].values())
        self.submitted, self.consumed = state["submitted"], state["consumed"]
        self.dropped = Counter(state["dropped"])
        if lost > 0:
            self.dropped["lost_at_restart"] += lost
        self.in_flight = 0
        self._items.clear()


def token_staleness_histogram(batch: list[Trajectory], consuming_version: int) -> dict[int, int]:
    """``{staleness: token count}`` over the sampled tokens of a batch (per token, not per sequence)."""
    c: Counter = Counter()
    for t in batch:
        v = t.versions[t.loss_mask.astype(bool)]
        c.update((consuming_version - v).tolist())
    return dict(sorted(c.items()))
