"""The FastAPI status and control app, served by uvicorn on 127.0.0.1 by default.

Read-only endpoints answer from a :class:`StatusBoard` the driver updates after each event; they never
touch actors, so a busy learner never blocks ``/v1/status``. Mutating endpoints (scale, pause, resume)
require ``Authorization: Bearer <token>`` and only record the request; the driver loop applies it.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import threading
import time
from typing import Annotated

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from protocol import JobStatus, ScaleRequest, ScaleResponse, WorkerStatus


class StatusBoard:
    """Thread-safe holder of the job's latest :class:`JobStatus` and of pending control requests."""

    def __init__(self, initial: JobStatus | None = None):
        self._lock = threading.Lock()
        self._status = initial or JobStatus(learner_version=0, state="starting")
        self.desired_workers: int | None = None
        self.paused = False
        self.registry = CollectorRegistry()
        r = self.registry
        self._g = {
            "learner_version": Gauge("vintage_learner_version", "Current learner policy version", registry=r),
            "buffer_size": Gauge("vintage_buffer_size", "Trajectories waiting in the buffer", registry=r),
            "in_flight": Gauge("vintage_in_flight", "Trajectories being generated", registry=r),
            "tokens_per_s": Gauge("vintage_tokens_per_s", "Trained tokens per second", registry=r),
            "proxy_fraction": Gauge(
                "vintage_proxy_fraction", "Fraction of tokens whose reference was a proxy", registry=r
            ),
            "mask_kept_fraction": Gauge(
                "vintage_mask_kept_fraction", "Discrepancy-mask kept fraction of the last batch", registry=r
            ),
            "workers": Gauge("vintage_rollout_workers", "Rollout workers", registry=r),
            "last_publish_s": Gauge(
                "vintage_last_publish_seconds", "Seconds of the last weight publication", registry=r
            ),
            "ewma_resets": Gauge("vintage_ewma_resets", "EWMA resets so far", registry=r),
            "skipped_steps": Gauge("vintage_skipped_steps", "Non-finite steps skipped", registry=r),
            "generated": Gauge("vintage_trajectories_generated", "Trajectories submitted to workers", registry=r),
            "consumed": Gauge("vintage_trajectories_consumed", "Trajectories trained on", registry=r),
        }
        self._dropped = Gauge("vintage_trajectories_dropped", "Trajectories dropped, by reason", ["reason"], registry=r)
        self._exact = Gauge(
            "vintage_exact_token_fraction",
            "Share of the last batch's trained tokens with exact old logits, by old-logit route",
            ["oldlogit_route"],
            registry=r,
        )
        self.requests = Counter("vintage_http_requests", "HTTP requests served", ["endpoint"], registry=r)

    def update(self, **fields) -> JobStatus:
        """Replace some fields of the status (validated) and refresh the Prometheus gauges."""
        with self._lock:
            self._status = self._status.model_copy(update=fields)
            self._status = JobStatus.model_validate(self._status.model_dump())
            s = self._status
        for name, g in self._g.items():
            if name == "workers":
                g.set(len(s.workers))
            elif name == "ewma_resets":
                g.set(s.ewma.resets if s.ewma else 0)
            else:
                v = getattr(s, name)
                if v is not None:
                    g.set(v)
        for reason, n in s.dropped.items():
            self._dropped.labels(reason).set(n)
        if s.exact_token_fraction is not None:
            self._exact.labels(s.oldlogit_route).set(s.exact_token_fraction)
        return s

    def status(self) -> JobStatus:
        with self._lock:
            return self._status


def build_app(board: StatusBoard, token: str) -> FastAPI:
    """The HTTP API over ``board``; ``token`` guards the mutating endpoints."""
    app = FastAPI(title="vintage", version="1", summary="Async RL trainer: versions, staleness, old logits")

    def require_token(authorization: Annotated[str | None, Header()] = None) -> None:
        if authorization is None or not authorization.startswith("Bearer "):
            raise HTTPException(status_code=401, detail="missing bearer token", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(authorization.removeprefix("Bearer ").encode(), token.encode()):
            raise HTTPException(status_code=403, detail="invalid bearer token")

    @app.get("/healthz")
    def healthz() -> dict:
        board.requests.labels("healthz").inc()
        return {"ok": True, "state": board.status().state}

    @app.get("/v1/status", response_model=JobStatus)
    def status() -> JobStatus:
        board.requests.labels("status").inc()
        return board.status()

    @app.get("/v1/workers", response_model=list[WorkerStatus])
    def workers() -> list[WorkerStatus]:
        board.requests.labels("workers").inc()
        return board.status().workers

    @app.post("/v1/workers", response_model=ScaleResponse, status_code=202, dependencies=[Depends(require_token)])
    def scale(req: ScaleRequest) -> ScaleResponse:
        board.requests.labels("scale").inc()
        board.desired_workers = req.num_workers
        return ScaleResponse(num_workers=req.num_workers)

    @app.post("/v1/pause", dependencies=[Depends(require_token)])
    def pause() -> dict:
        board.paused = True
        return {"paused": True}

    @app.post("/v1/resume", dependencies=[Depends(require_token)])
    def resume() -> dict:
        board.paused = False
        return {"paused": False}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(board.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class ApiServer:
    """uvicorn in a daemon thread; ``port=0`` binds a free port (see :attr:`port`)."""

    def __init__(self, board: StatusBoard, host: str = "127.0.0.1", port: int = 0, token: str | None = None):
        self.token = token or secrets.token_urlsafe(24)
        self.host = host
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.port = sock.getsockname()[1]
        self._sock = sock
        config = uvicorn.Config(build_app(board, self.token), log_level="warning", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True, name="vintage-http"
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> ApiServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"HTTP server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()
