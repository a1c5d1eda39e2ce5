"""GRPO groups of gateway sessions: full groups handed over at once, groups that cannot fill handed
over after ``group_wait_s`` with stated baselines, counted; the buffer and ``collate`` train on them.
A fake clock moves time; every baseline and advantage is worked out by hand."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
import torch
from pydantic import ValidationError

from protocol import Trajectory
from rollout.gateway import Gateway, GatewayServer, WorkerBackend
from rollout.gateway.groups import BASELINE_WINDOW, GroupGate
from rollout.gateway.sessions import EndedSession
from tests.scripted_gateway import FakeClock, ScriptedPool, chat_format, reply
from trainer.algorithm.batch import collate, sequence_advantages
from trainer.driver.config.schema import GatewayConfig
from trainer.driver.sources.buffer import TrajectoryBuffer

ADMIN = "admin-token-for-tests"
USER = [{"role": "user", "content": "Hi"}]


def traj(tid: str, group: str, reward: float) -> Trajectory:
    return Trajectory(
        trajectory_id=tid, group_id=group, token_ids=np.array([1, 2, 3], np.int32),
        loss_mask=np.array([0, 1, 1], np.int8), behav_logprobs=np.array([0.0, -0.5, -0.5], np.float32),
        versions=np.array([-1, 0, 0], np.int32), policy_version=0, prompt_len=1, finish_reason="stop",
        reward=reward,
    )  # fmt: skip


def ended(sid: str, group: str, reward: float, segments: int = 1) -> EndedSession:
    ts = [traj(sid if segments == 1 else f"{sid}/{k}", group, reward) for k in range(segments)]
    return EndedSession(sid, group, ts, None, reward)


def test_full_groups_go_at_once_and_a_group_that_cannot_fill_goes_after_the_wait_with_baselines():
    clock = FakeClock()
    gate = GroupGate(group_size=3, wait_s=120.0, clock=clock)
    assert gate.add(ended("a", "g", 1.0)) == [] and gate.add(ended("b", "g", 0.0)) == []  # g waits from t = 0
    full = [gate.add(ended(f"h{i}", "h", r)) for i, r in enumerate([1.0, 0.0, 0.5])][-1]
    assert [e.session_id for e in full] == ["h0", "h1", "h2"]  # h filled: handed over as it is
    assert all(t.baseline is None for e in full for t in e.trajectories)  # the learner's estimator decides
    assert (gate.waiting, gate.groups_full, gate.groups_partial) == (2, 1, 0)
    clock.t = 119.5
    assert gate.due() == [] and gate.waiting == 2
    clock.t = 120.0
    a, b = gate.due()
    # leave-one-out: a's baseline is b's reward (0.0), b's is a's (1.0)
    assert (a.trajectories[0].baseline, b.trajectories[0].baseline) == (0.0, 1.0)
    assert (gate.waiting, gate.groups_partial, gate.sessions_partial) == (0, 1, 2)
    # a session alone (no group_id), split into 2 segments: both get the mean of the last rewards
    # handed over, h's and g's: (1.0 + 0.0 + 0.5 + 1.0 + 0.0) / 5 = 0.5
    (c,) = gate.add(ended("c", "c", 0.75, segments=2), alone=True)
    assert [t.baseline for t in c.trajectories] == [0.5, 0.5]
    assert (gate.groups_partial, gate.sessions_partial) == (2, 3)


def test_baselines_of_a_partial_group():
    gate = GroupGate(group_size=4, wait_s=1.0, clock=FakeClock())
    # three sessions: each gets the mean of the other two: (0.0 + 0.5) / 2, (1.0 + 0.5) / 2, (1.0 + 0.0) / 2
    assert gate.baselines([1.0, 0.0, 0.5]) == [0.25, 0.75, 0.5]
    assert gate.baselines([0.8]) == [0.0]  # alone, nothing handed over yet: no baseline (plain REINFORCE)
    for k in range(BASELINE_WINDOW + 8):  # only the last 32 rewards count: 8 ones, then 32 twos
        gate.add(ended(f"s{k}", f"s{k}", 1.0 if k < 8 else 2.0), alone=True)
    assert gate.baselines([0.8]) == [2.0]


@pytest.mark.parametrize("wait", [0.0, -1.0, float("inf"), float("nan")])
def test_the_wait_must_be_a_positive_number(wait):
    with pytest.raises(ValueError, match="gateway.group_wait_s: must be a positive number"):
        GroupGate(4, wait)
    with pytest.raises(ValueError, match="group_wait_s"):
        GatewayConfig(group_wait_s=wait)


def test_closed_groups_are_taken_short_of_the_group_size_and_trained_against_their_baseline():
    buf = TrajectoryBuffer(capacity=16, max_staleness=4)
    for t in [traj("x0", "x", 1.0), traj("x1", "x", 0.0)]:  # a full group of 2, GRPO
        buf.offer(t)
    buf.offer(traj("s", "s", 0.8).model_copy(update={"baseline": 0.5}))  # closed at one session
    batch = buf.take(4, consuming_version=0, group_size=2)  # x fills one place, s the other
    assert [t.trajectory_id for t in batch] == ["x0", "x1", "s"]
    b = collate(batch, consuming_version=0)
    # x: mean 0.5, std 0.5 -> +1, -1; s: 0.8 - 0.5 = 0.3
    assert b.seq_advantages.tolist() == pytest.approx([1.0, -1.0, 0.3])
    r, g, base = torch.tensor([1.0, 0.0, 0.8]), ["x", "x", "s"], torch.tensor([float("nan"), float("nan"), 0.5])
    assert sequence_advantages(r, g, "rloo", base).tolist() == pytest.approx([1.0, -1.0, 0.3])
    assert sequence_advantages(r, g, "reinforce", base).tolist() == pytest.approx([1.0, 0.0, 0.8])
    with pytest.raises(ValidationError, match=r"baseline\n  Input should be a finite number"):
        Trajectory.model_validate({**dict(traj("n", "n", 0.0)), "baseline": float("nan")})


def test_a_session_without_a_group_trains_over_http_and_the_status_counts_the_waiting():
    clock = FakeClock()
    pool = ScriptedPool([reply("A"), reply("B"), reply("C")])
    backend = WorkerBackend(pool.submit, pool.poll, lambda: 0)
    gw = Gateway(backend, chat_format(), 4096, admin_token=ADMIN, clock=clock, group_size=3, group_wait_s=120.0)
    server = GatewayServer(gw).start()
    admin = {"Authorization": f"Bearer {ADMIN}"}

    def episode(body: dict, reward: float) -> str:
        s = httpx.post(f"{server.url}/v1/sessions", json=body, headers=admin, timeout=10).json()
        client = openai.OpenAI(base_url=s["base_url"], api_key=s["key"], max_retries=0)
        client.chat.completions.create(model="m", messages=USER, max_tokens=8)
        h = {"Authorization": f"Bearer {s['key']}"}
        end = httpx.post(f"{server.url}/v1/sessions/{s['id']}/end", json={"reward": reward}, headers=h, timeout=10)
        assert end.json()["trajectories"] == 1
        return s["id"]

    try:
        a, b = episode({"group_id": "task-7"}, 1.0), episode({"group_id": "task-7"}, 0.0)
        st = httpx.get(f"{server.url}/v1/status", timeout=10).json()
        assert (st["sessions_waiting_for_group"], st["groups_partial"]) == (2, 0)
        assert gw.take_ended() == []  # 2 of 3 sessions, no time has passed
        clock.t = 120.0
        got = gw.take_ended()
        assert [(e.session_id, e.trajectories[0].baseline) for e in got] == [(a, 0.0), (b, 1.0)]  # leave-one-out
        c = episode({}, 0.75)  # no group_id: handed over at its end, against the mean of a and b, 0.5
        (e,) = gw.take_ended()
        assert (e.session_id, e.trajectories[0].baseline, e.trajectories[0].group_id) == (c, 0.5, c)
        st = gw.status()
        assert (st.sessions_waiting_for_group, st.groups_partial, st.sessions_in_partial_groups) == (0, 2, 3)
        assert st.sessions_emitted == 3 and st.trajectories_emitted == 3
        # trained: advantages 1.0 - 0.0, 0.0 - 1.0 and 0.75 - 0.5
        adv = collate([x.trajectories[0] for x in [*got, e]], consuming_version=0).seq_advantages
        assert adv.tolist() == pytest.approx([1.0, -1.0, 0.25])
    finally:
        server.stop()
        backend.close()


def test_sessions_held_for_their_group_at_a_checkpoint_are_kept_and_released_at_once_on_resume():
    def gateway() -> Gateway:
        pool = ScriptedPool([])
        backend = WorkerBackend(pool.submit, pool.poll, lambda: 0)
        return Gateway(backend, chat_format(), 4096, admin_token=ADMIN, clock=FakeClock(), group_size=4)

    gw = gateway()
    gw.groups.add(ended("a", "g", 1.0, segments=2))  # g: 2 of 4 sessions ended, one split in 2 segments
    gw.groups.add(ended("b", "g", 0.0))
    gw.groups.add(ended("c", "h", 0.5))  # h: 1 of 4
    held = gw.held_sessions()
    saved = [t for e in held for t in e.trajectories]  # what the checkpoint writes
    assert [t.trajectory_id for t in saved] == ["a/0", "a/1", "b", "c"] and len(held) == 3
    # the buffer counted 5 sessions in flight at the checkpoint; the 3 held are kept, 2 were lost
    buf = TrajectoryBuffer(capacity=16, max_staleness=2)
    buf.load_state_dict({"submitted": 5, "consumed": 0, "dropped": {}}, [], pending=len(held))
    assert (buf.in_flight, buf.dropped["lost_at_restart"]) == (3, 2)
    resumed = gateway()
    assert resumed.restore_held(saved) == 3
    a, b, c = resumed.take_ended()  # released at once: their groups' other sessions never end
    assert [t.trajectory_id for t in a.trajectories] == ["a/0", "a/1"] and (a.group_id, a.reward) == ("g", 1.0)
    # g partial: leave-one-out baselines (a: b's 0.0, b: a's 1.0); h alone: the mean reward of the
    # sessions released before it, a and b: (1.0 + 0.0) / 2 = 0.5
    assert [t.baseline for t in a.trajectories] == [0.0, 0.0] and b.trajectories[0].baseline == 1.0
    assert c.trajectories[0].baseline == 0.5 and resumed.groups.groups_partial == 2
