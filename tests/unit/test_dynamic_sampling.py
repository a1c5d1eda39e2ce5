"""Dynamic sampling (``controller.dynamic_sampling``, DAPO's ``filter_groups``): a whole group of equal
rewards is dropped at intake as ``filtered``, reported by id to the ledger, counted per group, bounded
per learner version, kept by a checkpoint, and its places go back to admission. Hand-worked values:
groups of 4, rewards ``[1, 1, 1, 1]`` (dropped) and ``[0, 1, 0, 0]`` (kept)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import httpx
import numpy as np
import pydantic
import pytest
from rich.console import Console

from protocol import JobStatus, Trajectory
from trainer.driver.cluster.server import ApiServer, StatusBoard
from trainer.driver.config.schema import load_config
from trainer.driver.loop.parts import Job, filter_bound
from trainer.driver.loop.report import status_fields
from trainer.driver.publication.fingerprint_check import FingerprintCheck
from trainer.driver.publication.routes import Route
from trainer.driver.records.ledger import fates
from trainer.driver.sources.buffer import TrajectoryBuffer, admission_capacity
from trainer.driver.sources.source import EnvSource


def traj(tid, group, reward, version=0, **kw):
    return Trajectory(
        trajectory_id=tid, group_id=group, token_ids=np.arange(4), loss_mask=[0, 0, 1, 1],
        behav_logprobs=[0.0, 0.0, -0.5, -0.5], versions=[-1, -1, version, version], policy_version=version,
        prompt_len=2, finish_reason="stop", reward=reward, **kw,
    )  # fmt: skip


def group(name, rewards, **kw):
    return [traj(f"{name}/{k}", name, r, **kw) for k, r in enumerate(rewards)]


class Recorder:
    """A ledger that keeps its events as the run's ``ledger.jsonl`` rows would be."""

    def __init__(self):
        self.events = []

    def __call__(self, event, ids, reason=None, **fields):
        row = {"event": event, "ids": list(ids), **fields}
        if reason is not None:
            row["reason"] = reason
        self.events.append(row)


def buffer_with(*groups, capacity=32):
    """A buffer (bound 1) with every trajectory of ``groups`` submitted and offered."""
    ledger = Recorder()
    b = TrajectoryBuffer(capacity=capacity, max_staleness=1, ledger=ledger)
    trajs = [t for g in groups for t in g]
    b.note_submitted(len(trajs))
    for t in trajs:
        b.offer(t)
    return b, ledger, [t.group_id for t in trajs]


def test_uniform_group_is_dropped_as_filtered_and_a_varied_one_kept():
    b, ledger, arrived = buffer_with(group("u", [1, 1, 1, 1]), group("v", [0, 1, 0, 0]))
    assert admission_capacity(0, 0, 8, b.scheduled) == 0  # 8 scheduled fill version 0's batch of 8
    out = b.filter_groups(arrived, learner_version=0, group_size=4, bound=2)
    assert out == ["u/0", "u/1", "u/2", "u/3"]
    assert ledger.events[-1] == {"event": "dropped", "ids": out, "reason": "filtered"}
    got = fates(ledger.events)  # each id: buffered on arrival, then exactly one fate
    assert {i: got[i] for i in out} == {i: ["dropped:filtered"] for i in out}
    assert all(got[f"v/{k}"] == [] for k in range(4))  # still buffered (no checkpoint line yet)
    # counters: 4 trajectories dropped, 1 group; the identity 8 = 0 + 4 + 4 + 0 + 0 holds
    assert (b.dropped["filtered"], b.filtered_groups, b.zero_variance_admitted) == (4, 1, 0)
    assert (b.submitted, b.consumed, len(b), b.held, b.in_flight) == (8, 0, 4, 0, 0) and b.accounting_ok()
    # the 4 places freed go back to admission: new prompts refill the batch
    assert (b.scheduled, admission_capacity(0, 0, 8, b.scheduled)) == (4, 4)
    assert [t.trajectory_id for t in b.take(4, consuming_version=0, group_size=4)] == [f"v/{k}" for k in range(4)]


def test_a_group_is_judged_when_its_last_member_arrives():
    ledger = Recorder()
    b = TrajectoryBuffer(capacity=8, max_staleness=1, ledger=ledger)
    b.note_submitted(4)
    members = group("u", [1, 1, 1, 1])
    for t in members[:3]:
        b.offer(t)
    assert b.filter_groups(["u"] * 3, 0, 4, bound=2) == [] and len(b) == 3  # 3 of 4: not whole yet
    b.offer(members[3])
    assert b.filter_groups(["u"], 0, 4, bound=2) == [t.trajectory_id for t in members]
    assert (len(b), b.filtered_groups, b.dropped["filtered"]) == (0, 1, 4) and b.accounting_ok()


def test_the_bound_admits_the_next_uniform_group_in_the_same_step():
    # bound 1: at version 0 the first uniform group is dropped, the second (bound + 1-th) is kept
    # and counted; at version 1 the count starts again and a third is dropped
    b, ledger, arrived = buffer_with(group("a", [1, 1, 1, 1]), group("b", [0, 0, 0, 0]), group("v", [0, 1, 0, 0]))
    assert b.filter_groups(arrived, learner_version=0, group_size=4, bound=1) == [f"a/{k}" for k in range(4)]
    assert (b.filtered_groups, b.zero_variance_admitted, b.filter_step) == (1, 1, (0, 1))
    assert [*b._items][:4] == [f"b/{k}" for k in range(4)] and b.accounting_ok()
    c = group("c", [1, 1, 1, 1], version=1)
    b.note_submitted(4)
    for t in c:
        b.offer(t)
    assert b.filter_groups(["c"] * 4, learner_version=0, group_size=4, bound=1) == []  # same step: kept
    assert b.zero_variance_admitted == 2
    d = group("d", [0.5] * 4, version=1)
    b.note_submitted(4)
    for t in d:
        b.offer(t)
    assert b.filter_groups(["d"] * 4, learner_version=1, group_size=4, bound=1) == [f"d/{k}" for k in range(4)]
    assert (b.filtered_groups, b.zero_variance_admitted, b.filter_step, b.dropped["filtered"]) == (2, 2, (1, 1), 8)
    assert b.accounting_ok()
    # bound 0: nothing is ever dropped
    b0, _, arrived0 = buffer_with(group("e", [1, 1, 1, 1]))
    assert b0.filter_groups(arrived0, 0, 4, bound=0) == [] and (b0.filtered_groups, b0.zero_variance_admitted) == (0, 1)


def test_baseline_groups_eval_samples_and_fp32_equal_rewards():
    # a gateway group closed short with a baseline (advantage reward - baseline) and held-out
    # samples are never filtered; rewards equal in fp32 (0.1 and 0.1 + 1e-12) are equal, as the
    # learner's zero-variance test reads them
    b, _, arrived = buffer_with(
        group("p", [1, 1], baseline=0.5),
        group("h", [1, 1, 1, 1], purpose="eval"),
        group("f", [0.1, 0.1 + 1e-12, 0.1, 0.1]),
    )
    assert b.filter_groups(arrived, 0, 4, bound=8) == [f"f/{k}" for k in range(4)]
    b2, _, arrived2 = buffer_with(group("s", [1, 1], baseline=None))
    assert b2.filter_groups(arrived2, 0, 2, bound=8) == ["s/0", "s/1"]  # the same group without a baseline


def test_bad_arguments_name_the_value():
    b = TrajectoryBuffer(capacity=4, max_staleness=1)
    with pytest.raises(ValueError, match="max_filtered_groups_per_step: must be >= 0, got -1"):
        b.filter_groups([], 0, 4, bound=-1)
    with pytest.raises(ValueError, match="group_size: must be >= 1, got 0"):
        b.filter_groups([], 0, 0, bound=1)


def test_state_round_trips_and_a_resume_keeps_the_count():
    b, _, arrived = buffer_with(group("a", [1, 1, 1, 1]), group("b", [0, 0, 0, 0]), group("v", [0, 1, 0, 0]))
    b.filter_groups(arrived, learner_version=3, group_size=4, bound=1)
    state = b.state_dict()
    assert (state["filtered_groups"], state["zero_variance_admitted"], state["filter_step"]) == (1, 1, [3, 1])
    assert state["dropped"] == {"filtered": 4} and len(state["buffered_ids"]) == 8
    r = TrajectoryBuffer(capacity=32, max_staleness=1)
    r.load_state_dict(state, b.saved())
    assert (r.filtered_groups, r.zero_variance_admitted, r.filter_step) == (1, 1, (3, 1))
    assert (r.dropped, r.dropped_total, r.scheduled) == (Counter({"filtered": 4}), 4, 8) and r.accounting_ok()
    assert r.state_dict() == state
    # resumed at the same version, its bound is spent: the next uniform group is kept
    r.note_submitted(4)
    for t in group("c", [1, 1, 1, 1], version=3):
        r.offer(t)
    assert r.filter_groups(["c"], 3, 4, bound=1) == [] and r.zero_variance_admitted == 2
    # a checkpoint written before dynamic sampling existed resumes with zero counts
    old = {"submitted": 4, "consumed": 4, "dropped": {}}
    r2 = TrajectoryBuffer(capacity=4, max_staleness=1)
    r2.load_state_dict(old)
    assert (r2.filtered_groups, r2.zero_variance_admitted) == (0, 0) and r2.accounting_ok()


class Pool:
    """Answers each poll with the next scripted list (then nothing); records submissions."""

    def __init__(self, polls):
        self.polls, self.sent = list(polls), []

    def poll(self):
        return self.polls.pop(0) if self.polls else []

    def submit(self, reqs):
        self.sent += reqs
        return sum(r.sampling.n for r in reqs)

    def __len__(self):
        return 1


def job(polls, *overrides):
    j = Job.__new__(Job)  # only the buffer, pool, source and route parts are needed
    j.cfg = load_config(
        None, ["controller.max_staleness=0", "controller.batch_groups=2", "rollout.sampling.n=4", *overrides]
    )
    j.pool, j.route, j.version, j.times = Pool(polls), Route(), 0, Counter()
    j.ledger = Recorder()
    j.buffer = TrajectoryBuffer(capacity=32, max_staleness=0, ledger=j.ledger)
    j.source = EnvSource(j.cfg, j.pool, j.buffer, lambda: j.version)
    j.batch_size, j.group_size, j.vocab_size, j.taken_ahead = 8, 4, 1000, 0
    j.fingerprints = FingerprintCheck(j.cfg, Console(quiet=True), j.pool, j.route)
    return j


def test_collect_filters_after_the_intake_and_admission_refills():
    # batch 2 groups of 4, bound 0 (synchronous): 8 samples admitted; group "u" arrives in two
    # polls and is judged when whole; its 4 places are admitted to a new prompt at once
    u, v = group("u", [1, 1, 1, 1]), group("v", [0, 1, 0, 0])
    j = job([[u[0], v[0], v[1]], [u[1], u[2], u[3], v[2], v[3]]], "controller.dynamic_sampling=true")
    j.top_up()
    assert (len(j.pool.sent), j.buffer.submitted) == (2, 8)
    j.collect()
    assert (len(j.buffer), j.buffer.filtered_groups) == (3, 0)
    j.collect()
    assert (len(j.buffer), j.buffer.filtered_groups, j.buffer.dropped["filtered"]) == (4, 1, 4)
    assert j.ledger.events[-1] == {"event": "dropped", "ids": [f"u/{k}" for k in range(4)], "reason": "filtered"}
    j.top_up()  # the freed places: one new group, a new env seed
    assert (len(j.pool.sent), j.buffer.submitted, j.source.next_seed) == (3, 12, 3) and j.buffer.accounting_ok()
    # off (the default): the same intake keeps the group
    off = job([[*u, *v]])
    off.buffer.note_submitted(8)
    off.collect()
    assert (len(off.buffer), off.buffer.filtered_groups) == (8, 0)


def test_config_default_bound_and_refusals():
    cfg = load_config(None, ["controller.batch_groups=3", "controller.dynamic_sampling=true"])
    assert cfg.controller.max_filtered_groups_per_step is None and filter_bound(cfg) == 6
    assert filter_bound(load_config(None, ["controller.max_filtered_groups_per_step=1"])) == 1
    with pytest.raises(
        pydantic.ValidationError, match='controller.dynamic_sampling: true with loss.advantage = "reinforce"'
    ):
        load_config(None, ["controller.dynamic_sampling=true", 'loss.advantage="reinforce"'])
    with pytest.raises(pydantic.ValidationError, match="controller.dynamic_sampling: true with rollout.sampling.n = 1"):
        load_config(None, ["controller.dynamic_sampling=true", "rollout.sampling.n=1"])
    with pytest.raises(pydantic.ValidationError, match="max_filtered_groups_per_step"):
        load_config(None, ["controller.max_filtered_groups_per_step=-1"])


def test_counts_reach_status_and_prometheus():
    b, _, arrived = buffer_with(group("a", [1, 1, 1, 1]), group("b", [0, 0, 0, 0]))
    b.filter_groups(arrived, 0, 4, bound=1)
    job_ = SimpleNamespace(
        version=0, run_segment=0, route=SimpleNamespace(name="none"), pool=SimpleNamespace(statuses=lambda: []),
        buffer=b, publisher=SimpleNamespace(last={}), source=SimpleNamespace(status=lambda: None),
        fingerprints=SimpleNamespace(mismatches=0, unverified=0), evals=SimpleNamespace(resubmitted=0),
    )  # fmt: skip
    s = JobStatus(**status_fields(job_, None))
    assert (s.filtered_groups, s.zero_variance_admitted, s.dropped) == (1, 1, {"filtered": 4})
    assert s.generated == s.consumed + sum(s.dropped.values()) + s.buffer_size + s.held + s.in_flight
    board = StatusBoard()
    srv = ApiServer(board, host="127.0.0.1", port=0, token="s3cret-0123456789abcdef").start()
    try:
        board.update(**status_fields(job_, None))
        assert httpx.get(f"{srv.url}/v1/status").json()["filtered_groups"] == 1
        text = httpx.get(f"{srv.url}/metrics").text
        for line in (
            "vintage_filtered_groups 1.0",
            "vintage_zero_variance_admitted 1.0",
            'vintage_trajectories_dropped{reason="filtered"} 4.0',
        ):
            assert line in text, line
    finally:
        srv.stop()
