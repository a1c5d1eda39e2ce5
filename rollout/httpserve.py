"""uvicorn in a daemon thread on a socket bound here: the HTTP servers of a job (status API, gateway).

``port=0`` binds a free port (see :attr:`ThreadedServer.port`); the socket is bound before the
thread starts, so the URL is known at once and two servers never race for one port.
:class:`BodyLimit` bounds request bodies in size and in time for both servers;
:func:`bearer_token` and :func:`token_matches` read and check ``Authorization: Bearer <token>``
for both.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn


def is_loopback_host(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8, ``::1`` and IPv4-mapped loopback (``::ffff:127.x.y.z``);
    False for any other address or name."""
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


BEARER = "Bearer "
"""Scheme prefix of an ``Authorization`` header holding a bearer token (RFC 6750, section 2.1)."""


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value.

    Returns None when the header is missing or uses another scheme, and ``""`` for ``"Bearer "``
    followed by nothing (the scheme is matched case-sensitively, as both servers always did).
    """
    if authorization is None or not authorization.startswith(BEARER):
        return None
    return authorization[len(BEARER) :]


def token_matches(given: str | None, expected: str) -> bool:
    """True when ``given`` is non-empty and equals ``expected``, compared in constant time (:func:`hmac.compare_digest`)."""
    return bool(given) and hmac.compare_digest(given.encode(), expected.encode())


class ThreadedServer:
    """Serve the ASGI ``app`` on ``host:port`` from a daemon thread named ``name``.

    ``uvicorn_options`` go to ``uvicorn.Config`` (limits, timeouts); access logs are off.
    """

    def __init__(self, app: Any, host: str, port: int, name: str, **uvicorn_options: Any):
        self.host, self.name = host, name
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.port = sock.getsockname()[1]
        self._sock = sock
        config = uvicorn.Config(app, log_level="warning", access_log=False, **uvicorn_options)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True, name=name)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> ThreadedServer:
        """Start serving.

        Raises:
            RuntimeError: uvicorn is not up within ``timeout_s`` seconds.
        """
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"{self.name}: HTTP server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Ask uvicorn to exit, wait up to 5 s for its thread, close the socket."""
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()


class BodyLimit:
    """ASGI middleware bounding every request body in size and in the time its sender may take.

    A declared ``Content-Length`` above ``max_bytes`` is answered 413 without passing anything on.
    Any other body is read here first, counted as it arrives and refused at ``max_bytes`` (413), or
    408 when its next chunk does not arrive within ``read_timeout_s`` seconds; the application then
    receives the whole body at once. Header sizes are bounded by the server (uvicorn's
    ``h11_max_incomplete_event_size``).

    Before a 413 the rest of the body is read and thrown away, up to ``drain_bytes`` in all (each
    chunk within ``read_timeout_s``): a client that sends its whole body before it reads the answer
    (most HTTP clients) then finishes sending and reads the 413; were the connection closed with the
    body unread, the kernel would reset it and the client would get no answer at all. A body
    declared longer than ``drain_bytes`` is refused at once.

    ``error_body(status, message) -> dict`` is the JSON of a refusal, called once per refusal; the
    default is FastAPI's ``{"detail": message}`` (the gateway answers in the OpenAI error shape).
    """

    def __init__(
        self,
        app: Callable,
        max_bytes: int,
        read_timeout_s: float,
        error_body: Callable[[int, str], dict] | None = None,
        drain_bytes: int = 64 << 20,
    ):
        self.app, self.max_bytes, self.read_timeout_s = app, max_bytes, read_timeout_s
        self.drain_bytes = drain_bytes
        self.error_body = error_body or (lambda status, message: {"detail": message})

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            if declared.isdigit() and int(declared) <= self.drain_bytes:
                await self._drain(receive, 0)
            await self._refuse(
                send, 413, f"request body: Content-Length {declared.decode()[:20]} > limit {self.max_bytes} bytes"
            )
            return
        body, more = bytearray(), True
        while more:
            try:
                msg = await asyncio.wait_for(receive(), self.read_timeout_s)
            except TimeoutError:
                await self._refuse(send, 408, f"request body: nothing received for {self.read_timeout_s} s")
                return
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > self.max_bytes:
                if more:
                    await self._drain(receive, len(body))
                await self._refuse(send, 413, f"request body: more than {self.max_bytes} bytes")
                return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # the app waits for a disconnect after the body
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _drain(self, receive: Callable, seen: int) -> None:
        """Read and drop the rest of a refused body (``seen`` bytes of it read already) until its
        end, a disconnect, a chunk later than ``read_timeout_s`` or ``drain_bytes`` in all."""
        while seen <= self.drain_bytes:
            try:
                msg = await asyncio.wait_for(receive(), self.read_timeout_s)
            except TimeoutError:
                return
            if msg["type"] == "http.disconnect":
                return
            seen += len(msg.get("body", b""))
            if not msg.get("more_body", False):
                return

    async def _refuse(self, send: Callable, status: int, message: str) -> None:
        body = json.dumps(self.error_body(status, message)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
            }
        )
        await send({"type": "http.response.body", "body": body})
