"""The FastAPI status and control app, served by uvicorn on 127.0.0.1 by default.

Read-only endpoints answer from a :class:`StatusBoard` the driver updates after each event; they never
touch actors, so a busy learner never blocks ``/v1/status``. Mutating endpoints (scale, pause, resume)
require ``Authorization: Bearer <token>`` and only record the request; the driver loop applies it.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, FastAPI, Header, HTTPException, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from protocol import GatewayStatus, JobStatus, ScaleRequest, ScaleResponse, WorkerStatus
from rollout.httpserve import BodyLimit, ThreadedServer, bearer_token, is_loopback_host, token_matches

JOB_GAUGES: dict[str, tuple[str, str]] = {
    "learner_version": ("vintage_learner_version", "Current learner policy version"),
    "buffer_size": ("vintage_buffer_size", "Trajectories waiting in the buffer"),
    "in_flight": ("vintage_in_flight", "Trajectories being generated"),
    "tokens_per_s": ("vintage_tokens_per_s", "Trained tokens per second"),
    "proxy_fraction": ("vintage_proxy_fraction", "Fraction of tokens whose reference was a proxy"),
    "mask_kept_fraction": ("vintage_mask_kept_fraction", "Discrepancy-mask kept fraction of the last batch"),
    "workers": ("vintage_rollout_workers", "Rollout workers"),
    "last_publish_s": ("vintage_last_publish_seconds", "Seconds of the last weight publication"),
    "ewma_resets": ("vintage_ewma_resets", "EWMA resets so far"),
    "skipped_steps": ("vintage_skipped_steps", "Non-finite steps skipped"),
    "fingerprint_mismatch": ("vintage_fingerprint_mismatch", "Consumers found serving other weights than published"),
    "fingerprint_unverified": (
        "vintage_fingerprint_unverified",
        "Consumer reports whose served fingerprint could not be judged after a publication",
    ),
    "eval_resubmitted": (
        "vintage_eval_resubmitted",
        "Held-out evaluation requests submitted again because their rollout worker was lost",
    ),
    "held_out": ("vintage_held_out_reward", "Mean reward of the latest held-out evaluation"),
    "held_out_version": ("vintage_held_out_version", "Policy version of the latest held-out evaluation"),
    "best_version": ("vintage_best_version", "Policy version of the best pinned held-out evaluation (kept)"),
    "best_held_out": ("vintage_best_held_out_reward", "Mean reward of the best pinned held-out evaluation"),
    "generated": ("vintage_trajectories_generated", "Trajectories submitted to workers"),
    "consumed": ("vintage_trajectories_consumed", "Trajectories trained on"),
    "filtered_groups": ("vintage_filtered_groups", "Groups of equal rewards dropped by dynamic sampling"),
    "zero_variance_admitted": (
        "vintage_zero_variance_admitted",
        "Groups of equal rewards trained on because the per-step filter bound was reached",
    ),
}
"""The job's Prometheus gauges: status field -> (metric name, help)."""

GATEWAY_GAUGES: dict[str, tuple[str, str]] = {
    "tool_call_errors": ("vintage_gateway_tool_call_errors", "Gateway replies answered with a tool-call error note"),
    "calls_pending": ("vintage_gateway_calls_pending", "Gateway calls waiting for a worker"),
    "sessions_waiting_for_group": (
        "vintage_gateway_sessions_waiting_for_group",
        "Ended gateway sessions held until their GRPO group fills or waits gateway.group_wait_s",
    ),
    "groups_partial": (
        "vintage_gateway_groups_partial",
        "Gateway groups trained short of rollout.sampling.n sessions, with a baseline",
    ),
}
"""The gateway's Prometheus gauges: :class:`GatewayStatus` field -> (metric name, help)."""


class StatusBoard:
    """Thread-safe holder of the job's latest :class:`JobStatus` and of pending control requests.

    The gateway's figures can be live (:meth:`follow_gateway`): the gateway counts on its own
    thread, so every status read takes them fresh, also while the loop is busy in an evaluation.
    """

    def __init__(self, initial: JobStatus | None = None):
        self._lock = threading.Lock()
        self._status = initial or JobStatus(learner_version=0, state="starting")
        self.desired_workers: int | None = None
        """The latest scale request not yet taken by the driver (see :meth:`take_scale_request`)."""
        self.paused = False
        self.registry = CollectorRegistry()
        r = self.registry
        self._g = {k: Gauge(name, doc, registry=r) for k, (name, doc) in JOB_GAUGES.items()}
        self._dropped = Gauge("vintage_trajectories_dropped", "Trajectories dropped, by reason", ["reason"], registry=r)
        self._exact = Gauge(
            "vintage_exact_token_fraction",
            "Share of the last batch's trained tokens with exact old logits, by old-logit route",
            ["oldlogit_route"],
            registry=r,
        )
        self.requests = Counter("vintage_http_requests", "HTTP requests served", ["endpoint"], registry=r)
        self._gw_tools = Gauge(
            "vintage_gateway_tool_calls",
            "Tool calls in gateway replies, by result (parsed, unparsed)",
            ["result"],
            registry=r,
        )
        self._gw = {k: Gauge(name, doc, registry=r) for k, (name, doc) in GATEWAY_GAUGES.items()}
        self._gw_unavailable = Gauge(
            "vintage_gateway_unavailable", "Gateway calls answered 503, by reason", ["reason"], registry=r
        )
        self._read_gateway: Callable[[], GatewayStatus | None] | None = None

    def follow_gateway(self, read: Callable[[], GatewayStatus | None] | None) -> None:
        """Serve ``read()`` (thread-safe, e.g. ``Gateway.status``) as ``gateway`` at every status
        read from now on; ``None`` stops that and keeps the last figures read."""
        last = self.status() if read is None else None
        with self._lock:
            self._read_gateway = read
            if last is not None:
                self._status = last

    def update(self, **fields) -> JobStatus:
        """Replace some fields of the status and refresh the Prometheus gauges.

        The new status is validated before it is stored: on a bad field (a NaN, a fraction above 1,
        a negative count) this raises and the previous status stays served, whole.

        Raises:
            pydantic.ValidationError: naming the field and the value.
        """
        with self._lock:
            s = JobStatus.model_validate({**self._status.model_dump(), **fields})
            self._status = s
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
        if s.gateway is not None:
            self._gateway_gauges(s.gateway)
        return s

    def _gateway_gauges(self, gw: GatewayStatus) -> None:
        self._gw_tools.labels("parsed").set(gw.tool_calls_parsed)
        self._gw_tools.labels("unparsed").set(gw.unparsed_tool_calls)
        for name, g in self._gw.items():
            g.set(getattr(gw, name))
        for reason, n in gw.unavailable.items():
            self._gw_unavailable.labels(reason).set(n)

    def request_scale(self, n: int) -> None:
        """Record a scale request; a later request replaces one not yet taken."""
        with self._lock:
            self.desired_workers = n
            self._status = self._status.model_copy(update={"scale_pending": n})

    def take_scale_request(self) -> int | None:
        """The latest scale request, cleared atomically (one arriving after this stays pending)."""
        with self._lock:
            n, self.desired_workers = self.desired_workers, None
            if n is not None:
                self._status = self._status.model_copy(update={"scale_pending": None})
            return n

    def status(self) -> JobStatus:
        """The latest status; with :meth:`follow_gateway`, its ``gateway`` read now (the stored one
        when the read fails or gives None)."""
        with self._lock:
            s, read = self._status, self._read_gateway
        if read is None:
            return s
        try:
            gw = read()
        except Exception:  # a gateway closing: its last stored figures stay served
            return s
        if gw is None:
            return s
        self._gateway_gauges(gw)
        return s.model_copy(update={"gateway": gw})


MIN_TOKEN_CHARS = 16
"""Shortest bearer token accepted (a generated one has 32 characters)."""


def build_app(
    board: StatusBoard, token: str, docs: bool = False, token_for_reads: bool = False, max_workers: int = 64
) -> FastAPI:
    """The HTTP API over ``board``; ``token`` guards the mutating endpoints (and, with
    ``token_for_reads``, every endpoint). ``docs`` serves ``/docs``, ``/redoc`` and ``/openapi.json``.
    A scale request above ``max_workers`` is refused (422)."""

    def require_token(authorization: Annotated[str | None, Header()] = None) -> None:
        given = bearer_token(authorization)
        if given is None:
            raise HTTPException(status_code=401, detail="missing bearer token", headers={"WWW-Authenticate": "Bearer"})
        if not token_matches(given, token):
            raise HTTPException(status_code=403, detail="invalid bearer token")

    app = FastAPI(
        title="vintage",
        version="1",
        summary="Async RL trainer: versions, staleness, old logits",
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
        dependencies=[Depends(require_token)] if token_for_reads else [],
    )

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
        if req.num_workers > max_workers:
            raise HTTPException(
                status_code=422, detail=f"num_workers: {req.num_workers} > the job's maximum {max_workers}"
            )
        board.request_scale(req.num_workers)
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
        board.status()  # refreshes the live gateway gauges
        return Response(generate_latest(board.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class ApiServer(ThreadedServer):
    """uvicorn in a daemon thread; ``port=0`` binds a free port (see :attr:`port`).

    Request bodies are bounded (``max_body_bytes``, ``read_timeout_s``, see :class:`BodyLimit`),
    headers to 16 KiB, idle keep-alive connections close after 5 s, and at most 64 connections are
    served at once. On a host other than loopback every endpoint requires the token.

    Raises:
        ValueError: ``token`` shorter than :data:`MIN_TOKEN_CHARS` (the message names ``server.token``).
    """

    def __init__(
        self,
        board: StatusBoard,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        docs: bool = False,
        max_body_bytes: int = 1 << 20,
        read_timeout_s: float = 10.0,
        max_workers: int = 64,
    ):
        if token is not None and len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"server.token: {len(token)} characters, at least {MIN_TOKEN_CHARS} required")
        self.token = token or secrets.token_urlsafe(24)
        self.token_for_reads = not is_loopback_host(host)
        app = BodyLimit(
            build_app(board, self.token, docs=docs, token_for_reads=self.token_for_reads, max_workers=max_workers), max_bytes=max_body_bytes,
            read_timeout_s=read_timeout_s,
        )  # fmt: skip
        super().__init__(
            app, host, port, "vintage-http", timeout_keep_alive=5, limit_concurrency=64,
            h11_max_incomplete_event_size=16 * 1024,
        )  # fmt: skip
