"""The gateway's OpenAI endpoints are declared once and served at ``/v1`` and ``/sessions/{sid}/v1``."""

from __future__ import annotations

from fastapi.testclient import TestClient

from rollout.gateway.router import gateway_app


class RecordingGateway:
    """Stands in for :class:`rollout.gateway.app.Gateway` in a test of the routing alone: records
    which session each call named."""

    model_name = "m"
    token_for_reads = False
    base_url = "http://127.0.0.1"

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None]] = []

    async def chat_completions(self, body, key, sid=None, gone=None):
        self.calls.append(("chat", sid))
        return {"ok": "chat"}

    async def completions(self, body, key, sid=None, gone=None):
        self.calls.append(("text", sid))
        return {"ok": "text"}

    def count_error(self, e) -> None:
        pass


def test_each_openai_endpoint_has_one_handler_mounted_at_both_prefixes():
    app = gateway_app(RecordingGateway())
    by_handler: dict[object, list[str]] = {}
    for r in app.routes:
        if getattr(r, "path", "").endswith(("/chat/completions", "/completions", "/models")):
            by_handler.setdefault(r.endpoint, []).append(r.path)
    assert sorted(sorted(p) for p in by_handler.values()) == [
        ["/sessions/{sid}/v1/chat/completions", "/v1/chat/completions"],
        ["/sessions/{sid}/v1/completions", "/v1/completions"],
        ["/sessions/{sid}/v1/models", "/v1/models"],
    ]


def test_the_session_comes_from_the_path_only():
    gw = RecordingGateway()
    client = TestClient(gateway_app(gw))
    h = {"Authorization": "Bearer k"}
    assert client.post("/v1/chat/completions", json={}, headers=h).json() == {"ok": "chat"}
    assert client.post("/sessions/s1/v1/chat/completions", json={}, headers=h).status_code == 200
    assert client.post("/v1/completions?sid=s2", json={}, headers=h).status_code == 200  # a query is no session
    assert client.post("/sessions/s3/v1/completions", json={}, headers=h).status_code == 200
    assert gw.calls == [("chat", None), ("chat", "s1"), ("text", None), ("text", "s3")]
    for path in ("/v1/models", "/sessions/s1/v1/models"):
        assert client.get(path).json()["data"][0]["id"] == "m"
