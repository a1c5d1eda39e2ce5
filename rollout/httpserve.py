"""uvicorn in a daemon thread on a socket bound here: the HTTP servers of a job (status API, gateway).

``port=0`` binds a free port (see :attr:`ThreadedServer.port`); the socket is bound before the
thread starts, so the URL is known at once and two servers never race for one port.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
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
