"""The old-logit service's held weight copies: one per version, ascending, with their bytes, the
checksum and tensor names of their publication, and why every version no longer held went.

Bytes count distinct storages (tied aliases once), plus the base weights kept once when versions
are LoRA adapters over it. Plain torch; no model.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor

from protocol import ROUTE_TRAITS

EVICT_STALENESS = "staleness"
"""Eviction reason: the version is older than ``V - max_staleness`` (no token of it is consumable)."""
EVICT_BUDGET = "memory_budget"
"""Eviction reason: the held copies exceeded ``memory_budget_bytes`` (oldest first)."""
EVICT_SUPERSEDED = "superseded"
"""Eviction reason (single-replica routes): a newer broadcast replaced the loaded version."""


@dataclass(frozen=True)
class Holding:
    """How an old-logit route holds versions in the service, decided once from its
    :data:`protocol.ROUTE_TRAITS` (:meth:`of`); the service asks this object, never the name.

    Attributes:
        weights: whether the route holds weights at all ("none" holds none and scores nothing).
        window: versions kept behind the newest, W = ``max_staleness`` on the snapshot route (many
            copies); None on the single-replica routes, which hold the loaded version only (a new
            one supersedes it).
        on_host: copies live in host memory (the snapshot route's W + 1 copies) rather than on the
            scoring device.
    """

    weights: bool
    window: int | None
    on_host: bool

    @classmethod
    def of(cls, route: str, max_staleness: int) -> Holding:
        """The holding of ``route``: snapshot -> ``(True, max_staleness, True)``; old_logit_model and
        interrupt_sync -> ``(True, None, False)``; none -> ``(False, None, False)``.

        Raises:
            ValueError: an unknown route name.
        """
        traits = ROUTE_TRAITS.get(route)
        if traits is not None:  # a per-batch route keeps the window on the host; the others one replica
            return cls(traits.exact, max_staleness if traits.per_batch else None, traits.per_batch)
        raise ValueError(f"route: {route!r} is not one of snapshot, old_logit_model, interrupt_sync, none")


def dedup(weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Tensors that are views of the same memory become one object (tied weights stay tied)."""
    same: dict[tuple, Tensor] = {}
    return {k: same.setdefault((t.data_ptr(), t.dtype, tuple(t.shape), t.stride()), t) for k, t in weights.items()}


def check_pinned_fits(held_bytes: int, version_bytes: int, budget: int | None) -> None:
    """Refuse a memory budget that cannot hold what is held now (the pinned reference and any
    base) plus one more version of ``version_bytes``: every publication would then be evicted at
    once and no token would get an exact old log-prob.

    Example: 540 MB held, versions of 540 MB: a budget of 1 GB is refused, 1.08 GB holds one.

    Raises:
        ValueError: naming ``oldlogit.memory_budget_bytes`` and ``oldlogit.score_reference``.
    """
    if budget is not None and held_bytes + version_bytes > budget:
        raise ValueError(
            f"oldlogit.memory_budget_bytes: {budget} bytes cannot hold the pinned KL reference and one published "
            f"version ({held_bytes} + {version_bytes} bytes); raise it or set oldlogit.score_reference = false"
        )


def unique_bytes(tensors: Mapping[str, Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied aliases counted once)."""
    seen: dict[int, int] = {}
    for t in tensors.values():
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class VersionStore:
    """Weight copies by version.

    Attributes:
        held: ``{version: {name: tensor}}`` in ascending version order.
        held_bytes: bytes of each held copy.
        checksums: the publication checksum of each held (published) version.
        published_names: the manifest's tensor names of each held published version.
        evicted: ``{version: reason}`` of versions once held (or refused) and gone.
        evictions: count by reason.
        base_bytes: bytes of the base kept once under adapters (0 with full copies).
        pinned: versions never evicted (the KL penalties' frozen reference); they count in
            :attr:`bytes` and the budget like any other copy.
    """

    def __init__(self) -> None:
        self.held: OrderedDict[int, dict[str, Tensor]] = OrderedDict()
        self.held_bytes: dict[int, int] = {}
        self.checksums: dict[int, str] = {}
        self.published_names: dict[int, list[str]] = {}
        self.evicted: dict[int, str] = {}
        self.evictions: Counter[str] = Counter()
        self.base_bytes = 0
        self.pinned: set[int] = set()

    @property
    def versions(self) -> list[int]:
        """Versions held now, ascending."""
        return list(self.held)

    @property
    def bytes(self) -> int:
        """The base (once) plus every held copy, tied tensors counted once."""
        return self.base_bytes + sum(self.held_bytes.values())

    def put(self, version: int, weights: dict[str, Tensor]) -> None:
        """Hold ``weights`` as ``version`` (tied views kept as one tensor), newest last."""
        weights = dedup(weights)
        self.held[version] = weights
        self.held_bytes[version] = unique_bytes(weights)
        self.evicted.pop(version, None)

    def replace(self, version: int) -> None:
        """Forget a held copy that a publication of the same version replaces (not an eviction)."""
        if version in self.held:
            self.held.pop(version)
            self.held_bytes.pop(version)

    def evict(self, version: int, reason: str) -> None:
        """Drop the held ``version`` and record why."""
        self.held.pop(version)
        self.held_bytes.pop(version)
        self.checksums.pop(version, None)
        self.published_names.pop(version, None)
        self.evicted[version] = reason
        self.evictions[reason] += 1

    def make_room(self, version: int, new_bytes: int, window: int | None, budget: int | None) -> bool:
        """Evict what ``version`` (``new_bytes``) displaces. ``window`` None (single-replica routes):
        every held copy (``superseded``); otherwise versions older than ``version - window``
        (``staleness``), then the oldest while the copies would exceed ``budget`` bytes
        (``memory_budget``). A :attr:`pinned` version is never evicted. Returns False when the
        budget cannot hold ``version`` beside the pinned copies (then recorded as evicted at once)."""
        if window is None:
            for old in [u for u in self.held if u not in self.pinned]:
                self.evict(old, EVICT_SUPERSEDED)
            return True
        for old in [u for u in self.held if u < version - window and u not in self.pinned]:
            self.evict(old, EVICT_STALENESS)
        if budget is None:
            return True
        evictable = [u for u in self.held if u not in self.pinned]
        while evictable and self.bytes + new_bytes > budget:
            self.evict(evictable.pop(0), EVICT_BUDGET)
        if self.bytes + new_bytes > budget:
            self.evicted[version] = EVICT_BUDGET
            self.evictions[EVICT_BUDGET] += 1
            return False
        return True
