"""Sessions whose agent is gone: ended as ``idle`` after ``gateway.session_idle_s``, which frees
their places under the staleness admission rule (rollout.gateway.sessions, AgentRunner.poll)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rollout.gateway import Gateway, WorkerBackend
from rollout.gateway.errors import ApiError
from rollout.gateway.sessions import IDLE, SessionTable
from tests.scripted_gateway import FakeClock, ScriptedPool, chat_format
from trainer.driver.agent_runner import AgentRunner
from trainer.driver.buffer import TrajectoryBuffer
from trainer.driver.config import GatewayConfig, load_config

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
