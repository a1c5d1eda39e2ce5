"""The HTTP API served by a real uvicorn on 127.0.0.1 (status, bearer token)."""

import httpx
import pytest

from protocol import JobStatus, WorkerStatus
from trainer.server import ApiServer, StatusBoard


@pytest.fixture()
def server():
    board = StatusBoard()
    srv = ApiServer(board, host="127.0.0.1", port=0, token="s3cret").start()
    yield board, srv
    srv.stop()


def test_status_reports_version_histogram_and_counters(server):
    board, srv = server
    board.update(
        learner_version=7,
        state="running",
        buffer_staleness_hist={0: 3, 2: 1},
        dropped={"stale": 2, "buffer_full": 1},
        workers=[WorkerStatus(worker_id="w0", policy_version=6, in_flight=4)],
        oldlogit_route="snapshot",
        exact_token_fraction=0.6,
    )
    s = JobStatus.model_validate(httpx.get(f"{srv.url}/v1/status").json())
    assert s.learner_version == 7 and s.buffer_staleness_hist == {0: 3, 2: 1}
    assert s.dropped == {"stale": 2, "buffer_full": 1} and (s.oldlogit_route, s.exact_token_fraction) == (
        "snapshot",
        0.6,
    )
    assert [w["worker_id"] for w in httpx.get(f"{srv.url}/v1/workers").json()] == ["w0"]
    assert httpx.get(f"{srv.url}/healthz").json()["ok"] is True
    text = httpx.get(f"{srv.url}/metrics").text
    assert "vintage_learner_version 7.0" in text
    assert 'vintage_trajectories_dropped{reason="stale"} 2.0' in text
    assert 'vintage_exact_token_fraction{oldlogit_route="snapshot"} 0.6' in text


def test_mutating_endpoints_need_the_token(server):
    board, srv = server
    assert httpx.post(f"{srv.url}/v1/workers", json={"num_workers": 3}).status_code == 401
    bad = httpx.post(f"{srv.url}/v1/workers", json={"num_workers": 3}, headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 403 and board.desired_workers is None
    ok = httpx.post(f"{srv.url}/v1/workers", json={"num_workers": 3}, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 202 and board.desired_workers == 3
    assert httpx.post(f"{srv.url}/v1/pause").status_code == 401
    assert httpx.post(f"{srv.url}/v1/pause", headers={"Authorization": "Bearer s3cret"}).json() == {"paused": True}
    assert board.paused


def test_scale_request_validation_names_field(server):
    _, srv = server
    r = httpx.post(f"{srv.url}/v1/workers", json={"num_workers": -1}, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 422 and "num_workers" in r.text
