"""The HTTP API served by a real uvicorn on 127.0.0.1 (status, bearer token)."""

import httpx
import pydantic
import pytest

from protocol import GatewayStatus, JobStatus, WorkerStatus
from trainer.driver.cluster.server import ApiServer, StatusBoard

TOKEN = "s3cret-0123456789abcdef"


@pytest.fixture()
def server():
    board = StatusBoard()
    srv = ApiServer(board, host="127.0.0.1", port=0, token=TOKEN).start()
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


def test_gateway_counters_reach_prometheus(server):
    board, srv = server
    gw = GatewayStatus(
        tool_calls_parsed=5, unparsed_tool_calls=2, tool_call_errors=1, calls_pending=3, unavailable={"not_taken": 4}
    )
    board.update(gateway=gw)
    text = httpx.get(f"{srv.url}/metrics").text
    for line in (
        'vintage_gateway_tool_calls{result="parsed"} 5.0',
        'vintage_gateway_tool_calls{result="unparsed"} 2.0',
        "vintage_gateway_tool_call_errors 1.0",
        "vintage_gateway_calls_pending 3.0",
        'vintage_gateway_unavailable{reason="not_taken"} 4.0',
    ):
        assert line in text, line
    assert JobStatus.model_validate(httpx.get(f"{srv.url}/v1/status").json()).gateway == gw


def test_mutating_endpoints_need_the_token(server):
    board, srv = server
    assert httpx.post(f"{srv.url}/v1/workers", json={"num_workers": 3}).status_code == 401
    bad = httpx.post(f"{srv.url}/v1/workers", json={"num_workers": 3}, headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 403 and board.desired_workers is None
    ok = httpx.post(f"{srv.url}/v1/workers", json={"num_workers": 3}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 202 and board.desired_workers == 3
    assert httpx.post(f"{srv.url}/v1/pause").status_code == 401
    assert httpx.post(f"{srv.url}/v1/pause", headers={"Authorization": f"Bearer {TOKEN}"}).json() == {"paused": True}
    assert board.paused


def test_the_status_says_paused_while_the_loop_holds_and_running_once_resumed(server):
    from trainer.driver.loop.job import held_by_pause

    board, srv = server
    auth = {"Authorization": f"Bearer {TOKEN}"}
    board.update(state="running")
    assert held_by_pause(board) is False and board.status().state == "running"
    httpx.post(f"{srv.url}/v1/pause", headers=auth)
    assert httpx.get(f"{srv.url}/v1/status").json()["state"] == "running"  # until the loop holds
    assert held_by_pause(board) is True
    assert httpx.get(f"{srv.url}/v1/status").json()["state"] == "paused"
    httpx.post(f"{srv.url}/v1/resume", headers=auth)
    assert held_by_pause(board) is False
    assert httpx.get(f"{srv.url}/v1/status").json()["state"] == "running"
    board.update(state="starting")
    board.paused = True
    assert held_by_pause(board) is True and board.status().state == "starting"  # only a running loop holds


def test_scale_request_validation_names_field(server):
    _, srv = server
    r = httpx.post(f"{srv.url}/v1/workers", json={"num_workers": -1}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 422 and "num_workers" in r.text
    for lax in ("3", True, 4.0):  # strict on the wire: no coercion to an integer
        r = httpx.post(f"{srv.url}/v1/workers", json={"num_workers": lax}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 422 and "num_workers" in r.text and "valid integer" in r.text, lax


def test_docs_are_off_by_default(server):
    _, srv = server
    assert [httpx.get(f"{srv.url}{p}").status_code for p in ("/docs", "/redoc", "/openapi.json")] == [404] * 3


def test_body_size_is_bounded_before_reading(server):
    _, srv = server
    auth = {"Authorization": f"Bearer {TOKEN}"}
    big = httpx.post(f"{srv.url}/v1/workers", content=b"x" * (2 << 20), headers=auth)
    assert big.status_code == 413 and "Content-Length 2097152 > limit 1048576" in big.json()["detail"]

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(40):
            yield b"y" * 65536

    chunked = httpx.post(f"{srv.url}/v1/workers", content=chunks(), headers=auth)
    assert chunked.status_code == 413 and "more than 1048576 bytes" in chunked.json()["detail"]
    # the server still answers normally afterwards
    assert httpx.get(f"{srv.url}/healthz").status_code == 200


def test_short_token_refused_and_non_loopback_requires_token_for_reads():
    with pytest.raises(ValueError, match="server.token: 6 characters, at least 16"):
        ApiServer(StatusBoard(), token="s3cret")
    srv = ApiServer(StatusBoard(), host="0.0.0.0", port=0, token=TOKEN).start()
    try:
        assert srv.token_for_reads
        url = f"http://127.0.0.1:{srv.port}"
        assert httpx.get(f"{url}/v1/status").status_code == 401
        assert httpx.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    finally:
        srv.stop()


def test_status_update_validates_before_storing():
    board = StatusBoard()
    board.update(learner_version=3, mask_kept_fraction=0.5)
    for bad in ({"mask_kept_fraction": float("nan")}, {"mask_kept_fraction": 7.0}, {"dropped": {"stale": -1}}):
        with pytest.raises(pydantic.ValidationError):
            board.update(learner_version=4, **bad)
        s = board.status()
        assert (s.learner_version, s.mask_kept_fraction, s.dropped) == (3, 0.5, {})
    assert board.update(learner_version=4).learner_version == 4  # later updates still work


def test_slow_body_times_out_with_408():
    import socket

    srv = ApiServer(StatusBoard(), port=0, token=TOKEN, read_timeout_s=0.5).start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as c:
            c.sendall(
                b"POST /v1/workers HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{"
            )  # 1 of 100 promised bytes, then silence
            reply = c.recv(4096).decode()
        assert reply.startswith("HTTP/1.1 408") and "nothing received for 0.5 s" in reply
    finally:
        srv.stop()


def test_scale_request_race_keeps_the_latest_and_reports_pending(server):
    board, srv = server
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.post(f"{srv.url}/v1/workers", json={"num_workers": 3}, headers=auth)
    assert r.status_code == 202 and r.json()["state"] == "pending"
    assert httpx.get(f"{srv.url}/v1/status").json()["scale_pending"] == 3
    assert board.take_scale_request() == 3  # the driver starts a slow scale to 3 ...
    httpx.post(f"{srv.url}/v1/workers", json={"num_workers": 2}, headers=auth)  # ... a request arrives meanwhile
    assert httpx.get(f"{srv.url}/v1/status").json()["scale_pending"] == 2
    assert board.take_scale_request() == 2 and board.take_scale_request() is None  # applied next, not erased
    assert httpx.get(f"{srv.url}/v1/status").json()["scale_pending"] is None


def test_scale_beyond_the_jobs_maximum_refused(server):
    board, srv = server
    r = httpx.post(f"{srv.url}/v1/workers", json={"num_workers": 200}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 422 and r.json()["detail"] == "num_workers: 200 > the job's maximum 64"
    assert board.take_scale_request() is None
