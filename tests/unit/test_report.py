"""The job's /v1/status ledger (trainer.driver.loop.report.status_fields) on a real buffer and stand-in parts."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from protocol import JobStatus, Trajectory
from trainer.driver.loop.report import status_fields, step_line
from trainer.driver.records.metrics_log import StepMetrics
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
        buffer=buf, publisher=SimpleNamespace(last={}), source=SimpleNamespace(status=lambda: None),
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


def test_the_collapse_signals_reach_the_step_line_and_the_status():
    """A step whose batch had 1 of 4 groups with equal rewards and a mean KL to the reference of
    0.0123 nats: the line shows ``zero-var 1/4`` and ``kl_ref 0.0123``; the status has the share
    0.25 and the same KL. Without a reference the line leaves ``kl_ref`` out and the status says None."""
    m = StepMetrics(
        version=3, consumed_version=2, applied=True, skipped_steps=0, loss=0.5, tokens=64.0, reward_mean=0.5,
        reward_max=1.0, staleness_mean=1.0, staleness_max=1, staleness_hist={1: 8}, old_logits_s=0.1, train_s=2.0,
        publish_s=0.1, zero_variance_groups=1, groups=4, kl_ref=0.0123, entropy=0.7,
    )  # fmt: skip
    line = step_line(m, 3)
    assert "  zero-var 1/4  kl_ref 0.0123  " in line and "entropy 0.70" in line
    assert "kl_ref" not in step_line(m.model_copy(update={"kl_ref": None}), 3)
    buf = TrajectoryBuffer(capacity=4, max_staleness=2)
    job = SimpleNamespace(
        version=3, run_segment=0, route=SimpleNamespace(name="snapshot"), pool=SimpleNamespace(statuses=lambda: []),
        buffer=buf, publisher=SimpleNamespace(last={}), source=SimpleNamespace(status=lambda: None),
        fingerprints=SimpleNamespace(mismatches=0, unverified=0), evals=SimpleNamespace(resubmitted=0),
    )  # fmt: skip
    f = status_fields(job, None, m)
    assert (f["zero_variance_share"], f["kl_ref"], f["entropy"]) == (0.25, 0.0123, 0.7)
    assert status_fields(job, None, m.model_copy(update={"kl_ref": None, "groups": 0}))["kl_ref"] is None
