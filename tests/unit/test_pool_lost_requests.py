"""Which requests a rollout worker takes with it when it is lost: the pool's per-worker ledger of
request ids (samples taken, trajectories not polled yet), by hand, on a pool whose worker table is
filled in directly (no Ray: the remote calls around this ledger are not under test)."""

from __future__ import annotations

from types import SimpleNamespace

from rollout.engine import EngineConfig
from rollout.worker import request_of, sample_id
from trainer.driver.workers.pool import WORKER_DIED, WorkerPool


def traj(tid: str) -> SimpleNamespace:
    """A delivered trajectory as the ledger reads it: its id only."""
    return SimpleNamespace(trajectory_id=tid)


def test_request_of_a_trajectory_id():
    held = {"call-7": 1, "env-3": 4}
    assert request_of("call-7", held) == "call-7"  # n = 1: the request's own id
    assert request_of("env-3/2", held) == "env-3"  # sample 2 of an n = 4 request
    assert request_of("sess/a/1", {"sess/a": 2}) == "sess/a"  # only the last "/" splits
    assert [sample_id("env-3", i, 4) for i in (0, 2)] == ["env-3/0", "env-3/2"]
    assert sample_id("call-7", 0, 1) == "call-7"


def test_a_lost_worker_hands_out_the_requests_it_still_held_once():
    pool = WorkerPool(EngineConfig(kind="transformers", model_path="unused"))
    for wid in ("rollout-0", "rollout-1"):
        pool.workers[wid], pool.in_flight[wid] = object(), 0
    with pool._lock:
        pool._hold("rollout-0", "a", 1)
        pool._hold("rollout-0", "b", 2)
        pool._hold("rollout-1", "c", 1)
        pool._hold("rollout-9", "z", 1)  # not a live worker: nothing held
        pool.held.release("rollout-0", [traj("a"), traj("b/0")])  # a done, one of b's two samples done
    assert pool.held.by_worker == {"rollout-0": {"b": 1}, "rollout-1": {"c": 1}}
    pool.in_flight["rollout-0"] = 1
    pool._bury("rollout-0")
    assert pool.take_deaths() == {"rollout-0": (1, WORKER_DIED)}
    assert pool.take_lost_requests() == ["b"]
    assert pool.take_lost_requests() == []  # each id once
    with pool._lock:
        pool.held.release("rollout-1", [traj("c")])
    pool._bury("rollout-1")
    assert pool.take_lost_requests() == []  # it had delivered everything it took
    assert pool.held.by_worker == {}
