"""The job's /v1/status ledger (trainer.driver.loop.report.status_fields) on a real buffer and stand-in parts."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from protocol import JobStatus, Trajectory
from trainer.driver.loop.report import status_fields
from trainer.driver.sources.buffer import TrajectoryBuffer


def traj(tid: str, group: str) -> Trajectory:
    return Trajectory(
        trajectory_id=tid, group_id=group, token_ids=np.arange(4), loss_mask=[0, 0, 1, 1],
        behav_logprobs=[0.0, 0.0, -0.5, -0.5], versions=[-1, -1, 0, 0], policy_version=0, prompt_len=2,
        finish_reason="stop",
    )  # fmt: skip


def test_the_ledger_closes_with_the_batch_taken_ahead():
    """10 submitted, 8 arrived into a buffer of 7 (one dropped ``buffer_full``), 4 taken ahead:
    generated 10 = consumed 0 + dropped 1 + buffered 3 + held 4 + in flight 2."""
    buf = TrajectoryBuffer(capacity=7, max_staleness=2)
    buf.note_submitted(10)
    for i in range(8):  # the 8th does not fit: capacity 7
        buf.offer(traj(f"t{i}", group=f"g{i // 2}"))
    assert buf.take_ahead(4, consuming_version=1, group_size=2) is not None
    job = SimpleNamespace(
        version=0, run_segment=0, route=SimpleNamespace(name="snapshot"), pool=SimpleNamespace(statuses=lambda: []),
        buffer=buf, last_publish={}, source=SimpleNamespace(status=lambda: None),
        fingerprints=SimpleNamespace(mismatches=0, unverified=0), evals=SimpleNamespace(resubmitted=0),
    )  # fmt: skip
    f = status_fields(job, None)
    s = JobStatus(**f)
    assert (s.generated, s.consumed, s.buffer_size, s.held, s.in_flight, s.dropped) == (
        10,
        0,
        3,
        4,
        2,
        {"buffer_full": 1},
    )
    assert s.generated == s.consumed + sum(s.dropped.values()) + s.buffer_size + s.held + s.in_flight
