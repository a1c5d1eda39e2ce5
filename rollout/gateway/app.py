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
  and turns it into trajectories, held until its GRPO group fills or waits ``group_wait_s``
  (:mod:`rollout.gateway.groups`); ``GET /v1/status`` reports :class:`protocol.GatewayStatus`.

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
  backend's ``submit_timeout_s``, no result came within its ``call_timeout_s``, submitting to
  or polling the workers failed, or the worker aborted the generation (:mod:`rollout.gateway.backend`; counted
  by reason in ``unavailable``);
* an open session is never refused for staleness; ``max_session_tokens`` caps one trajectory's
  length: a call that would cross it gets its budget cut, and a call with no room left is answered
  with finish reason ``length`` and nothing sampled; the session is then reported truncated.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from protocol import GatewayStatus, SamplingParams
from rollout.gateway.backend import Unavailable, WorkerBackend
from rollout.gateway.bodies import ChatRequest, CompletionRequest, Sampling, sampling_choice, validate
from rollout.gateway.config import GatewayConfig
from rollout.gateway.errors import ApiError, ended
from rollout.gateway.prompts import ChatPrompt, text_prompt_ids
from rollout.gateway.replies import Reply, logprobs_body
from rollout.gateway.router import gateway_app
from rollout.gateway.session import Completion, Session
from rollout.gateway.sessions import SessionTable
from rollout.gateway.tools import normalized, parse_tool_calls, tool_error_text, with_error_note
from rollout.httpserve import BodyLimit, ThreadedServer, is_loopback_host

__all__ = ["ApiError", "Gateway", "GatewayServer"]

Gone = Callable[[], Awaitable[bool]] | None
"""``await gone()`` is True once the call's client has disconnected (Starlette's ``Request.is_disconnected``)."""


class Gateway(SessionTable):
    """Sessions (:class:`rollout.gateway.sessions.SessionTable`), rendering, stitching and the
    OpenAI API over one :class:`WorkerBackend`.

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
        clock: seconds (monotonic), for the per-call time split (``overhead_ms_mean``,
            ``turn_wait_ms_mean``) and ``group_wait_s``.
        group_size: sessions of a full GRPO group (``rollout.sampling.n``); 1 hands every ended
            session over at once.
        group_wait_s: longest wait for a group to fill after its first session ended, seconds; then
            it is handed over short of ``group_size``, with baselines (:mod:`rollout.gateway.groups`).
        session_idle_s: end a session with no call running and no request for this many seconds,
            dropped as ``idle`` (:mod:`rollout.gateway.sessions`); ``None``: never.

    Raises:
        ValueError: an ``admin_token`` shorter than 16 characters, ``group_size < 1``, or a
            ``group_wait_s`` that is not a positive number (each names its setting).
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
        group_size: int = 1,
        group_wait_s: float = 120.0,
        session_idle_s: float | None = None,
    ):
        super().__init__(
            backend.version,
            admin_token,
            admission,
            retry_after_s,
            group_size,
            group_wait_s,
            clock,
            idle_s=session_idle_s,
        )
        self.backend, self.chat, self.max_model_len = backend, chat, max_model_len
        self.token_for_reads = False
        """Require the admin token for ``/v1/status`` too (set when serving beyond loopback)."""
        self.train_temperature, self.default_max_tokens = train_temperature, default_max_tokens
        self.max_session_tokens, self.model_name = max_session_tokens, model_name
        self.tool_call_feedback, self.clock = tool_call_feedback, clock
        self.base_url = ""

    @classmethod
    def from_config(
        cls,
        backend: WorkerBackend,
        chat: Any,
        max_model_len: int,
        config: GatewayConfig,
        *,
        sampling: SamplingParams,
        admission: Callable[[int], bool] | None = None,
    ) -> Gateway:
        """The gateway a job's ``[gateway]`` section describes, over ``backend``: its token,
        budgets, model name, tool-call feedback, group wait and idle limit from ``config``; the
        training temperature, the group size (``n``) and the completion budget of a call that gives
        none (unless ``config.max_tokens``) from the job's ``sampling``; ``admission`` as in the class.

        Raises:
            ValueError: as the class does (each message names its setting)."""
        return cls(
            backend, chat, max_model_len,
            admin_token=config.token.get_secret_value() if config.token else None,
            train_temperature=sampling.temperature, default_max_tokens=config.max_tokens or sampling.max_tokens,
            max_session_tokens=config.max_session_tokens, admission=admission, model_name=config.model_name,
            tool_call_feedback=config.tool_call_feedback, group_size=sampling.n, group_wait_s=config.group_wait_s,
            session_idle_s=config.session_idle_s,
        )  # fmt: skip

    def status(self) -> GatewayStatus:
        """Sessions, calls and their accounting (:class:`protocol.GatewayStatus`)."""
        b = self.backend
        return GatewayStatus(
            policy_version=max(0, b.version()),
            calls_pending=b.pending,
            resubmissions=b.resubmissions,
            lost_resubmissions=b.lost_resubmissions,
            late_results_discarded=b.late_discarded,
            **self.session_counts(),
        )

    # --- calls -------------------------------------------------------------------------------------

    def _open_call(self, req: Sampling, key: str | None, sid: str | None) -> tuple[Session | None, float, list[str]]:
        """The call's session (None: untracked), temperature and stop strings. Raises ApiError."""
        s = self.call_session(key, sid)
        temperature, stop = sampling_choice(req, s is not None and s.train, self.train_temperature)
        return s, temperature, stop

    async def chat_completions(self, body: dict, key: str | None, sid: str | None = None, gone: Gone = None) -> Any:
        """``POST /v1/chat/completions`` with the JSON ``body``, API key ``key``, in session ``sid``;
        ``gone()`` says whether the client has disconnected (None: never asked)."""
        req = validate(ChatRequest, body)
        s, temperature, stop = self._open_call(req, key, sid)
        prompt = ChatPrompt.of(req)
        return await self._serve(req, s, prompt, temperature, stop, "chat", gone)

    async def completions(self, body: dict, key: str | None, sid: str | None = None, gone: Gone = None) -> Any:
        """``POST /v1/completions`` with the JSON ``body``, API key ``key``, in session ``sid``;
        ``gone`` as in :meth:`chat_completions`."""
        req = validate(CompletionRequest, body)
        s, temperature, stop = self._open_call(req, key, sid)
        return await self._serve(req, s, text_prompt_ids(req, self.chat), temperature, stop, "text", gone)

    async def _serve(
        self, req: Sampling, s: Session | None, prompt: ChatPrompt | list[int], temperature: float,
        stop: list[str], kind: str, gone: Gone = None,
    ) -> dict | StreamingResponse:  # fmt: skip
        """Render, sample and record one call under its session's call lock; the reply to send.

        A call whose client disconnected before its reply was ready (``gone()``) is counted in
        ``abandoned`` and not recorded: the agent never saw the reply, so its tokens are not
        stitched into the session, never trained on, and the agent's next call extends the
        session's ids as if it had not been made."""
        t0 = self.clock()
        async with self.call_lock(s):
            t_turn = self.clock()  # the session's earlier calls are done: the gateway's own work starts
            ids = prompt.ids(self.chat, s) if isinstance(prompt, ChatPrompt) else prompt
            budget, cut = self._budget(req, s, ids, kind)
            call_id = f"{s.session_id if s else 'untracked'}-{len(s.calls) if s else uuid.uuid4().hex[:8]}"
            c, gen_s = await self._sample(req, s, ids, temperature, stop, budget, cut)
            text = self.chat.decode(c.ids)
            if stop:
                c, text = self._cut_at_stop(c, text, stop)
            names = prompt.names if isinstance(prompt, ChatPrompt) else None
            reply = self._reply(req, kind, s, call_id, len(ids), c, text, names)
            if gone is not None and await gone():
                with self._lock:
                    self.stats.abandoned += 1
                return reply.answer(False)  # to nobody
            with self._lock:
                self._record(s, ids, reply, prompt.key if isinstance(prompt, ChatPrompt) else None)
                self.stats.turn_wait_s += t_turn - t0
                self.stats.overhead_s += max(0.0, self.clock() - t_turn - gen_s)
            self.touch(s)
        if req.logprobs:
            reply.logprobs = logprobs_body(self.chat, c.ids, c.behav_logprobs, kind)
        return reply.answer(bool(req.stream))

    def _budget(self, req: Sampling, s: Session | None, prompt: list[int], kind: str) -> tuple[int, bool]:
        """``(completion budget, cut)``: the asked budget within the context and, in a session,
        ``max_session_tokens`` (``cut``: that limit lowered it). Raises ApiError 400 for no room."""
        if len(prompt) >= self.max_model_len:
            raise ApiError(
                400,
                f"messages: the prompt renders to {len(prompt)} tokens; the context limit is {self.max_model_len}",
                "messages" if kind == "chat" else "prompt",
            )
        budget = req.max_completion_tokens or req.max_tokens or self.default_max_tokens
        budget = min(budget, self.max_model_len - len(prompt), 65536)
        if s is not None and self.max_session_tokens is not None:
            room = self.max_session_tokens - len(prompt)
            if room < budget:
                return room, True
        return budget, False

    async def _sample(
        self, req: Sampling, s: Session | None, prompt: list[int], temperature: float, stop: list[str],
        budget: int, cut: bool,
    ) -> tuple[Completion, float]:  # fmt: skip
        """What the worker samples after ``prompt`` and the seconds it took; nothing (finish
        ``length``) when ``max_session_tokens`` leaves no room. Raises ApiError 400 or 503."""
        if budget < 1:  # max_session_tokens reached: nothing sampled, the session is truncated
            self.truncate(s)
            return Completion([], [], [], "length", self.backend.version()), 0.0
        stop_ids = sorted(self._single_stop_ids(stop))
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
            raise self.unavailable(e.reason, str(e)) from None
        gen_s = self.clock() - g0
        if t.finish_reason == "abort":
            raise self.unavailable("aborted", f"generation aborted: {t.info.get('error', 'worker stopped')}")
        p = t.prompt_len
        old = t.old_logprobs[p:].tolist() if t.old_logprobs is not None else None
        c = Completion(
            t.token_ids[p:].tolist(), t.behav_logprobs[p:].tolist(), t.versions[p:].tolist(), t.finish_reason,
            t.policy_version, old, t.served_fingerprint,
        )  # fmt: skip
        if cut and c.finish_reason == "length":
            self.truncate(s)
        return c, gen_s

    def _cut_at_stop(self, c: Completion, text: str, stop: list[str]) -> tuple[Completion, str]:
        """Cut the sampled ids after the first token whose text completes a stop string (kept as
        sampled); the text ends before the stop string. A single-token stop string the engine
        stopped on is left out of the text only."""
        if not any(x in text for x in stop):
            if c.ids and c.finish_reason == "stop" and c.ids[-1] in self._single_stop_ids(stop):
                return c, self.chat.decode(c.ids[:-1])
            return c, text
        for k in range(1, len(c.ids) + 1):
            part = self.chat.decode(c.ids[:k])
            hits = [part.find(x) for x in stop if x in part]
            if hits:
                return c.head(k, "stop"), part[: min(hits)]
        return c, text

    def _single_stop_ids(self, stop: list[str]) -> set[int]:
        return {i[0] for x in stop if len(i := self.chat.text_ids(x)) == 1}

    def _reply(
        self, req: Sampling, kind: str, s: Session | None, call_id: str, prompt_len: int, c: Completion,
        text: str, names: set[str] | None,
    ) -> Reply:  # fmt: skip
        """The reply to a call: tool calls parsed out of ``text`` when ``names`` are offered, or
        the text with an error note (``tool_call_feedback``) when one did not parse."""
        parsed = parse_tool_calls(text, names, f"call_{call_id}") if names is not None else None
        reply = Reply(
            kind, call_id, req.model or self.model_name, s.session_id if s else None, prompt_len, c, text,
            parsed.content if parsed else text, parsed.tool_calls if parsed else [], parsed.errors if parsed else [],
        )  # fmt: skip
        reply.tool_calls_parsed = len(reply.tool_calls)
        if reply.tool_errors and self.tool_call_feedback:  # the note follows the sampled text, no call returned
            reply.content, reply.tool_calls, reply.feedback = (
                with_error_note(text, tool_error_text(reply.tool_errors)),
                [],
                True,
            )
        return reply

    def _record(self, s: Session | None, prompt: list[int], r: Reply, key: list[tuple] | None) -> None:
        """Stitch the call into its session and count it (lock held). Raises ApiError 409 when
        the session ended while the call was served."""
        c = r.completion
        if s is not None and s.state != "open":
            raise ended(s.session_id, during=True)
        if s is not None and c.ids:
            before = s.splits
            s.stitch(r.call_id, prompt, c)
            s.last_ids, s.last_finish = c.ids, c.finish_reason
            reply = normalized({"role": "assistant", "content": r.content, "tool_calls": r.tool_calls})
            s.history = None if key is None else key + [reply]
            self.stats.splits += s.splits - before
        elif s is None:
            self.stats.untracked += 1
        self.stats.calls += 1
        self.stats.tokens += len(c.ids)
        self.stats.parsed += r.tool_calls_parsed
        self.stats.unparsed += len(r.tool_errors)
        self.stats.tool_errors += int(r.feedback)

    # --- the app -----------------------------------------------------------------------------------

    def app(self) -> FastAPI:
        """The FastAPI app of this gateway (:func:`rollout.gateway.router.gateway_app`)."""
        return gateway_app(self)


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

    @classmethod
    def from_config(cls, gateway: Gateway, config: GatewayConfig) -> GatewayServer:
        """The server of ``gateway`` on the ``[gateway]`` section's host, port and body limit (not started)."""
        return cls(gateway, config.host, config.port, max_body_bytes=config.max_body_bytes)
