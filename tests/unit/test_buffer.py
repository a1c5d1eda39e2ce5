"""Staleness accounting and buffer bookkeeping."""

import numpy as np
import pytest

from protocol import Trajectory
from trainer.buffer import TrajectoryBuffer, admission_capacity, sequence_staleness, token_staleness_histogram


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
    # bound 2 at version 3: (3+2+1)*8 = 48 submissions allowed in total
    assert admission_capacity(3, 2, 8, 40) == 8


def test_case5_token_histogram_is_per_token():
    t = traj("a", [3, 3, 3, 4, 4, 5])
    assert token_staleness_histogram([t], 6) == {1: 1, 2: 2, 3: 3}
    assert sequence_staleness(t, 6) == 3


def test_buffer_state_roundtrip_counts_lost():
    b = TrajectoryBuffer(capacity=4, max_staleness=1)
    b.note_submitted(3)
    b.offer(traj("a", [0]))
    b.take(1, 0)
    b2 = TrajectoryBuffer(capacity=4, max_staleness=1)
    b2.load_state_dict(b.state_dict())
    assert b2.consumed == 1 and b2.dropped["lost_at_restart"] == 2 and b2.accounting_ok()


def test_rejected_arrivals_are_counted():
    b = TrajectoryBuffer(capacity=4, max_staleness=1)
    b.note_submitted(2)
    b.reject("aborted")
    b.offer(traj("a", [0]))
    assert b.dropped["aborted"] == 1 and b.in_flight == 0 and len(b) == 1 and b.accounting_ok()
