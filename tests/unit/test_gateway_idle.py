"""What the chaos soak found in the gateway: sessions whose agent is gone are ended as ``idle``
after ``gateway.session_idle_s``, freeing their places under the staleness admission rule
(rollout.gateway.sessions, AgentRunner.poll); a session's trajectory carries the served
fingerprint of its policy version, as an env-loop trajectory does."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rollout.gateway import Gateway, WorkerBackend
from rollout.gateway.errors import ApiError
from rollout.gateway.sessions import IDLE, SessionTable
from tests.scripted_gateway import FakeClock, ScriptedPool, chat_format
from trainer.driver.config.schema import GatewayConfig, load_config
from trainer.driver.sources.agent_runner import AgentRunner
from trainer.driver.sources.buffer import TrajectoryBuffer

ADMIN = "a" * 32


def test_an_idle_session_is_ended_as_idle_and_a_busy_or_active_one_is_not():
    clock = FakeClock()
    t = SessionTable(lambda: 0, ADMIN, clock=clock, idle_s=30.0)
    a, b = t.open_session("g"), t.open_session("g")
    clock.t = 10.0
    t.call_session(a.key, a.session_id)  # a request of a at t = 10
    clock.t = 35.0
    assert t.idle_sessions() == [b.session_id]  # b idle since 0; a since 10 (25 s < 30)
    (e,) = t.take_ended()
    assert (e.session_id, e.dropped, e.trajectories) == (b.session_id, IDLE, [])
    st = t.session_counts()
    assert (st["sessions_open"], st["sessions_ended"], st["sessions_dropped"]) == (1, 1, {"idle": 1})
    with pytest.raises(ApiError, match="ended") as err:
        t.call_session(b.key, b.session_id)  # its agent comes back too late
    assert err.value.status == 409
    clock.t = 100.0

    async def while_a_call_runs() -> list[str]:
        async with t.call_lock(a):
            return t.idle_sessions()

    assert asyncio.run(while_a_call_runs()) == []  # a call in progress is not idleness
    assert t.idle_sessions() == [a.session_id]


def test_without_idle_s_sessions_stay_open_and_a_bad_value_is_refused_naming_the_setting():
    clock = FakeClock()
    t = SessionTable(lambda: 0, ADMIN, clock=clock)
    t.open_session("g")
    clock.t = 1e9
    assert t.idle_sessions() == [] and t.take_ended() == []
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="gateway.session_idle_s: expected a positive number of seconds"):
            SessionTable(lambda: 0, ADMIN, idle_s=bad)
    assert GatewayConfig().session_idle_s == 600.0
    with pytest.raises(ValueError, match="session_idle_s"):
        GatewayConfig(session_idle_s=0)


def runner_over(gateway: Gateway, cfg, buffer: TrajectoryBuffer) -> AgentRunner:
    """An AgentRunner holding ``gateway`` (its admission and poll, the real methods), no server."""
    r = AgentRunner.__new__(AgentRunner)
    r.cfg, r.buffer, r.version, r._lock = cfg, buffer, lambda: 0, threading.Lock()
    r.admission_version = r.version
    r.admitted, r._undrained, r.gateway, r.backend = buffer.submitted, 0, gateway, gateway.backend
    r.group_size, r.batch_size = cfg.rollout.sampling.n, cfg.controller.batch_groups * cfg.rollout.sampling.n
    gateway.admission = r.admit
    return r


@pytest.mark.parametrize("idle_s", [None, 30.0])
def test_sessions_of_a_dead_agent_hold_admission_until_they_are_ended_idle(idle_s):
    """max_staleness 0, groups of 2, one group per batch: at version 0 two sessions are admitted.
    Their agent dies before any call. Without ``idle_s`` no session is ever admitted again (the
    job would wait for ever); with it both are dropped ``idle`` at the next poll after 30 s, the
    buffer counts them, and new sessions are admitted."""
    cfg = load_config(None, ["controller.max_staleness=0", "controller.batch_groups=1", "rollout.sampling.n=2"])
    clock, pool = FakeClock(), ScriptedPool([])
    backend = WorkerBackend(pool.submit, pool.poll, lambda: 0)
    gw = Gateway(backend, chat_format(), 4096, admin_token=ADMIN, clock=clock, group_size=2, session_idle_s=idle_s)
    buffer = TrajectoryBuffer(capacity=16, max_staleness=0)
    runner = runner_over(gw, cfg, buffer)
    try:
        gw.open_session("task-0")
        gw.open_session("task-0")
        with pytest.raises(ApiError) as err:
            gw.open_session("task-1")
        assert err.value.status == 429
        clock.t = 31.0
        assert runner.poll() == []
        if idle_s is None:
            with pytest.raises(ApiError):
                gw.open_session("task-1")
            assert buffer.dropped == {} and buffer.in_flight == 2
            return
        assert dict(buffer.dropped) == {"idle": 2} and buffer.in_flight == 0 and buffer.accounting_ok()
        assert gw.open_session("task-1").state == "open" and gw.status().sessions_dropped == {"idle": 2}
    finally:
        backend.close()


def test_a_gateway_trajectory_carries_the_served_fingerprint_of_its_policy_version():
    """The fingerprint a worker read back at the version it sampled at goes with each call and, for
    the segment, with the call that reached the segment's newest version; a version reached only by
    a token (no worker report) leaves it unknown."""
    from rollout.gateway.session import Completion, Session

    s = Session(session_id="s-1", key="k", group_id="g")
    s.stitch("c0", [1, 2], Completion([3], [-0.5], [1], "stop", 1, None, "00000000000000f1"))
    s.stitch("c1", [1, 2, 3, 4], Completion([5], [-0.5], [2], "stop", 2, None, "00000000000000f2"))
    (t,) = s.to_trajectories()
    assert (t.policy_version, t.served_fingerprint) == (2, "00000000000000f2")
    s.stitch("c2", [1, 2, 3, 4, 5, 6], Completion([7], [-0.5], [3], "stop", 2, None, "00000000000000f2"))
    (t,) = s.to_trajectories()
    assert (t.policy_version, t.served_fingerprint) == (3, None)


def test_the_http_path_stamps_each_session_trajectory_with_the_workers_fingerprint():
    from rollout.gateway import GatewayServer
    from tests.scripted_gateway import reply

    pool = ScriptedPool([reply("A"), reply("B")])
    backend = WorkerBackend(pool.submit, pool.poll, lambda: 0)
    gw = Gateway(backend, chat_format(), 4096, admin_token=ADMIN)
    server = GatewayServer(gw).start()
    try:
        import httpx

        admin = {"Authorization": f"Bearer {ADMIN}"}
        s = httpx.post(f"{server.url}/v1/sessions", json={}, headers=admin, timeout=10).json()
        h = {"Authorization": f"Bearer {s['key']}"}
        body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
        assert httpx.post(f"{s['base_url']}/chat/completions", json=body, headers=h, timeout=30).status_code == 200
        httpx.post(f"{server.url}/v1/sessions/{s['id']}/end", json={"reward": 1.0}, headers=h, timeout=10)
        (e,) = gw.take_ended()
        assert e.trajectories[0].served_fingerprint == "0000000000000000"  # version 0's, as the worker read it
    finally:
        server.stop()
        backend.close()
