"""A scripted OpenAI-compatible chat server on 127.0.0.1, for tests that need no model.

``POST /v1/chat/completions`` answers from a per-model script: each request for model ``m`` takes
the next entry of ``scripts[m]``, either ``{"content": str}`` or ``{"tool_calls": [(name, args)]}``.
Every request body is kept in :attr:`ScriptedServer.requests`. A model with no entry left, or an
unknown model, gets HTTP 500 (so a test that runs past its script fails loudly).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


class ScriptedServer:
    """uvicorn in a daemon thread serving scripted chat completions (see the module docstring)."""

    def __init__(self, scripts: dict[str, list[dict[str, Any]]]):
        self.scripts = {k: list(v) for k, v in scripts.items()}
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            with self._lock:
                self.requests.append(body)
                script = self.scripts.get(body.get("model"), [])
                entry = script.pop(0) if script else None
            if entry is None:
                return JSONResponse({"error": {"message": f"no script left for {body.get('model')!r}"}}, 500)
            return self._completion(body, entry, len(self.requests))

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._sock = sock
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @staticmethod
    def _completion(body: dict[str, Any], entry: dict[str, Any], n: int) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": entry.get("content")}
        finish = "stop"
        if entry.get("tool_calls"):
            message["tool_calls"] = [
                {"id": f"call_{n}_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
                for i, (name, args) in enumerate(entry["tool_calls"])
            ]
            finish = "tool_calls"
        return {
            "id": f"chatcmpl-{n}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model"),
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    def start(self) -> ScriptedServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("scripted server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()

    def __enter__(self) -> ScriptedServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
