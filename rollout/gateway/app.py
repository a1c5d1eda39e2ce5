"""The OpenAI-compatible gateway: outside agents call the rollout worker, every token recorded.

Endpoints (FastAPI on uvicorn, bound to 127.0.0.1 by default):

* ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` - the OpenAI API
  (``n = 1``; ``stream`` sends the finished reply as one chunk). A call is tied to a session by its
  API key (the session key) or by the base URL ``/sessions/{id}/v1``; the admin token outside any
  session makes an untracked call (served, never trained on).
* ``POST /v1/sessions`` (admin token) opens a session under the staleness admission rule (HTTP 429
  with ``Retry-After`` beyond it) and returns ``{"id", "key", "base_url"}``;
  ``POST /v1/sessions/{id}/reward`` takes ``{"reward": r}`` and/or ``{"rewards": {call_id: r}}``
  (or a list, one per call); ``POST /v1/sessions/{id}/end`` ends it (optionally with a reward)
  and turns it into trajectories; ``GET /v1/status`` reports :class:`protocol.GatewayStatus`.

Rules:

* every call records the prompt ids as rendered, the sampled ids, mu and the version of every
  sampled token (a call interrupted by a weight update carries both versions), and its finish
  reason; calls are stitched token-in/token-out (:mod:`rollout.gateway.session`). A chat call whose
  messages repeat the session's previous messages and the reply exactly as returned is rendered
  by appending the close of the reply and the new messages to the previous ids, as the in-process
  agent loop does (:class:`rollout.agent.TemplateChatFormat`); any other call is rendered whole;
* tools, tool calls and tool results use the text format of :mod:`rollout.gateway.tools`. With
  ``tool_call_feedback`` (the default) a reply holding a ``<tool_call>`` that does not parse is
  answered as text: ``content`` is the sampled text followed by a tool-call error note saying why,
  no ``tool_calls`` (none of the reply's calls is returned, as vLLM's Hermes tool parser does) and
  ``vintage.tool_call_errors`` lists the reasons. The sampled tokens stay as sampled and are
  trained on as sampled; the note is never sampled: when the agent sends the reply back, it is
  rendered after the reply as a ``tool`` turn (context, mask 0), so the model reads it on its next
  turn. Without it, the calls that parsed are returned and the rest stays in ``content``;
* refused requests get OpenAI-style error JSON ``{"error": {"message", "type", "param", "code"}}``
  naming the field, and record nothing: bad JSON or fields (400), sampling the learner cannot
  reproduce (``top_p < 1``, ``top_k``, penalties, ``logit_bias``, ``temperature = 0`` or another
  temperature than the training one in a training session: 400), ``n > 1`` (400), a prompt that
  leaves no room in the context (400), a wrong key (401), an unknown session (404), an ended
  session (409), a body too slow (408) or too large (413, with ``max_body_bytes``), no admission
  (429), and 503 with ``Retry-After`` when no worker can serve the call: none took it within the
  backend's ``submit_timeout_s``, no result came within its ``call_timeout_s``, polling the
  workers failed, or the worker aborted the generation (:mod:`rollout.gateway.backend`; counted
  by reason in ``unavailable``);
* an open session is never refused for staleness; ``max_session_tokens`` caps one trajectory's
  length: a call that would cross it gets its budget cut, and a call with no room left is answered
  with finish reason ``length`` and nothing sampled; the session is then reported truncated.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import secrets
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol import GatewayStatus, SamplingParams, Trajectory
from rollout.gateway.backend import Unavailable, WorkerBackend
from rollout.gateway.session import Session
from rollout.gateway.tools import (
    normalized,
    parse_tool_calls,
    render_message,
    tool_error_text,
    with_error_note,
    with_tools,
)
from rollout.httpserve import BodyLimit, ThreadedServer, is_loopback_host

GREEDY_TEMPERATURE = 1e-3
"""Temperature that stands in for ``temperature = 0`` outside training sessions (the engine needs T > 0)."""


class ApiError(Exception):
    """A refused request: HTTP ``status``, a message and the request field it concerns (``param``)."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        408: "timeout_error",
        409: "conflict_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape; ``code`` is the HTTP status)."""
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "api_error"),
                "param": self.param,
                "code": self.status,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# --- request bodies -------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Function(_Body):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class _ToolCall(_Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: _Function


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class _ToolFunction(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(_Body):
    type: Literal["function"] = "function"
    function: _ToolFunction


class _Sampling(_Body):
    model: str = ""
    temperature: float | None = Field(None, ge=0.0, le=10.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    n: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = Field(None, ge=0)
    seed: int | None = None
    stream: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]


def _param(loc: tuple) -> str:
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _validate(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        # union members add their type name to the location; drop it so the field is named as sent
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in ("str", "int"))))
        raise ApiError(400, f"{_param(loc)}: {err['msg']}", _param(loc)) from None


# --- the gateway ------------------------------------------------------------------------------------


@dataclass
class EndedSession:
    """A training session handed over at its end: its trajectories, or why it gave none."""

    session_id: str
    group_id: str
    trajectories: list[Trajectory]
    dropped: str | None = None
    reward: float = 0.0


@dataclass
class _Stats:
    opened: int = 0
    ended: int = 0
    emitted: int = 0
    dropped: Counter = field(default_factory=Counter)
    refused: int = 0
    trajectories: int = 0
    calls: int = 0
    untracked: int = 0
    tokens: int = 0
    splits: int = 0
    parsed: int = 0
    unparsed: int = 0
    tool_errors: int = 0
    truncated: int = 0
    errors: Counter = field(default_factory=Counter)
    unavailable: Counter = field(default_factory=Counter)
    overhead_s: float = 0.0
    turn_wait_s: float = 0.0


class Gateway:
    """Sessions, rendering, stitching and the OpenAI API over one :class:`WorkerBackend`.

    Args:
        backend: where calls are generated (the real rollout worker).
        chat: a :class:`rollout.agent.TemplateChatFormat` of the served model (same renderer as the
            in-process agent loop).
        max_model_len: context length of the engine, tokens.
        admin_token: bearer token of the session endpoints; ``None`` generates one.
        train_temperature: the temperature the learner scores at; training sessions must sample at it.
        default_max_tokens: completion budget when a call gives none.
        max_session_tokens: most tokens one trajectory of a session may hold (``None``: the context).
        admission: ``admit(n) -> bool``, the staleness admission rule for ``n`` new sessions
            (``None`` admits everything); it must record what it admits.
        model_name: the id ``/v1/models`` lists (any ``model`` value is accepted in calls).
        retry_after_s: ``Retry-After`` seconds sent with a 429 or a 503.
        tool_call_feedback: answer a reply holding an unparseable ``<tool_call>`` with an error
            note (see the module docstring); False leaves it as text.
        clock: seconds, for the per-call time split (``overhead_ms_mean``, ``turn_wait_ms_mean``).
    """

    def __init__(
        self,
        backend: WorkerBackend,
        chat: Any,
        max_model_len: int,
        admin_token: str | None = None,
        train_temperature: float = 1.0,
        default_max_tokens: int = 256,
        max_session_tokens: int | None = None,
        admission: Callable[[int], bool] | None = None,
        model_name: str = "vintage",
        retry_after_s: int = 1,
        tool_call_feedback: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.backend, self.chat, self.max_model_len = backend, chat, max_model_len
        if admin_token is not None and len(admin_token) < 16:
            raise ValueError(f"gateway.token: {len(admin_token)} characters, at least 16 required")
        self.admin_token = admin_token or secrets.token_urlsafe(24)
        self.token_for_reads = False
        """Require the admin token for ``/v1/status`` too (set when serving beyond loopback)."""
        self.train_temperature, self.default_max_tokens = train_temperature, default_max_tokens
        self.max_session_tokens = max_session_tokens
        self.admission, self.model_name, self.retry_after_s = admission, model_name, retry_after_s
        self.tool_call_feedback, self.clock = tool_call_feedback, clock
        self.base_url = ""
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._by_key: dict[str, str] = {}
        self._ended_keys: set[str] = set()
        self._call_locks: dict[str, asyncio.Lock] = {}
        self._ended: list[EndedSession] = []
        self.stats = _Stats()

    # --- sessions (thread-safe; also used in-process by the agent runner) --------------------------

    def open_session(self, group_id: str | None = None, train: bool = True, admit: bool = True) -> Session:
        """Open a session; ``admit=False`` skips the admission rule (the caller already applied it).

        Raises:
            ApiError: 429 when the admission rule refuses a new session now.
        """
        if admit and train and self.admission is not None and not self.admission(1):
            with self._lock:
                self.stats.refused += 1  # errors["429"] is counted where the answer is sent
            raise ApiError(
                429,
                "sessions: the staleness admission rule admits no new session now; retry later",
                None,
                {"Retry-After": str(self.retry_after_s)},
            )
        sid = f"s-{uuid.uuid4().hex[:16]}"
        s = Session(
            session_id=sid,
            key=f"sk-vintage-{secrets.token_urlsafe(24)}",
            group_id=group_id or sid,
            train=train,
            admitted_version=self.backend.version(),
        )
        with self._lock:
            self._sessions[sid] = s
            self._by_key[s.key] = sid
            self.stats.opened += 1
        return s

    def session(self, sid: str) -> Session:
        """The session ``sid`` (open or ended). Raises ApiError 404 when unknown."""
        with self._lock:
            s = self._sessions.get(sid)
        if s is None:
            raise ApiError(404, f"session_id: {sid!r} does not exist", "session_id")
        return s

    def set_reward(self, sid: str, reward: float | None = None, rewards: Any = None) -> Session:
        """Set the session's scalar reward and/or per-call rewards (``{call_id: r}`` or a list by call index).

        Raises:
            ApiError: 404 unknown session, 409 ended, 400 a non-finite reward or an unknown call.
        """
        s = self.session(sid)
        with self._lock:
            if s.state != "open":
                raise ApiError(409, f"session_id: {sid!r} has ended", "session_id")
            per: dict[str, float] = {}
            if rewards is not None:
                items = rewards.items() if isinstance(rewards, dict) else enumerate(rewards)
                ids = [c.call_id for c in s.calls]
                for k, v in items:
                    cid = ids[k] if isinstance(k, int) and 0 <= k < len(ids) else k
                    if cid not in ids:
                        raise ApiError(400, f"rewards: no call {k!r} in session {sid!r}", "rewards")
                    if not _finite(v):
                        raise ApiError(400, f"rewards[{k!r}]: non-finite value {v!r}", "rewards")
                    per[cid] = float(v)
            if reward is not None and not _finite(reward):
                raise ApiError(400, f"reward: non-finite value {reward!r}", "reward")
            if reward is not None:
                s.reward = float(reward)
            s.call_rewards.update(per)
        return s

    def end_session(self, sid: str, reward: float | None = None, dropped: str | None = None) -> EndedSession:
        """End a session; training sessions become trajectories (queued for :meth:`take_ended`).

        ``dropped`` ends it without trajectories, for that reason (e.g. ``agent_error``).

        Raises:
            ApiError: 404 unknown session, 409 already ended, 400 non-finite reward.
        """
        if reward is not None:
            self.set_reward(sid, reward)
        s = self.session(sid)
        with self._lock:
            if s.state != "open":
                raise ApiError(409, f"session_id: {sid!r} has ended", "session_id")
            s.state = "ended"
            self._by_key.pop(s.key, None)
            self._ended_keys.add(s.key)
            self.stats.ended += 1
            trajs: list[Trajectory] = []
            if dropped is None and not s.calls:
                dropped = "no_calls"
            if dropped is None and s.train:
                try:
                    trajs = s.to_trajectories()
                except ValueError as e:  # an internal bug: say so, do not train on it
                    dropped = f"invalid: {e}"[:200]
            if dropped is None:
                self.stats.emitted += 1
                self.stats.trajectories += len(trajs)
            else:
                self.stats.dropped[dropped] += 1
            out = EndedSession(s.session_id, s.group_id, trajs, dropped, s.total_reward())
            if s.train:
                self._ended.append(out)
            # free the token state of the session; its counts stay for GET /v1/sessions/{id}
            s.info["calls"], s.segments, s.history, s.calls, s.last_ids = len(s.calls), [], None, [], []
            self._call_locks.pop(s.session_id, None)
        return out

    def take_ended(self) -> list[EndedSession]:
        """Training sessions ended since the last call, oldest first."""
        with self._lock:
            out, self._ended = self._ended, []
        return out

    def status(self) -> GatewayStatus:
        st, b = self.stats, self.backend
        with self._lock:
            n_open = sum(1 for s in self._sessions.values() if s.state == "open")
            return GatewayStatus(
                policy_version=max(0, self.backend.version()),
                sessions_opened=st.opened,
                sessions_open=n_open,
                sessions_ended=st.ended,
                sessions_emitted=st.emitted,
                sessions_dropped=dict(st.dropped),
                sessions_refused=st.refused,
                trajectories_emitted=st.trajectories,
                calls=st.calls,
                untracked_calls=st.untracked,
                tokens_sampled=st.tokens,
                splits=st.splits,
                tool_calls_parsed=st.parsed,
                unparsed_tool_calls=st.unparsed,
                tool_call_errors=st.tool_errors,
                truncated_sessions=st.truncated,
                errors=dict(st.errors),
                unavailable=dict(st.unavailable),
                calls_pending=b.pending,
                resubmissions=b.resubmissions,
                late_results_discarded=b.late_discarded,
                overhead_ms_mean=1e3 * st.overhead_s / st.calls if st.calls else 0.0,
                turn_wait_ms_mean=1e3 * st.turn_wait_s / st.calls if st.calls else 0.0,
            )

    def refusal(self, status: int, message: str) -> dict:
        """The OpenAI-shaped body of a request refused before it reached a route (a body too large
        or too slow, :class:`rollout.httpserve.BodyLimit`), counted in ``errors``."""
        with self._lock:
            self.stats.errors[str(status)] += 1
        return ApiError(status, message, "body").body()

    # --- calls -------------------------------------------------------------------------------------

    def _auth(self, request: Request, sid: str | None) -> Session | None:
        """The session a call belongs to (None: an untracked admin call). Raises ApiError 401/404/409."""
        auth = request.headers.get("authorization", "")
        key = auth[7:] if auth.startswith("Bearer ") else ""
        admin = bool(key) and hmac.compare_digest(key.encode(), self.admin_token.encode())
        if sid is not None:
            s = self.session(sid)
            if not (admin or (key and hmac.compare_digest(key.encode(), s.key.encode()))):
                raise ApiError(401, "api_key: not the key of this session", "api_key")
        elif admin:
            return None
        else:
            with self._lock:
                found = self._by_key.get(key)
                s = self._sessions.get(found) if found else None
                ended = key in self._ended_keys
            if s is None:
                if ended:
                    raise ApiError(409, "session_id: the session of this key has ended", "session_id")
                raise ApiError(401, "api_key: unknown key (use a session key or the admin token)", "api_key")
        if s.state != "open":
            raise ApiError(409, f"session_id: {s.session_id!r} has ended", "session_id")
        return s

    def _sampling(self, req: _Sampling, s: Session | None) -> tuple[float, list[str]]:
        """Temperature and stop strings of a call, refusing what the learner cannot reproduce."""
        if req.n not in (None, 1):
            raise ApiError(400, f"n: {req.n} samples per call are not supported; use n = 1", "n")
        if req.top_p is not None and req.top_p != 1.0:
            raise ApiError(400, f"top_p: {req.top_p} truncates the support; the learner cannot reproduce it", "top_p")
        if req.top_k not in (None, -1, 0):
            raise ApiError(400, f"top_k: {req.top_k} truncates the support; the learner cannot reproduce it", "top_k")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(req, name)
            if v not in (None, 0, 0.0):
                raise ApiError(400, f"{name}: {v} changes the distribution; only 0 is supported", name)
        if req.logit_bias:
            raise ApiError(400, "logit_bias: changes the distribution; not supported", "logit_bias")
        if req.top_logprobs:
            raise ApiError(
                400, f"top_logprobs: {req.top_logprobs}; only the sampled token's log-prob is served", "top_logprobs"
            )
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > 4 or any(not x for x in stop):
            raise ApiError(400, f"stop: up to 4 non-empty strings, got {stop!r}", "stop")
        t = req.temperature
        if s is not None and s.train:
            if t == 0:
                raise ApiError(
                    400, "temperature: 0 (greedy) in a training session; importance ratios need T > 0", "temperature"
                )
            if t is not None and abs(t - self.train_temperature) > 1e-9:
                raise ApiError(
                    400,
                    f"temperature: {t} differs from the training temperature {self.train_temperature}",
                    "temperature",
                )
            return self.train_temperature, stop
        if t is None:
            return self.train_temperature, stop
        return (GREEDY_TEMPERATURE if t == 0 else t), stop

    async def chat_completions(self, request: Request, sid: str | None = None) -> Any:
        req = _validate(ChatRequest, await _json(request))
        s = self._auth(request, sid)
        temperature, stop = self._sampling(req, s)
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise ApiError(400, "response_format: only text is supported", "response_format")
        msgs = [m.model_dump(exclude_none=True) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        for i, m in enumerate(msgs):
            for j, c in enumerate(m.get("tool_calls", [])):
                if isinstance(c["function"]["arguments"], dict):
                    msgs[i]["tool_calls"][j]["function"]["arguments"] = json.dumps(c["function"]["arguments"])
        try:
            per = [render_message(m, i) for i, m in enumerate(msgs)]  # one or two template messages each
            plain = with_tools([x for p in per for x in p], tools, req.tool_choice)
            key = [("tools", json.dumps(tools, sort_keys=True), json.dumps(req.tool_choice, sort_keys=True))]
            key += [normalized(m) for m in msgs]
        except ValueError as e:
            raise ApiError(400, str(e), str(e).split(":")[0]) from None
        names = {t["function"]["name"] for t in tools} if tools and req.tool_choice != "none" else None

        def render(sess: Session | None) -> list[int]:
            seg = sess.current if sess is not None else None
            h = sess.history if sess is not None else None
            if seg is not None and h is not None and len(key) > len(h) and key[: len(h)] == h:
                try:
                    reply = len(h) - 2  # index of the reply as returned: its note, if any, then the new messages
                    new = per[reply][1:] + [x for p in per[reply + 1 :] for x in p]
                    return (
                        seg.token_ids
                        + self.chat.close_ids(sess.last_ids, sess.last_finish)
                        + self.chat.observation_ids(new)
                    )
                except ValueError:
                    pass  # the template cannot append here: render whole (the call then splits)
            return self.chat.prompt_ids(plain)

        return await self._serve(
            req, s, render, temperature, stop, kind="chat", names=names, key=key, stream=bool(req.stream)
        )

    async def completions(self, request: Request, sid: str | None = None) -> Any:
        req = _validate(CompletionRequest, await _json(request))
        s = self._auth(request, sid)
        temperature, stop = self._sampling(req, s)
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise ApiError(400, f"prompt: {len(p)} prompts in one call; send one", "prompt")
            p = p[0]
        if not p:
            raise ApiError(400, "prompt: empty", "prompt")
        if isinstance(p, list) and any(not 0 <= x for x in p):
            raise ApiError(400, "prompt: token ids must be >= 0", "prompt")
        ids = list(p) if isinstance(p, list) else self.chat.text_ids(p)
        return await self._serve(req, s, lambda sess: ids, temperature, stop, kind="text", stream=bool(req.stream))

    async def _serve(self, req, s, render, temperature, stop, kind, names=None, key=None, stream=False) -> Any:
        t0 = self.clock()
        lock = self._call_lock(s)
        async with lock:
            t_turn = self.clock()  # the session's earlier calls are done: the gateway's own work starts
            prompt = render(s)
            if len(prompt) >= self.max_model_len:
                raise ApiError(
                    400,
                    f"messages: the prompt renders to {len(prompt)} tokens; the context limit is {self.max_model_len}",
                    "messages" if kind == "chat" else "prompt",
                )
            budget = req.max_completion_tokens or req.max_tokens or self.default_max_tokens
            budget = min(budget, self.max_model_len - len(prompt), 65536)
            cut = False
            if s is not None and self.max_session_tokens is not None:
                room = self.max_session_tokens - len(prompt)
                if room < budget:
                    budget, cut = room, True
            call_id = f"{s.session_id if s else 'untracked'}-{len(s.calls) if s else uuid.uuid4().hex[:8]}"
            if budget < 1:  # max_session_tokens reached: nothing sampled, the session is truncated
                self._truncate(s)
                ids, mu, vers, finish, old, gen_s, version = [], [], [], "length", None, 0.0, self.backend.version()
            else:
                stop_ids = sorted({i[0] for x in stop if len(i := self.chat.text_ids(x)) == 1})
                sampling = SamplingParams(
                    temperature=temperature, max_tokens=budget, n=1, seed=req.seed, stop_token_ids=stop_ids
                )
                g0 = self.clock()
                try:
                    t = await self.backend.generate(
                        f"gw-{uuid.uuid4().hex}",
                        s.group_id if s else "untracked",
                        prompt,
                        sampling,
                        s.admitted_version if s else self.backend.version(),
                    )
                except ValueError as e:
                    raise ApiError(400, str(e), "messages") from None
                except Unavailable as e:
                    raise self._unavailable(e.reason, str(e)) from None
                gen_s = self.clock() - g0
                if t.finish_reason == "abort":
                    raise self._unavailable("aborted", f"generation aborted: {t.info.get('error', 'worker stopped')}")
                p = t.prompt_len
                ids, mu = t.token_ids[p:].tolist(), t.behav_logprobs[p:].tolist()
                vers, finish, version = t.versions[p:].tolist(), t.finish_reason, t.policy_version
                old = t.old_logprobs[p:].tolist() if t.old_logprobs is not None else None
                if cut and finish == "length":
                    self._truncate(s)
            text = self.chat.decode(ids)
            if stop:
                ids, mu, vers, old, text, finish = self._apply_stop(ids, mu, vers, old, text, finish, stop)
            parsed = parse_tool_calls(text, names, f"call_{call_id}") if names is not None else None
            content = parsed.content if parsed else text
            calls = parsed.tool_calls if parsed else []
            errors = parsed.errors if parsed else []
            feedback = bool(errors) and self.tool_call_feedback
            if feedback:  # answered as text: the note follows the sampled text, no call is returned
                content, calls = with_error_note(text, tool_error_text(errors)), []
            with self._lock:
                if s is not None and s.state != "open":
                    raise ApiError(409, f"session_id: {s.session_id!r} ended during the call", "session_id")
                if s is not None and ids:
                    before = s.splits
                    s.add_call(call_id, prompt, ids, mu, vers, finish, version, old)
                    s.last_ids, s.last_finish = ids, finish
                    s.history = (
                        None
                        if key is None
                        else key + [normalized({"role": "assistant", "content": content, "tool_calls": calls})]
                    )
                    self.stats.splits += s.splits - before
                elif s is None:
                    self.stats.untracked += 1
                self.stats.calls += 1
                self.stats.tokens += len(ids)
                self.stats.parsed += len(parsed.tool_calls) if parsed else 0
                self.stats.unparsed += len(errors)
                self.stats.tool_errors += int(feedback)
                self.stats.turn_wait_s += t_turn - t0
                self.stats.overhead_s += max(0.0, self.clock() - t_turn - gen_s)
        reason = "tool_calls" if calls and finish == "stop" else finish
        extra = {"session_id": s.session_id if s else None, "call_id": call_id, "versions": vers}
        if errors:
            extra["tool_call_errors"] = errors
        lp = self._logprobs(ids, mu, kind) if req.logprobs else None
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
        base = {"id": f"chatcmpl-{call_id}", "created": int(time.time()), "model": req.model or self.model_name}
        if kind == "text":
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": reason}
            body = {**base, "object": "text_completion", "choices": [choice], "usage": usage, "vintage": extra}
            return _stream_text(body) if stream else body
        msg: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
        if calls:
            msg["tool_calls"] = calls
        choice = {"index": 0, "message": msg, "logprobs": lp, "finish_reason": reason}
        body = {**base, "object": "chat.completion", "choices": [choice], "usage": usage, "vintage": extra}
        return _stream_chat(body) if stream else body

    def _unavailable(self, reason: str, message: str) -> ApiError:
        """A 503 naming why no worker serves the call (counted by ``reason``), with ``Retry-After``."""
        with self._lock:
            self.stats.unavailable[reason] += 1
        return ApiError(503, message, None, {"Retry-After": str(self.retry_after_s)})

    def _call_lock(self, s: Session | None) -> asyncio.Lock:
        if s is None:
            return asyncio.Lock()
        lock = self._call_locks.get(s.session_id)
        if lock is None:
            lock = self._call_locks[s.session_id] = asyncio.Lock()
        return lock

    def _truncate(self, s: Session | None) -> None:
        if s is not None and not s.truncated:
            s.truncated = True
            with self._lock:
                self.stats.truncated += 1

    def _apply_stop(self, ids, mu, vers, old, text, finish, stop):
        """Cut the sampled ids after the first token whose text completes a stop string (kept as sampled)."""
        if not any(x in text for x in stop):
            if ids and finish == "stop" and ids[-1] in self._single_stop_ids(stop):
                return ids, mu, vers, old, self.chat.decode(ids[:-1]), finish
            return ids, mu, vers, old, text, finish
        for k in range(1, len(ids) + 1):
            part = self.chat.decode(ids[:k])
            hits = [part.find(x) for x in stop if x in part]
            if hits:
                return ids[:k], mu[:k], vers[:k], (old[:k] if old else old), part[: min(hits)], "stop"
        return ids, mu, vers, old, text, finish

    def _single_stop_ids(self, stop: list[str]) -> set[int]:
        return {i[0] for x in stop if len(i := self.chat.text_ids(x)) == 1}

    def _logprobs(self, ids: list[int], mu: list[float], kind: str) -> dict[str, Any]:
        toks = [self.chat.decode_token(i) if hasattr(self.chat, "decode_token") else self.chat.decode([i]) for i in ids]
        if kind == "text":
            return {"tokens": toks, "token_logprobs": mu, "top_logprobs": None, "text_offset": None}
        return {
            "content": [
                {"token": t, "logprob": m, "bytes": list(t.encode()), "top_logprobs": []}
                for t, m in zip(toks, mu, strict=True)
            ]
        }

    # --- the app -----------------------------------------------------------------------------------

    def app(self) -> FastAPI:
        """The FastAPI app of this gateway."""
        app = FastAPI(title="vintage gateway", version="1")
        gw = self

        def guarded(fn):
            async def handler(request: Request, **kw):
                try:
                    out = await fn(request, **kw)
                except ApiError as e:
                    with gw._lock:
                        gw.stats.errors[str(e.status)] += 1
                    return e.response()
                return out

            return handler

        def admin(request: Request) -> None:
            auth = request.headers.get("authorization", "")
            key = auth[7:] if auth.startswith("Bearer ") else ""
            if not (key and hmac.compare_digest(key.encode(), gw.admin_token.encode())):
                raise ApiError(401, "api_key: the admin bearer token is required", "api_key")

        def admin_or_session(request: Request, sid: str) -> None:
            auth = request.headers.get("authorization", "")
            key = auth[7:] if auth.startswith("Bearer ") else ""
            s = gw.session(sid)
            if not key or not (
                hmac.compare_digest(key.encode(), gw.admin_token.encode())
                or hmac.compare_digest(key.encode(), s.key.encode())
            ):
                raise ApiError(401, "api_key: the admin token or this session's key is required", "api_key")

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await guarded(gw.chat_completions)(request)

        @app.post("/sessions/{sid}/v1/chat/completions")
        async def chat_in(request: Request, sid: str):
            return await guarded(gw.chat_completions)(request, sid=sid)

        @app.post("/v1/completions")
        async def comp(request: Request):
            return await guarded(gw.completions)(request)

        @app.post("/sessions/{sid}/v1/completions")
        async def comp_in(request: Request, sid: str):
            return await guarded(gw.completions)(request, sid=sid)

        async def models(request: Request):
            return {
                "object": "list",
                "data": [{"id": gw.model_name, "object": "model", "created": 0, "owned_by": "vintage"}],
            }

        app.get("/v1/models")(models)
        app.get("/sessions/{sid}/v1/models")(models)

        async def _open(request: Request):
            admin(request)
            body = await _json(request, default={})
            train = bool(body.get("train", True))
            s = gw.open_session(body.get("group_id"), train=train)
            return {"id": s.session_id, "key": s.key, "base_url": f"{gw.base_url}/sessions/{s.session_id}/v1"}

        async def _reward(request: Request, sid: str):
            admin_or_session(request, sid)
            body = await _json(request, default={})
            if "reward" not in body and "rewards" not in body:
                raise ApiError(400, "reward: give 'reward' (a number) and/or 'rewards' (per call)", "reward")
            s = gw.set_reward(sid, _number(body.get("reward"), "reward"), body.get("rewards"))
            return {"id": sid, "reward": s.total_reward()}

        async def _end(request: Request, sid: str):
            admin_or_session(request, sid)
            body = await _json(request, default={})
            e = gw.end_session(sid, _number(body.get("reward"), "reward"))
            return {
                "id": sid,
                "reward": e.reward,
                "trajectories": len(e.trajectories),
                "dropped": e.dropped,
                "splits": gw.session(sid).splits,
            }

        async def _get(request: Request, sid: str):
            admin_or_session(request, sid)
            s = gw.session(sid)
            calls = s.info.get("calls", len(s.calls))
            return {"id": sid, "state": s.state, "calls": calls, "splits": s.splits, "truncated": s.truncated}

        @app.post("/v1/sessions")
        async def open_(request: Request):
            return await guarded(_open)(request)

        @app.post("/v1/sessions/{sid}/reward")
        async def reward(request: Request, sid: str):
            return await guarded(_reward)(request, sid=sid)

        @app.post("/v1/sessions/{sid}/end")
        async def end(request: Request, sid: str):
            return await guarded(_end)(request, sid=sid)

        @app.get("/v1/sessions/{sid}")
        async def get(request: Request, sid: str):
            return await guarded(_get)(request, sid=sid)

        async def _status(request: Request):
            if gw.token_for_reads:
                admin(request)
            return gw.status().model_dump()

        @app.get("/v1/status")
        async def status(request: Request):
            return await guarded(_status)(request)

        @app.get("/healthz")
        def healthz() -> dict:
            return {"ok": True}

        return app


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _number(v: Any, name: str) -> float | None:
    if v is None:
        return None
    if not _finite(v):
        raise ApiError(400, f"{name}: must be a finite number, got {v!r}", name)
    return float(v)


async def _json(request: Request, default: Any = None) -> Any:
    raw = await request.body()
    if not raw and default is not None:
        return default
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"body: not JSON ({e.msg} at position {e.pos})", "body") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"body: expected a JSON object, got {type(body).__name__}", "body")
    return body


def _sse(chunks: list[dict]) -> StreamingResponse:
    async def gen():
        for c in chunks:
            yield f"data: {json.dumps(c)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(gen(), media_type="text/event-stream")


def _stream_chat(body: dict) -> StreamingResponse:
    ch = body["choices"][0]
    delta: dict[str, Any] = {"role": "assistant", "content": ch["message"]["content"]}
    if "tool_calls" in ch["message"]:
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(ch["message"]["tool_calls"])]
    head = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    return _sse(
        [
            head | {"choices": [{"index": 0, "delta": delta, "logprobs": ch["logprobs"], "finish_reason": None}]},
            head
            | {"choices": [{"index": 0, "delta": {}, "finish_reason": ch["finish_reason"]}], "usage": body["usage"]},
        ]
    )


def _stream_text(body: dict) -> StreamingResponse:
    return _sse([body])


class GatewayServer(ThreadedServer):
    """uvicorn serving a :class:`Gateway` in a daemon thread; ``port=0`` binds a free port.

    ``max_body_bytes`` bounds request bodies (:class:`rollout.httpserve.BodyLimit`: 413 above it,
    408 when the next chunk takes longer than ``read_timeout_s`` seconds), answered in the OpenAI
    error shape and counted in ``errors``; ``None`` leaves bodies unbounded. ``wrap(app) -> app``
    adds other ASGI middleware. Headers are limited to 16 KiB. On a host other than loopback
    ``/v1/status`` requires the admin token too (every other endpoint always requires a key).
    """

    def __init__(
        self,
        gateway: Gateway,
        host: str = "127.0.0.1",
        port: int = 0,
        wrap: Callable[[Any], Any] | None = None,
        max_body_bytes: int | None = None,
        read_timeout_s: float = 30.0,
    ):
        self.gateway = gateway
        gateway.token_for_reads = not is_loopback_host(host)
        app = gateway.app() if wrap is None else wrap(gateway.app())
        if max_body_bytes is not None:
            app = BodyLimit(app, max_body_bytes, read_timeout_s, error_body=gateway.refusal)
        super().__init__(
            app, host, port, "vintage-gateway", timeout_keep_alive=30, h11_max_incomplete_event_size=16 * 1024
        )
        gateway.base_url = self.url
