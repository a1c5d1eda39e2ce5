"""Trajectories sampled under other weights than their version's are dropped, never trained on:
at intake, out of the buffer and out of a batch taken ahead (the rest of which goes back), with
the reason ``fingerprint_mismatch`` in the buffer's counts and the ledger, the ledger closing; and
workers that applied a publication outside a publish (joiners, late workers) are checked too."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
from rich.console import Console

from protocol import Trajectory
from trainer.driver.config.schema import load_config
from trainer.driver.loop.parts import Job, intake_refusal
from trainer.driver.publication.fingerprint_check import FingerprintCheck
from trainer.driver.publication.fingerprints import (
    FINGERPRINT_MISMATCH,
    expected_entries,
    prune_expected,
    trajectory_mismatch,
)
from trainer.driver.sources.buffer import TrajectoryBuffer

A, B, C, X = "a" * 16, "b" * 16, "c" * 16, "0" * 16
"""v3's and v4's published fingerprints, one of a version nobody published (v2), the folder's."""
EXPECTED = {3: A, 4: B}


def traj(tid: str, group: str, worker: str, version: int, fp: str | None) -> Trajectory:
    return Trajectory(
        trajectory_id=tid,
        group_id=group,
        worker_id=worker,
        token_ids=np.arange(4),
        loss_mask=[0, 0, 1, 1],
        behav_logprobs=[0.0, 0.0, -0.5, -0.5],
        versions=[-1, -1, version, version],
        policy_version=version,
        served_fingerprint=fp,
        prompt_len=2,
        finish_reason="stop",
    )


def test_the_rule_judges_only_what_is_known():
    assert not trajectory_mismatch(traj("t", "g", "w0", 3, A), EXPECTED)
    assert trajectory_mismatch(traj("t", "g", "w1", 3, X), EXPECTED)
    assert not trajectory_mismatch(traj("t", "g", "w1", 4, None), EXPECTED)  # no fingerprint: not judged
    assert not trajectory_mismatch(traj("t", "g", "w0", 2, C), EXPECTED)  # v2: nothing expected
    # an adapter version: each worker's own merge, looked up before the version's entry
    per_worker = {("w0", 5): C, 5: A}
    assert not trajectory_mismatch(traj("t", "g", "w0", 5, C), per_worker)
    assert trajectory_mismatch(traj("t", "g", "w1", 5, C), per_worker)
    assert intake_refusal(traj("t", "g", "w1", 4, X), 1000, EXPECTED) == FINGERPRINT_MISMATCH
    assert intake_refusal(traj("t", "g", "w0", 4, B), 1000, EXPECTED) is None


def test_expected_entries_full_weights_and_adapters():
    full = SimpleNamespace(version=3, adapter=None, fingerprint=A)
    assert expected_entries(full, {"w1": {"version": 3, "served": X, "applied": A}}) == {3: A}
    assert expected_entries(SimpleNamespace(version=3, adapter=None, fingerprint=None), {}) == {}
    adapter = SimpleNamespace(version=3, adapter="spec", fingerprint=A)
    reports = {
        "w0": {"version": 3, "served": B, "applied": B},
        "w1": {"version": 3, "served": X, "applied": B},  # mismatched: vouches for nothing
        "w2": {"version": 2, "served": C, "applied": C},  # another version
    }
    assert expected_entries(adapter, reports) == {("w0", 3): B}


def test_entries_below_the_staleness_bound_are_pruned():
    expected = {1: A, 2: B, ("w0", 1): C, ("w0", 3): X}
    # at version 4 with max_staleness 2, versions 2 .. 4 can still be trained on
    assert prune_expected(expected, 4 - 2) == {2: B, ("w0", 3): X}
    assert prune_expected(expected, 0) == expected


def _job(buffer: TrajectoryBuffer) -> Job:
    j = Job.__new__(Job)  # only the buffer, the route's answer and the fingerprint check are needed
    j.cfg = load_config(None, ["controller.max_staleness=2"])
    j.buffer, j.version, j.vocab_size, j.taken_ahead, j.retaken = buffer, 4, 1000, 0, 0
    j.batch_size, j.group_size, j.times = 4, 2, Counter()
    j.source = SimpleNamespace(poll=lambda: [])  # nothing finishes meanwhile
    j.route = SimpleNamespace(async_old_logits=lambda batch, v, temperature: None, attach=lambda got, temperature: got)
    j.fingerprints = FingerprintCheck(j.cfg, Console(quiet=True), None, j.route)
    j.fingerprints.expected = dict(EXPECTED)
    return j


def test_buffered_and_taken_ahead_mismatches_are_dropped_and_the_ledger_closes():
    """10 submitted, 8 arrived in 4 groups of 2 (bound 2), 2 still in flight. Taken ahead for v5
    (oldest token >= 3): g1 = t1, t2 (v3) and g2 = t3, t4 (v4). Then w1 is found serving the
    folder's weights X: t2 (held) and t5 (buffered) carry X, t6 has no fingerprint (not judged),
    g4 is of v2 (nothing expected: not judged). Dropped: t5 first (buffered), then t2 (held);
    the batch taken ahead is no longer whole, so t1, t3, t4 go back to the front. Then 10 =
    0 consumed + 2 dropped + 6 buffered + 0 held + 2 in flight. The next batch at v4 takes the
    whole groups g4 (t7, t8: the oldest, first) and g2 (t3, t4); t1 and t6 wait for their group."""
    events = []
    buf = TrajectoryBuffer(
        capacity=16, max_staleness=2, ledger=lambda e, ids, reason=None, **fields: events.append((e, ids, reason))
    )
    buf.note_submitted(10)
    rows = [
        ("t1", "g1", "w0", 3, A), ("t2", "g1", "w1", 3, X), ("t3", "g2", "w0", 4, B), ("t4", "g2", "w0", 4, B),
        ("t5", "g3", "w1", 4, X), ("t6", "g3", "w1", 4, None), ("t7", "g4", "w0", 2, C), ("t8", "g4", "w0", 2, C),
    ]  # fmt: skip
    for r in rows:
        assert buf.offer(traj(*r))
    j = _job(buf)
    j.fingerprints.expected = {}  # the mismatch is not known yet when the batch is taken ahead
    ahead = j.take(ahead=True)
    assert [t.trajectory_id for t in ahead.trajectories] == ["t1", "t2", "t3", "t4"] and buf.held == 4
    j.fingerprints.expected = dict(EXPECTED)  # now it is (an adapter version's merge, checked after its take)
    events.clear()
    assert j.confirm_ahead(ahead) is None
    assert events == [("dropped", ["t5", "t2"], FINGERPRINT_MISMATCH)]
    assert dict(buf.dropped) == {FINGERPRINT_MISMATCH: 2} and buf.held == 0
    assert [t.trajectory_id for t in buf.saved()] == ["t1", "t3", "t4", "t6", "t7", "t8"]
    assert (buf.submitted, buf.consumed, len(buf), buf.in_flight) == (10, 0, 6, 2) and buf.accounting_ok()
    batch = j.take()
    assert [t.trajectory_id for t in batch.trajectories] == ["t7", "t8", "t3", "t4"]
    j.buffer.consume(batch.trajectories)
    assert (buf.consumed, len(buf), buf.held, sum(buf.dropped.values())) == (4, 2, 0, 2) and buf.accounting_ok()
    # a batch taken ahead that lost nothing is trained as it is
    buf.offer(traj("t9", "g1", "w0", 3, A))
    buf.offer(traj("t10", "g3", "w0", 4, B))
    kept = j.take(ahead=True)
    assert j.confirm_ahead(kept) is kept and [t.trajectory_id for t in kept.trajectories] == ["t1", "t9", "t6", "t10"]


class _Pool:
    """Two workers applied v3 outside a publish: rollout-2 (a joiner that skipped its catch-up
    load) serves the folder's X, rollout-3 (late) does not answer yet."""

    def __init__(self, manifest):
        self.unverified = {"rollout-2": manifest, "rollout-3": manifest}
        self.killed, self.asked = [], []

    def take_unverified(self):
        out, self.unverified = self.unverified, {}
        return out

    def fingerprints(self, only=None):
        self.asked.append(only)
        return {"rollout-2": {"version": 3, "served": X, "applied": A}}

    def mark_unverified(self, wid, manifest):
        self.unverified[wid] = manifest

    def kill(self, wids, reason):
        self.killed.append((wids, reason))


def test_a_joiner_serving_other_weights_is_killed_and_counted():
    manifest = SimpleNamespace(version=3, adapter=None, fingerprint=A)
    pool = _Pool(manifest)
    f = FingerprintCheck(load_config(None, []), Console(quiet=True), pool, None)
    assert f.check_joined_workers() == ["rollout-2"]
    assert pool.asked == [["rollout-2", "rollout-3"]]
    assert pool.killed == [(["rollout-2"], FINGERPRINT_MISMATCH)] and f.mismatches == 1
    assert pool.unverified == {"rollout-3": manifest}  # asked again next time
    assert f.expected == {3: A}
