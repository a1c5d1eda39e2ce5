"""Staleness accounting and buffer bookkeeping."""

import numpy as np
import pytest

from protocol import Trajectory
from trainer.driver.sources.buffer import (
    TrajectoryBuffer,
    admission_capacity,
    newest_token_staleness,
    sequence_staleness,
    spanning_sequences,
    token_staleness_histogram,
)


def traj(tid, versions, group="g", prompt=2):
    n = prompt + len(versions)
    return Trajectory(
        trajectory_id=tid,
        group_id=group,
        token_ids=np.arange(n),
        loss_mask=[0] * prompt + [1] * len(versions),
        behav_logprobs=[0.0] * prompt + [-0.5] * len(versions),
        versions=[-1] * prompt + list(versions),
        policy_version=max(versions),
        prompt_len=prompt,
        finish_reason="stop",
    )


def test_case4a_mid_rollout_update_bound():
    t = traj("a", [4, 4, 4, 5, 5])
    assert sequence_staleness(t, 5) == 1
    for bound, accepted in ((0, 0), (1, 1)):
        b = TrajectoryBuffer(capacity=4, max_staleness=bound)
        b.note_submitted(1)
        b.offer(t)
        got = b.take(1, consuming_version=5)
        assert (got is not None) == bool(accepted)
        assert b.dropped["stale"] == 1 - accepted
        assert b.accounting_ok()


def test_case4b_queue_time_counts():
    t = traj("a", [4, 4, 4])
    assert sequence_staleness(t, 7) == 3
    for eta, ok in ((3, True), (2, False), (0, False)):
        b = TrajectoryBuffer(capacity=4, max_staleness=eta)
        b.note_submitted(1)
        b.offer(t)
        assert (b.take(1, consuming_version=7) is not None) is ok


def test_a_partly_stale_trajectory_is_kept_when_stale_tokens_are_masked():
    """Bound 1 at version 5: a session with tokens at [3, 3, 4, 4] (oldest 2 versions back, newest
    1) is dropped as stale by its oldest token, but kept with ``keep_partly_stale`` (its newest is
    within the bound); one with every token at 3 is dropped either way."""
    spanning, old = traj("a", [3, 3, 4, 4], group="ga"), traj("b", [3, 3], group="gb")
    assert (sequence_staleness(spanning, 5), newest_token_staleness(spanning, 5)) == (2, 1)
    for keep, taken_ids, stale in ((False, None, 2), (True, ["a"], 1)):
        b = TrajectoryBuffer(capacity=4, max_staleness=1, keep_partly_stale=keep)
        b.note_submitted(2)
        b.offer(spanning)
        b.offer(old)
        got = b.take(1, consuming_version=5)
        assert (None if got is None else [t.trajectory_id for t in got]) == taken_ids
        assert b.dropped["stale"] == stale and b.accounting_ok()


def test_case4d_overflow_is_refused_and_counted():
    b = TrajectoryBuffer(capacity=3, max_staleness=0)
    b.note_submitted(4)
    results = [b.offer(traj(str(i), [0])) for i in range(4)]
    assert results == [True, True, True, False]
    assert b.dropped["buffer_full"] == 1
    assert len(b) == 3 and b.accounting_ok()


def test_take_whole_groups_and_accounting():
    b = TrajectoryBuffer(capacity=10, max_staleness=2)
    b.note_submitted(6)
    for i in range(3):
        b.offer(traj(f"x{i}", [1], group="x"))
    for i in range(2):
        b.offer(traj(f"y{i}", [1], group="y"))
    assert b.in_flight == 1
    assert b.take(6, consuming_version=1, group_size=3) is None  # group y incomplete
    got = b.take(3, consuming_version=1, group_size=3)
    assert [t.trajectory_id for t in got] == ["x0", "x1", "x2"]
    assert b.consumed == 3 and b.accounting_ok()
    b.note_lost(1, "worker_removed")
    assert b.in_flight == 0 and b.accounting_ok()


def test_duplicate_offer_names_field():
    b = TrajectoryBuffer(capacity=4, max_staleness=1)
    b.offer(traj("a", [0]))
    with pytest.raises(ValueError, match="trajectory_id"):
        b.offer(traj("a", [0]))


def test_admission_capacity_bounds_submissions():
    # batch of 8, bound 0 (synchronous): only one batch per version
    assert admission_capacity(0, 0, 8, 0) == 8
    assert admission_capacity(0, 0, 8, 8) == 0
    assert admission_capacity(1, 0, 8, 8) == 8
    # batch 8, bound 2, 24 scheduled: 8 more at version 1 (the workers' while the learner is at 2), 16 at 2
    assert (admission_capacity(1, 2, 8, 24), admission_capacity(2, 2, 8, 24)) == (8, 16)
    # bound 2 at version 3: (3+2+1)*8 = 48 submissions allowed in total
    assert admission_capacity(3, 2, 8, 40) == 8


def test_dropped_trajectories_free_admission_room():
    # batch 4, bound 0, version 0: 4 submitted fill the version; losing 3 with their worker and
    # refusing 1 (stale or buffer full) frees all 4 places, otherwise the run could never step
    b = TrajectoryBuffer(capacity=8, max_staleness=0)
    b.note_submitted(4)
    assert admission_capacity(0, 0, 4, b.scheduled) == 0
    b.note_lost(3, "worker_hung")
    assert (b.scheduled, admission_capacity(0, 0, 4, b.scheduled)) == (1, 3)
    b.reject("aborted")
    assert (b.submitted, b.dropped_total, b.scheduled) == (4, 4, 0) and b.accounting_ok()
    assert admission_capacity(0, 0, 4, b.scheduled) == 4
    # a resumed buffer counts what was lost at the restart as dropped too
    b.note_submitted(4)
    b2 = TrajectoryBuffer(capacity=8, max_staleness=0)
    b2.load_state_dict(b.state_dict())
    assert (b2.dropped["lost_at_restart"], b2.dropped_total, b2.scheduled) == (4, 8, 0)


def test_case5_token_histogram_is_per_token():
    t = traj("a", [3, 3, 3, 4, 4, 5])
    assert token_staleness_histogram([t], 6) == {1: 1, 2: 2, 3: 3}
    assert sequence_staleness(t, 6) == 3


def test_a_partial_rollout_spans_versions_by_its_sampled_tokens_only():
    # the prompt's -1 versions do not count; versions 3 and 4 in one reply do, one version does not
    batch = [traj("a", [3, 3, 4]), traj("b", [5, 5]), traj("c", [2, 4, 5])]
    assert spanning_sequences(batch) == 2


def test_buffer_state_roundtrip_counts_lost():
    b = TrajectoryBuffer(capacity=4, max_staleness=1)
    b.note_submitted(3)
    b.offer(traj("a", [0]))
    b.take(1, 0)
    b2 = TrajectoryBuffer(capacity=4, max_staleness=1)
    b2.load_state_dict(b.state_dict())
    assert b2.consumed == 1 and b2.dropped["lost_at_restart"] == 2 and b2.accounting_ok()
    b3 = TrajectoryBuffer(capacity=4, max_staleness=1)  # a source that submits those prompts again
    b3.load_state_dict(b.state_dict(), lost_reason="replayed_at_restart")
    assert (b3.dropped["replayed_at_restart"], b3.dropped["lost_at_restart"]) == (2, 0) and b3.accounting_ok()


def test_rejected_arrivals_are_counted():
    b = TrajectoryBuffer(capacity=4, max_staleness=1)
    b.note_submitted(2)
    b.reject("aborted")
    b.offer(traj("a", [0]))
    assert b.dropped["aborted"] == 1 and b.in_flight == 0 and len(b) == 1 and b.accounting_ok()


def test_a_group_with_split_sessions_is_taken_whole():
    # group "a": 2 sessions, one split into 2 segments -> 3 trajectories sharing the group
    b = TrajectoryBuffer(capacity=10, max_staleness=2)
    b.note_submitted(4)
    for tid, g in (("a0", "a"), ("a1/0", "a"), ("a1/1", "a"), ("b0", "b")):
        b.offer(traj(tid, [0], group=g))
    assert b.take(4, consuming_version=0, group_size=2) is None  # b is incomplete: a is one group of 2
    got = b.take(2, consuming_version=0, group_size=2)
    assert [t.trajectory_id for t in got] == ["a0", "a1/0", "a1/1"]
    assert (b.consumed, len(b)) == (3, 1) and b.accounting_ok()
    # a split group taken first still leaves room for another: a batch of 2 groups holds 2 + 3
    b.note_submitted(4)
    for tid, g in (("c0", "c"), ("c1/0", "c"), ("c1/1", "c"), ("b1", "b")):
        b.offer(traj(tid, [0], group=g))
    got = b.take(4, consuming_version=0, group_size=2)
    assert [t.trajectory_id for t in got] == ["b0", "b1", "c0", "c1/0", "c1/1"]
    assert (b.consumed, len(b)) == (8, 0) and b.accounting_ok()


def test_take_ahead_passes_over_stale_without_dropping_and_holds():
    # bound 1, learner at 4, batch for version 5: group "old" (oldest 3) has staleness 2 at 5,
    # group "new" (oldest 4) has staleness 1 -> "new" is taken, "old" stays buffered (not dropped)
    b = TrajectoryBuffer(capacity=10, max_staleness=1)
    b.note_submitted(4)
    for tid, versions, g in (("o0", [3, 4], "old"), ("o1", [4], "old"), ("n0", [4], "new"), ("n1", [4, 4], "new")):
        b.offer(traj(tid, versions, group=g))
    got = b.take_ahead(2, consuming_version=5, group_size=2)
    assert [t.trajectory_id for t in got] == ["n0", "n1"]
    assert (len(b), b.held, b.consumed, b.dropped["stale"]) == (2, 2, 0, 0) and b.accounting_ok()
    assert b.take_ahead(2, consuming_version=5, group_size=2) is None  # "old" is too stale at 5, still kept
    assert len(b) == 2
    b.consume(got)  # its step starts
    assert (b.held, b.consumed) == (0, 2) and b.accounting_ok()
    assert b.take(2, consuming_version=5, group_size=2) is None  # at 5 o0 is dropped now; o1 alone stays
    assert ([*b._items], b.dropped["stale"]) == (["o1"], 1) and b.accounting_ok()


def test_skipped_step_keeps_a_batch_taken_ahead_valid():
    # taken ahead for 3 with bound 1: oldest version >= 2, so staleness at 2 (the step was skipped) is <= 0
    b = TrajectoryBuffer(capacity=4, max_staleness=1)
    b.note_submitted(2)
    b.offer(traj("a", [1, 2], group="x"))
    b.offer(traj("b", [2], group="x"))
    assert b.take_ahead(2, consuming_version=3, group_size=2) is None  # "a" (oldest 1) is stale at 3
    got = b.take(2, consuming_version=2, group_size=2)  # at the learner's own version both are fine
    assert [sequence_staleness(t, 2) for t in got] == [1, 0]


def test_put_back_returns_a_held_batch_to_the_front_unconsumed():
    b = TrajectoryBuffer(capacity=2, max_staleness=1)
    b.note_submitted(4)
    for tid in "ab":
        b.offer(traj(tid, [0], group=tid))
    got = b.take(2, consuming_version=0, hold=True)
    for tid in "cd":
        b.offer(traj(tid, [0], group=tid))  # full again (capacity 2)
    b.put_back(got)  # admitted earlier: back in front, one batch over capacity until the next take
    assert list(b._items) == ["a", "b", "c", "d"]
    assert (b.consumed, b.held, len(b)) == (0, 0, 4) and b.accounting_ok()
    assert [t.trajectory_id for t in b.take(2, consuming_version=0)] == ["a", "b"]


def test_consume_or_put_back_refuses_a_batch_not_held():
    b = TrajectoryBuffer(capacity=4, max_staleness=1)
    b.note_submitted(1)
    b.offer(traj("a", [0]))
    got = b.take(1, consuming_version=0)  # not held: already consumed
    with pytest.raises(ValueError, match="trajectory_id: 'a' is not held"):
        b.consume(got)
    with pytest.raises(ValueError, match="trajectory_id: 'a' is not held"):
        b.put_back(got)


def test_held_trajectories_are_kept_by_a_resume_only_in_flight_ones_are_lost():
    # submitted 3: one consumed, one held (taken ahead), one in flight -> 1 lost at restart
    b = TrajectoryBuffer(capacity=4, max_staleness=1)
    b.note_submitted(3)
    b.offer(traj("a", [0], group="a"))
    b.offer(traj("b", [0], group="b"))
    b.take(1, 0)
    b.take_ahead(1, 1)
    assert (b.consumed, b.held, b.in_flight) == (1, 1, 1) and b.accounting_ok()
    b2 = TrajectoryBuffer(capacity=4, max_staleness=1)
    b2.load_state_dict(b.state_dict(), b.saved())
    assert b2.consumed == 1 and b2.dropped["lost_at_restart"] == 1 and b2.accounting_ok()
    assert len(b2) == 1 and b2.held == 0 and [t.trajectory_id for t in b2.take(1, 1)] == ["b"]


def test_the_oldest_whole_group_is_taken_first_and_arrival_breaks_ties():
    """Bound 2, consuming version 5, whole groups of 2 arrived in the order a (tokens at 4), b (3),
    c (4): a batch of one group takes b, the next a, then c; with stale trajectories masked the
    groups are judged by their newest tokens: d (3, 5) after e (4, 4)."""
    b = TrajectoryBuffer(capacity=16, max_staleness=2)
    b.note_submitted(6)
    for g, v in (("a", 4), ("b", 3), ("c", 4)):
        for i in range(2):
            assert b.offer(traj(f"{g}{i}", [v], group=g))
    assert [[t.trajectory_id for t in b.take(2, 5, 2)] for _ in range(3)] == [["b0", "b1"], ["a0", "a1"], ["c0", "c1"]]
    m = TrajectoryBuffer(capacity=16, max_staleness=2, keep_partly_stale=True)
    m.note_submitted(4)
    for tid, g, versions in (("d0", "d", [3, 5]), ("d1", "d", [5]), ("e0", "e", [4, 4]), ("e1", "e", [4])):
        assert m.offer(traj(tid, versions, group=g))
    assert [t.trajectory_id for t in m.take(2, 5, 2)] == ["e0", "e1"]


def test_a_held_batch_that_passes_over_a_group_on_its_last_chance_is_taken_again():
    """Bound 2, batch of one group of 2, taken ahead for version 5 while group a (tokens at 3) had
    one member: b (tokens at 4) is taken. Then a1 arrives: a is whole at 5 and stale at 6 (its last
    chance), b could wait (staleness 2 at 6): the batch goes back and the retake at 5 trains a; b
    is taken at 6 within the bound, and nothing is dropped."""
    b = TrajectoryBuffer(capacity=8, max_staleness=2)
    b.note_submitted(4)
    for tid, v, g in (("a0", 3, "a"), ("b0", 4, "b"), ("b1", 4, "b")):
        assert b.offer(traj(tid, [v], group=g))
    held = b.take_ahead(2, consuming_version=5, group_size=2)
    assert [t.trajectory_id for t in held] == ["b0", "b1"]
    assert not b.passes_over_last_chance(5, group_size=2)  # a is not whole yet
    assert b.offer(traj("a1", [3], group="a"))
    assert b.passes_over_last_chance(5, group_size=2)
    b.put_back(held)
    assert [t.trajectory_id for t in b.take(2, 5, 2, hold=True)] == ["a0", "a1"]
    assert not b.passes_over_last_chance(5, group_size=2)  # b, buffered, can wait
    assert [t.trajectory_id for t in b.take(2, 6, 2)] == ["b0", "b1"]
    assert (b.dropped["stale"], b.held, b.accounting_ok()) == (0, 2, True)


def test_no_retake_when_the_held_batch_cannot_wait_or_the_group_has_another_chance():
    """Bound 2, consuming version 5, one group of 2 per batch. Held c (tokens at 3) is itself on its
    last chance: no retake for a (at 3). Held b (at 4) with d (at 4, can wait) whole in the buffer:
    no retake. Whole e (tokens 3, 4 and 4) is on its last chance, unless stale tokens are masked: judged
    by its newest token, it can wait."""
    b = TrajectoryBuffer(capacity=8, max_staleness=2)
    b.note_submitted(8)
    for tid, v, g in (("c0", 3, "c"), ("c1", 3, "c"), ("a0", 3, "a"), ("a1", 3, "a")):
        assert b.offer(traj(tid, [v], group=g))
    b.take_ahead(2, consuming_version=5, group_size=2)
    assert b.held_ids() == {"c0", "c1"} and not b.passes_over_last_chance(5, group_size=2)
    b2 = TrajectoryBuffer(capacity=8, max_staleness=2)
    b2.note_submitted(4)
    for tid, g in (("b0", "b"), ("b1", "b"), ("d0", "d"), ("d1", "d")):
        assert b2.offer(traj(tid, [4], group=g))
    b2.take_ahead(2, consuming_version=5, group_size=2)
    assert not b2.passes_over_last_chance(5, group_size=2)
    for mask, retake in ((False, True), (True, False)):
        m = TrajectoryBuffer(capacity=8, max_staleness=2, keep_partly_stale=mask)
        m.note_submitted(4)
        assert m.offer(traj("b0", [4], group="b")) and m.offer(traj("b1", [4], group="b"))
        m.take_ahead(2, consuming_version=5, group_size=2)
        assert m.offer(traj("e0", [3, 4], group="e")) and m.offer(traj("e1", [4], group="e"))
        assert m.passes_over_last_chance(5, group_size=2) is retake
