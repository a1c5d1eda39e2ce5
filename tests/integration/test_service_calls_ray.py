"""Calls that wait out an actor's restart, against real Ray actors: an actor dead for good is given up
at once, and a call Ray holds queued for a restart that never finishes is bounded."""

from __future__ import annotations

import os
import time

import pytest

from oldlogit_service.calls import RestartWait, ServiceCalls, ServiceGone, ServiceNotBack, actor_state

pytestmark = pytest.mark.integration


def wait_for_state(handle, state: str, timeout_s: float = 30.0) -> None:
    """Wait until the GCS reports ``state`` for ``handle``'s actor (bounded)."""
    deadline = time.monotonic() + timeout_s
    while actor_state(handle) != state:
        assert time.monotonic() < deadline, f"actor never reached {state}: {actor_state(handle)}"
        time.sleep(0.1)


def test_an_actor_whose_restarts_are_used_up_is_given_up_without_waiting(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=0, max_restarts=0)
    class Service:
        def ping(self):
            return "pong"

    svc = Service.remote()
    calls = ServiceCalls(svc, RestartWait(600.0))
    assert calls.call("ping") == "pong" and actor_state(svc) == "ALIVE"
    ray.kill(svc)
    wait_for_state(svc, "DEAD")
    with pytest.raises(ServiceGone, match=r"^old-logit service: its actor is dead and Ray will not restart it"):
        calls.call("ping")
    assert (calls.wait.outages, calls.wait.retries) == (1, 0)  # no pause, no second try


def test_a_call_ray_holds_for_a_restart_that_never_finishes_is_bounded(ray_cluster, tmp_path):
    # the call is running when the process dies; Ray retries it on the restarted process
    # (max_task_retries), whose constructor never returns: the call would wait forever, no error raised
    ray = ray_cluster
    marker = tmp_path / "started-once"

    @ray.remote(num_cpus=0, max_restarts=1, max_task_retries=1)
    class Service:
        def __init__(self, marker):
            if os.path.exists(marker):
                time.sleep(3600)  # the restart never finishes
            open(marker, "w").close()

        def slow(self):
            time.sleep(2.0)
            return "done"

    svc = Service.remote(str(marker))
    ray.get(svc.__ray_ready__.remote())
    calls = ServiceCalls(svc, RestartWait(3.0, probe_s=0.5))
    pending = calls.submit("slow")
    time.sleep(0.5)
    ray.kill(svc, no_restart=False)
    try:
        with pytest.raises(
            ServiceNotBack, match=r"^old-logit service: not back within oldlogit.restart_timeout_s = 3 s"
        ):
            pending.result()
        assert actor_state(svc) == "RESTARTING" and calls.wait.outages == 1
    finally:
        ray.kill(svc)
