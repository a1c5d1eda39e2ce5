"""The HTTP routes of the gateway: a FastAPI ``APIRouter`` whose auth and session lookup are dependencies.

* :func:`bearer`: the token of ``Authorization: Bearer <token>`` (:func:`rollout.httpserve.bearer_token`);
* :meth:`Guards.admin`: the admin token (401 otherwise);
* :meth:`Guards.owned_session`: the session of the path's ``sid`` (404 when unknown), for the admin
  token or that session's key (401 otherwise);
* :meth:`Guards.reads`: the admin token when the gateway serves beyond loopback (``token_for_reads``).

Calls (``/v1/chat/completions``, ``/v1/completions``) read the body first and check the key after
it, so a malformed body is a 400 whatever the key; they pass the request's disconnect check on, so
a call whose client left is not recorded. Every :class:`rollout.gateway.errors.ApiError`
is answered in the OpenAI error shape and counted by status in ``errors``.
"""

# no ``from __future__ import annotations``: FastAPI reads the route annotations, some of which name
# dependencies local to a route-building function, when the route is defined

from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse

from rollout.gateway.bodies import number, read_json
from rollout.gateway.errors import ApiError
from rollout.gateway.session import Session
from rollout.httpserve import bearer_token, token_matches


def bearer(authorization: Annotated[str | None, Header()] = None) -> str | None:
    """The bearer token of the request (None: no ``Authorization: Bearer`` header)."""
    return bearer_token(authorization)


Key = Annotated[str | None, Depends(bearer)]


async def body(request: Request) -> dict:
    """The request's JSON object. Raises ApiError 400."""
    return await read_json(request)


async def optional_body(request: Request) -> dict:
    """The request's JSON object, ``{}`` for an empty body. Raises ApiError 400."""
    return await read_json(request, default={})


Body = Annotated[dict, Depends(body)]
OptionalBody = Annotated[dict, Depends(optional_body)]


class Guards:
    """The auth dependencies of gateway ``gw`` (a :class:`rollout.gateway.sessions.SessionTable`)."""

    def __init__(self, gw: Any):
        self.gw = gw

    def admin(self, key: Key) -> None:
        """Raises ApiError 401 unless ``key`` is the admin token."""
        if not self.gw.is_admin(key):
            raise ApiError(401, "api_key: the admin bearer token is required", "api_key")

    def owned_session(self, sid: str, key: Key) -> Session:
        """The session ``sid`` for the admin token or its own key. Raises ApiError 404 unknown, 401 wrong key."""
        s = self.gw.session(sid)
        if not (self.gw.is_admin(key) or token_matches(key, s.key)):
            raise ApiError(401, "api_key: the admin token or this session's key is required", "api_key")
        return s

    def reads(self, key: Key) -> None:
        """The admin token, when the gateway serves beyond loopback (``token_for_reads``)."""
        if self.gw.token_for_reads:
            self.admin(key)


def call_routes(gw: Any) -> APIRouter:
    """The OpenAI API: chat and text completions and models, each declared once. The app mounts
    it twice (:func:`gateway_app`): at ``/v1``, where a call names no session, and at
    ``/sessions/{sid}/v1``, where the session is the path's ``sid``."""
    router = APIRouter()

    @router.post("/chat/completions")
    async def chat(body: Body, key: Key, request: Request):
        return await gw.chat_completions(body, key, request.path_params.get("sid"), gone=request.is_disconnected)

    @router.post("/completions")
    async def completions(body: Body, key: Key, request: Request):
        return await gw.completions(body, key, request.path_params.get("sid"), gone=request.is_disconnected)

    @router.get("/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": gw.model_name, "object": "model", "created": 0, "owned_by": "vintage"}],
        }

    return router


def session_routes(gw: Any) -> APIRouter:
    """Open, reward, end and read sessions; the gateway status; ``/healthz``."""
    router, guard = APIRouter(), Guards(gw)
    Owned = Annotated[Session, Depends(guard.owned_session)]

    @router.post("/v1/sessions", dependencies=[Depends(guard.admin)])
    async def open_session(body: OptionalBody) -> dict:
        s = gw.open_session(body.get("group_id"), train=bool(body.get("train", True)))
        return {"id": s.session_id, "key": s.key, "base_url": f"{gw.base_url}/sessions/{s.session_id}/v1"}

    @router.post("/v1/sessions/{sid}/reward")
    async def reward(s: Owned, body: OptionalBody) -> dict:
        if "reward" not in body and "rewards" not in body:
            raise ApiError(400, "reward: give 'reward' (a number) and/or 'rewards' (per call)", "reward")
        s = gw.set_reward(s.session_id, number(body.get("reward"), "reward"), body.get("rewards"))
        return {"id": s.session_id, "reward": s.total_reward()}

    @router.post("/v1/sessions/{sid}/end")
    async def end(s: Owned, body: OptionalBody) -> dict:
        e = gw.end_session(s.session_id, number(body.get("reward"), "reward"))
        n = len(e.trajectories)
        return {"id": s.session_id, "reward": e.reward, "trajectories": n, "dropped": e.dropped, "splits": s.splits}

    @router.get("/v1/sessions/{sid}")
    async def get_session(s: Owned) -> dict:
        calls = s.info.get("calls", len(s.calls))
        return {"id": s.session_id, "state": s.state, "calls": calls, "splits": s.splits, "truncated": s.truncated}

    @router.get("/v1/status", dependencies=[Depends(guard.reads)])
    async def status() -> dict:
        return gw.status().model_dump()

    @router.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    return router


def gateway_app(gw: Any) -> FastAPI:
    """A FastAPI app serving the routes of gateway ``gw`` (a :class:`rollout.gateway.app.Gateway`),
    answering every :class:`ApiError` as OpenAI error JSON, counted by status."""
    app = FastAPI(title="vintage gateway", version="1")
    calls = call_routes(gw)
    app.include_router(calls, prefix="/v1")
    app.include_router(calls, prefix="/sessions/{sid}/v1")
    app.include_router(session_routes(gw))

    async def refused(request: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, ApiError)
        gw.count_error(e)
        return e.response()

    app.add_exception_handler(ApiError, refused)
    return app
