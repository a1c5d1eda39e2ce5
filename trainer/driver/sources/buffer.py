"""Bounded trajectory buffer with staleness admission and complete accounting.

Invariants (checked by :meth:`TrajectoryBuffer.accounting_ok` and the tests):

* every trajectory that is submitted ends in exactly one of: consumed, dropped (with a reason),
  buffered, held (taken for a step that has not started) or still in flight, so
  ``submitted == consumed + sum(dropped) + buffered + held + in_flight``;
* a consumed trajectory's staleness ``consuming version - oldest token version`` is never above
  ``max_staleness`` (queue time counts: staleness is checked when the batch is taken, not on arrival);
* an offer to a full buffer is refused (backpressure) and counted as ``dropped["buffer_full"]``; a
  caller that wants to retry keeps its trajectory, nothing vanishes silently;
* a batch taken ahead (:meth:`TrajectoryBuffer.take_ahead`, for the version after the learner's) is
  held until its step starts (:meth:`TrajectoryBuffer.consume`) or it is returned
  (:meth:`TrajectoryBuffer.put_back`); staleness only grows with the consuming version, so a batch
  within the bound at ``V + 1`` is within it at ``V`` too (a skipped step leaves it valid);
* a checkpoint keeps every finished trajectory not yet consumed (:meth:`TrajectoryBuffer.saved`:
  held ones first, as :meth:`TrajectoryBuffer.put_back` would return them, then the buffered FIFO),
  so after a resume only the trajectories in flight at the checkpoint count as
  ``dropped["lost_at_restart"]`` (``dropped["replayed_at_restart"]`` where the source generates
  their prompts again);
* a buffered or held trajectory found unfit after it arrived (its worker served other weights than
  its version's, :meth:`TrajectoryBuffer.drop_if`) is dropped with the reason, never consumed;
* every finished trajectory's fate is reported by id to the buffer's ``ledger`` (``buffered`` on
  arrival, ``consumed``, ``dropped`` with its reason), :class:`trainer.driver.records.ledger.Ledger`;
* with dynamic sampling (:meth:`TrajectoryBuffer.filter_groups`) a whole group whose rewards are all
  equal is dropped as ``dropped["filtered"]`` (one count per trajectory, ``filtered_groups`` per
  group) as soon as it is whole, at most ``bound`` groups per learner version; past the bound such
  groups stay buffered and are counted in ``zero_variance_admitted``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from protocol import NO_VERSION, Trajectory

LOST_AT_RESTART, REPLAYED_AT_RESTART = "lost_at_restart", "replayed_at_restart"
"""Drop reasons of the trajectories in flight at the checkpoint a job resumed from: they never
arrive; the second where the source submits their prompts again (the env loop)."""


def no_ledger(event: str, ids: list[str], reason: str | None = None, **fields: object) -> None:
    """The default ledger of a buffer: records nothing."""


def sequence_staleness(traj: Trajectory, consuming_version: int) -> int:
    """Staleness of a trajectory when consumed at ``consuming_version``: that minus its oldest token version.

    Example: tokens at ``[4, 4, 4, 5, 5]`` consumed at 5 have staleness 1; all at 4
    consumed at 7 have staleness 3. A trajectory with no sampled token has staleness 0.
    """
    oldest = traj.min_version()
    return 0 if oldest == NO_VERSION else consuming_version - oldest


def newest_token_staleness(traj: Trajectory, consuming_version: int) -> int:
    """``consuming_version`` minus the trajectory's newest token version: how stale its freshest
    sampled token is (0 with no sampled token). Example: tokens at ``[3, 3, 4, 4]`` consumed at 5
    give 1 (their sequence staleness is 2)."""
    newest = traj.max_version()
    return 0 if newest == NO_VERSION else consuming_version - newest


def admission_capacity(version: int, max_staleness: int, batch_size: int, scheduled: int) -> int:
    """How many more trajectories may be submitted now without breaking the staleness bound.

    ``version`` is the oldest version new work may be sampled with: the learner's version, or the
    one before it while its publication is still being applied to the rollout workers (they sample
    with the last weights they applied). ``scheduled`` counts the trajectories submitted and not
    dropped (consumed, buffered, held or in flight): a dropped trajectory (lost with its worker,
    refused, stale) is never consumed, so it frees its place in the consumption order. A trajectory
    submitted now samples every token at ``>= version``; it is consumed by step
    ``ceil((scheduled+1)/B)``. Bounding ``scheduled <= (version + max_staleness + 1) * B`` means the
    batch that consumes it starts at most ``max_staleness`` versions after ``version`` (AReaL's rule
    over accepted plus running samples, Fu et al., 2025, Sec. 5.1). Counting from the learner's
    version instead admits one batch too many while a publication is applied: its tokens are
    sampled one version older than the rule assumed. ``max_staleness = 0`` gives one batch per
    version: the synchronous baseline.

    Example: batch 8, bound 2, 24 scheduled: at version 1, 8 more may be submitted; while the
    learner is at 2 and the workers still serve 1, also 8 (16 once they serve 2).
    """
    return max(0, (version + max_staleness + 1) * batch_size - scheduled)


@dataclass
class TrajectoryBuffer:
    """Queue of finished trajectories, bounded by ``capacity``, taken in batches of whole groups at a
    consuming version, the oldest groups first (:meth:`_choose`)."""

    capacity: int
    max_staleness: int
    submitted: int = 0
    consumed: int = 0
    dropped: Counter = field(default_factory=Counter)
    in_flight: int = 0
    dropped_total: int = 0
    ledger: Callable[..., None] = no_ledger
    """Called ``ledger(event, ids, reason, **fields)`` with the ids of each finished trajectory's fate:
    ``buffered`` (arrived; ``stamps``: ``[policy_version, served_fingerprint]`` of each id), ``consumed``,
    ``dropped`` (``reason``: the drop reason)."""
    filtered_groups: int = 0
    """Groups dropped by :meth:`filter_groups` (their trajectories count in ``dropped["filtered"]``)."""
    zero_variance_admitted: int = 0
    """Whole groups of equal rewards that :meth:`filter_groups` kept because its per-version bound was reached."""
    filter_step: tuple[int, int] = (NO_VERSION, 0)
    """``(learner version, groups filtered at it)``: the count :meth:`filter_groups` bounds."""
    keep_partly_stale: bool = False
    """Judge a trajectory by its newest sampled token instead of its oldest
    (:func:`newest_token_staleness`): it stays consumable while any of its tokens is within
    ``max_staleness``, and the learner masks the older ones out of the loss
    (``controller.stale_trajectories = "mask"``)."""
    _items: OrderedDict = field(default_factory=OrderedDict)
    _held: dict = field(default_factory=dict)

    @property
    def held(self) -> int:
        """Trajectories taken with ``hold=True`` or :meth:`take_ahead` whose step has not started."""
        return len(self._held)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {self.capacity}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {self.max_staleness}")

    def __len__(self) -> int:
        return len(self._items)

    @property
    def scheduled(self) -> int:
        """Trajectories submitted and not dropped: the count :func:`admission_capacity` bounds."""
        return self.submitted - self.dropped_total

    def _drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] += n
        self.dropped_total += n  # one int, read by other threads (the gateway's admission)

    def note_submitted(self, n: int) -> None:
        """Record ``n`` trajectories handed to rollout workers (now in flight)."""
        self.submitted += n
        self.in_flight += n

    def note_lost(self, n: int, reason: str) -> None:
        """Record ``n`` in-flight trajectories that will never arrive (worker removed, aborted...)."""
        n = min(n, self.in_flight)
        self.in_flight -= n
        self._drop(reason, n)

    def reject(self, reason: str, trajectory_id: str | None = None) -> None:
        """Record an arrived trajectory that will not be buffered (e.g. ``aborted`` by its worker);
        ``trajectory_id`` goes to the ledger."""
        self.in_flight = max(0, self.in_flight - 1)
        self._drop(reason)
        if trajectory_id is not None:
            self.ledger("dropped", [trajectory_id], reason)

    def offer(self, traj: Trajectory) -> bool:
        """Add a finished trajectory. Returns False (and counts ``buffer_full``) when full.

        Raises:
            ValueError: a trajectory of that ``trajectory_id`` is buffered or held already.
        """
        self.in_flight = max(0, self.in_flight - 1)
        if len(self._items) >= self.capacity:
            self._drop("buffer_full")
            self.ledger("dropped", [traj.trajectory_id], "buffer_full")
            return False
        if traj.trajectory_id in self._items or traj.trajectory_id in self._held:
            raise ValueError(f"trajectory_id: {traj.trajectory_id!r} offered twice")
        self._items[traj.trajectory_id] = traj
        self.ledger("buffered", [traj.trajectory_id], stamps=[[traj.policy_version, traj.served_fingerprint]])
        return True

    def _stale(self, t: Trajectory, consuming_version: int) -> bool:
        """Whether ``t`` is past the bound at ``consuming_version`` (by its oldest token, or by its
        newest with :attr:`keep_partly_stale`)."""
        judge = newest_token_staleness if self.keep_partly_stale else sequence_staleness
        return judge(t, consuming_version) > self.max_staleness

    def drop_stale(self, consuming_version: int) -> int:
        """Drop every buffered trajectory that is stale at ``consuming_version`` (:meth:`_stale`)."""
        stale = [k for k, t in self._items.items() if self._stale(t, consuming_version)]
        for k in stale:
            del self._items[k]
        self._drop("stale", len(stale))
        if stale:
            self.ledger("dropped", stale, "stale")
        return len(stale)

    def drop_if(self, bad: Callable[[Trajectory], bool], reason: str) -> list[str]:
        """Drop every buffered or held trajectory ``t`` with ``bad(t)``, counted as
        ``dropped[reason]`` and reported to the ledger; returns their ids, the buffered ones first
        (FIFO), then the held ones (in the order taken).

        A held batch that loses a trajectory is no longer whole: its taker returns the rest
        (:meth:`put_back`, which refuses the dropped ids) instead of training on it
        (:meth:`held_ids` says which are still held).
        """
        out = []
        for store in (self._items, self._held):
            ids = [k for k, t in store.items() if bad(t)]
            for k in ids:
                del store[k]
            out += ids
        self._drop(reason, len(out))
        if out:
            self.ledger("dropped", out, reason)
        return out

    def filter_groups(self, group_ids: Sequence[str], learner_version: int, group_size: int, bound: int) -> list[str]:
        """Dynamic sampling (DAPO's ``filter_groups``, Yu et al. 2025, Sec. 3.2): drop every group of
        ``group_ids`` that is whole and whose rewards are all equal; returns the dropped ids (group by
        group, in the order of ``group_ids``).

        A group is whole once ``group_size`` of its trajectories are buffered (the caller passes the
        groups that received trajectories, after the whole intake of one poll, so a gateway group,
        released at once, is judged with every segment). Under group-normalised advantages (GRPO,
        RLOO) such a group's advantages are exactly 0 and it carries no gradient. Rewards are
        compared in fp32, as the learner compares them (:func:`trainer.algorithm.advantages.zero_variance_groups`).
        Never filtered: a group short of ``group_size``, a group whose trajectories carry a
        :attr:`protocol.Trajectory.baseline` (its advantage is ``reward - baseline``), held-out
        evaluation trajectories (``purpose = "eval"``).

        Bound: at most ``bound`` groups are dropped while the learner is at ``learner_version`` (one
        training step); from the ``bound + 1``-th such group on, until the version moves, they stay
        buffered as usual and count in :attr:`zero_variance_admitted`, so a task the policy has
        saturated (every group all 1.0) still feeds the learner. The extra generation per step is
        thus at most ``bound`` groups (``bound * group_size`` samples in the env loop).

        Each dropped trajectory counts as ``dropped["filtered"]`` (freeing its place for admission,
        :attr:`scheduled`) and is reported to the ledger as ``dropped`` with reason ``filtered``;
        each dropped group counts once in :attr:`filtered_groups`.

        Example: ``group_size`` 4, ``bound`` 1, at version 0: a group ``[1, 1, 1, 1]`` is dropped, a
        group ``[0, 1, 0, 0]`` stays, a second ``[0, 0, 0, 0]`` stays (counted as admitted past the
        bound); at version 1 a third ``[1, 1, 1, 1]`` is dropped again.

        Raises:
            ValueError: ``group_size < 1`` or ``bound < 0`` (the message names the value).
        """
        if group_size < 1:
            raise ValueError(f"group_size: must be >= 1, got {group_size}")
        if bound < 0:
            raise ValueError(f"controller.max_filtered_groups_per_step: must be >= 0, got {bound}")
        if self.filter_step[0] != learner_version:
            self.filter_step = (learner_version, 0)
        wanted = dict.fromkeys(group_ids)
        members: dict[str, list[str]] = {}
        for k, t in self._items.items():
            if t.group_id in wanted:
                members.setdefault(t.group_id, []).append(k)
        out: list[str] = []
        for g in wanted:
            keys = members.get(g, [])
            group = [self._items[k] for k in keys]
            if len(keys) < group_size or any(t.baseline is not None or t.purpose == "eval" for t in group):
                continue
            if len({np.float32(t.reward) for t in group}) > 1:
                continue
            if self.filter_step[1] >= bound:
                self.zero_variance_admitted += 1
                continue
            for k in keys:
                del self._items[k]
            self._drop("filtered", len(keys))
            self.filtered_groups += 1
            self.filter_step = (learner_version, self.filter_step[1] + 1)
            self.ledger("dropped", keys, "filtered")
            out += keys
        return out

    def held_ids(self) -> set[str]:
        """Ids of the trajectories held now (taken with ``hold=True`` or :meth:`take_ahead`)."""
        return set(self._held)

    def _judged_version(self, t: Trajectory) -> int:
        """The token version :meth:`_stale` judges ``t`` by: its oldest, or its newest with
        :attr:`keep_partly_stale`."""
        return t.max_version() if self.keep_partly_stale else t.min_version()

    def _choose(self, n: int, consuming_version: int, group_size: int) -> list[str] | None:
        """Keys of the oldest whole groups of trajectories within the bound at ``consuming_version``.

        Groups are taken oldest first by the version :meth:`_stale` judges them by (a group's
        oldest member's), in arrival order among equals: a group that would pass the bound soonest
        is trained first, so a long rollout that arrives after shorter, newer ones is not left to go
        stale behind them. A group is whole with ``group_size`` trajectories or more, or when its
        trajectories carry a :attr:`protocol.Trajectory.baseline` (their sender closed the group
        short of its size); every whole group takes the place of one group of ``group_size`` in the
        batch, so a group of more (an agent session split into segments) makes the batch larger,
        one closed short makes it smaller.

        Example: bound 2, consuming version 5, whole groups arrived in the order a (tokens at 4),
        b (3), c (4); one group wanted: b, then a, then c.
        """
        groups = self._by_group(self._items, consuming_version)
        chosen: list[str] = []
        used = 0
        oldest = lambda keys: min(self._judged_version(self._items[k]) for k in keys)  # noqa: E731
        for keys in sorted(groups.values(), key=oldest):
            if self._whole(self._items, keys, group_size) and used + group_size <= n:
                chosen += keys
                used += group_size
        return chosen if used >= n else None

    def _by_group(self, store: dict[str, Trajectory], consuming_version: int) -> OrderedDict[str, list[str]]:
        """Keys of ``store``'s trajectories within the bound at ``consuming_version``, by group, in
        arrival order."""
        groups: OrderedDict[str, list[str]] = OrderedDict()
        for k, t in store.items():
            if not self._stale(t, consuming_version):
                groups.setdefault(t.group_id, []).append(k)
        return groups

    @staticmethod
    def _whole(store: dict[str, Trajectory], keys: list[str], group_size: int) -> bool:
        """Whether the trajectories ``keys`` of one group make it whole: ``group_size`` of them, or
        closed short by their sender (they carry a :attr:`protocol.Trajectory.baseline`)."""
        return len(keys) >= group_size or store[keys[0]].baseline is not None

    def passes_over_last_chance(self, consuming_version: int, group_size: int) -> bool:
        """Whether the batch held for ``consuming_version`` passes over a group that is consumable at
        that version and never again, while it holds a group that could wait for the next batch.

        A buffered group is on its last chance when it is whole within the bound at
        ``consuming_version`` and a member of it is past the bound at ``consuming_version + 1`` (the
        next take drops that member as ``stale``, and the group, short of it, is no longer whole
        unless it holds more than ``group_size`` or was closed short by its sender). A held group can
        wait when none of its members is past the bound at ``consuming_version + 1``. When this is
        True, returning the held batch (:meth:`put_back`) and taking again at ``consuming_version``
        trains the group on its last chance (:meth:`_choose` takes the oldest first) and leaves a
        group that can wait to the next batch: a batch taken ahead, before a late member finished,
        no longer costs its group. The retake keeps the staleness bound (every group taken is
        within it at ``consuming_version``).

        Example: bound 2, consuming version 5, a held batch of group b (tokens at 4); group a (tokens
        at 3) becomes whole in the buffer: a is on its last chance (staleness 3 at 6), b can wait
        (2 at 6): True. Were a's tokens at 4, or b's at 3: False.
        """
        nxt = consuming_version + 1

        def can_wait(store: dict[str, Trajectory], keys: list[str]) -> bool:
            return not any(self._stale(store[k], nxt) for k in keys)

        last_chance = any(
            self._whole(self._items, keys, group_size) and not can_wait(self._items, keys)
            for keys in self._by_group(self._items, consuming_version).values()
        )
        return last_chance and any(
            can_wait(self._held, keys) for keys in self._by_group(self._held, consuming_version).values()
        )

    def take(
        self, n: int, consuming_version: int, group_size: int = 1, *, hold: bool = False
    ) -> list[Trajectory] | None:
        """Take ``n`` trajectories (whole groups of ``group_size``) for the step at ``consuming_version``.

        Stale trajectories are dropped first. Returns None (taking nothing) if fewer than ``n``
        trajectories in complete groups are available. A group holding more than ``group_size``
        trajectories (an agent session split into segments that share its reward) is taken whole
        and counts as one group, so the batch may then hold more than ``n``; a group closed short of ``group_size`` by its
        sender (trajectories with a ``baseline``) counts as one group, so it may hold fewer. The batch counts as consumed, or with ``hold``
        as held until :meth:`consume` (its step starts) or :meth:`put_back`.
        """
        self.drop_stale(consuming_version)
        chosen = self._choose(n, consuming_version, group_size)
        return None if chosen is None else self._pop(chosen, hold)

    def take_ahead(self, n: int, consuming_version: int, group_size: int = 1) -> list[Trajectory] | None:
        """Like :meth:`take` with ``hold``, for a step that starts later, once the learner has moved to
        ``consuming_version``: trajectories stale at that version are passed over but not dropped
        (if the step before is skipped they are still consumable at the current version).

        Example: bound 1, buffered groups with oldest versions 3 and 4; ahead for version 5 the
        first group (staleness 2) is passed over and stays buffered, the second (staleness 1) is
        taken; a later ``take`` at 5 drops the first as ``stale``.
        """
        chosen = self._choose(n, consuming_version, group_size)
        return None if chosen is None else self._pop(chosen, hold=True)

    def _pop(self, keys: list[str], hold: bool) -> list[Trajectory]:
        batch = [self._items.pop(k) for k in keys]
        if hold:
            self._held.update((t.trajectory_id, t) for t in batch)
        else:
            self.consumed += len(batch)
            self.ledger("consumed", keys)
        return batch

    def _release(self, batch: list[Trajectory]) -> None:
        missing = [t.trajectory_id for t in batch if t.trajectory_id not in self._held]
        if missing:
            raise ValueError(f"trajectory_id: {missing[0]!r} is not held (taken with hold=True or take_ahead)")
        for t in batch:
            del self._held[t.trajectory_id]

    def consume(self, batch: list[Trajectory]) -> None:
        """A held batch's step starts: its trajectories count as consumed.

        Raises:
            ValueError: a trajectory of ``batch`` is not held (the message names its id).
        """
        self._release(batch)
        self.consumed += len(batch)
        self.ledger("consumed", [t.trajectory_id for t in batch])

    def put_back(self, batch: list[Trajectory]) -> None:
        """Return a held batch, unconsumed, to the front of the buffer in its order (e.g. a batch taken
        ahead when the run stops). The batch was admitted under ``capacity`` when it arrived; until
        the next take the buffer may hold up to one batch more than ``capacity``.

        Raises:
            ValueError: a trajectory of ``batch`` is not held (the message names its id).
        """
        self._release(batch)
        for t in reversed(batch):
            self._items[t.trajectory_id] = t
            self._items.move_to_end(t.trajectory_id, last=False)

    def staleness_histogram(self, consuming_version: int) -> dict[int, int]:
        """``{staleness: count}`` of what is buffered, were it consumed at ``consuming_version``."""
        return dict(sorted(Counter(sequence_staleness(t, consuming_version) for t in self._items.values()).items()))

    def accounting_ok(self) -> bool:
        """``submitted == consumed + dropped + buffered + held + in_flight``."""
        return (
            self.submitted
            == self.consumed + sum(self.dropped.values()) + len(self._items) + len(self._held) + self.in_flight
        )

    def saved(self) -> list[Trajectory]:
        """What a checkpoint keeps of the trajectories: the held ones first (in the order taken, as
        :meth:`put_back` returns them to the front), then the buffered ones (FIFO). A batch taken
        ahead is thus saved as buffered, not as taken: a resumed job takes it again, at its version."""
        return [*self._held.values(), *self._items.values()]

    def state_dict(self) -> dict:
        """Counters for checkpoints (dynamic sampling's too: ``filtered_groups``,
        ``zero_variance_admitted``, ``filter_step``) and ``buffered_ids``, the ids of :meth:`saved` in
        its order (the trajectories themselves go to a file beside it, :mod:`trainer.driver.sources.resume`)."""
        return {
            "submitted": self.submitted,
            "consumed": self.consumed,
            "dropped": dict(self.dropped),
            "filtered_groups": self.filtered_groups,
            "zero_variance_admitted": self.zero_variance_admitted,
            "filter_step": list(self.filter_step),
            "buffered_ids": [t.trajectory_id for t in self.saved()],
        }

    def load_state_dict(
        self, state: dict, trajectories: Sequence[Trajectory] = (), pending: int = 0, lost_reason: str = LOST_AT_RESTART
    ) -> None:
        """Restore the counters of :meth:`state_dict` and its saved ``trajectories`` (buffered, in
        their order; none held); ``pending`` trajectories finished before the checkpoint but not yet
        offered (a source's held-back ones) stay counted in flight. The rest of what was in flight
        at the checkpoint never arrives: it counts as dropped with ``lost_reason``
        (:data:`LOST_AT_RESTART`, or :data:`REPLAYED_AT_RESTART` for a source that generates those
        prompts again), so
        ``submitted == consumed + dropped + buffered + in_flight`` holds again. Dynamic sampling's
        counters continue (0 when the checkpoint has none).

        Raises:
            ValueError: the ids of ``trajectories`` are not ``state["buffered_ids"]`` in order (missing
                means none), or more trajectories than were submitted and not consumed or dropped.
        """
        ids = [t.trajectory_id for t in trajectories]
        want = list(state.get("buffered_ids", []))
        if ids != want:
            k = next((i for i, (a, b) in enumerate(zip(ids, want, strict=False)) if a != b), min(len(ids), len(want)))
            raise ValueError(
                f"buffered_ids: the checkpoint lists {len(want)} ids, {len(ids)} trajectories given "
                f"(first difference at position {k})"
            )
        lost = state["submitted"] - state["consumed"] - sum(state["dropped"].values()) - len(ids) - pending
        if lost < 0:
            raise ValueError(
                f"buffered_ids: {len(ids)} saved and {pending} pending exceed what was in flight by {-lost}"
            )
        self.submitted, self.consumed = state["submitted"], state["consumed"]
        self.dropped = Counter(state["dropped"])
        if lost > 0:
            self.dropped[lost_reason] += lost
        self.dropped_total = sum(self.dropped.values())
        self.filtered_groups = int(state.get("filtered_groups", 0))
        self.zero_variance_admitted = int(state.get("zero_variance_admitted", 0))
        version, count = state.get("filter_step", (NO_VERSION, 0))
        self.filter_step = (int(version), int(count))
        self.in_flight = pending
        self._held.clear()
        self._items = OrderedDict((t.trajectory_id, t) for t in trajectories)


def spanning_sequences(batch: list[Trajectory]) -> int:
    """How many trajectories of ``batch`` hold sampled tokens of more than one policy version: partial
    rollouts that a weight update interrupted and the next version continued (per token versions,
    ``versions[loss_mask == 1]``)."""
    return sum(len(np.unique(t.versions[t.loss_mask.astype(bool)])) > 1 for t in batch)


def token_staleness_histogram(batch: list[Trajectory], consuming_version: int) -> dict[int, int]:
    """``{staleness: token count}`` over the sampled tokens of a batch (per token, not per sequence)."""
    c: Counter = Counter()
    for t in batch:
        v = t.versions[t.loss_mask.astype(bool)]
        c.update((consuming_version - v).tolist())
    return dict(sorted(c.items()))
