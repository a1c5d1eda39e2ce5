"""Answers of the gateway's OpenAI API: one :class:`Reply` per served call, as JSON or as a stream.

``stream`` sends the finished reply as server-sent events: a chat reply as one delta chunk and
one chunk with the finish reason and usage, a text reply as one chunk; then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi.responses import StreamingResponse

from rollout.gateway.session import Completion


@dataclass
class Reply:
    """Everything the answer to one call shows (``kind``: ``chat`` or ``text`` completions)."""

    kind: Literal["chat", "text"]
    call_id: str
    model: str
    session_id: str | None
    prompt_len: int
    """Prompt tokens as rendered (``usage.prompt_tokens``)."""
    completion: Completion
    text: str
    """The sampled text (cut at a stop string)."""
    content: str
    """What the agent reads as ``content`` (the text less parsed tool calls, or with an error note)."""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)
    logprobs: dict[str, Any] | None = None
    tool_calls_parsed: int = 0
    """``<tool_call>`` blocks that parsed (returned unless the reply is answered with an error note)."""
    feedback: bool = False
    """The reply is answered with a tool-call error note (``tool_call_feedback``)."""

    def finish_reason(self) -> str:
        """``tool_calls`` when tool calls are returned after a stop, else the completion's reason."""
        finish = self.completion.finish_reason
        return "tool_calls" if self.tool_calls and finish == "stop" else finish

    def body(self) -> dict[str, Any]:
        """The OpenAI ``chat.completion`` or ``text_completion`` object, with a ``vintage`` extra
        (``session_id``, ``call_id``, per-token ``versions``, ``tool_call_errors`` when any)."""
        n = len(self.completion.ids)
        extra: dict[str, Any] = {
            "session_id": self.session_id,
            "call_id": self.call_id,
            "versions": self.completion.versions,
        }
        if self.tool_errors:
            extra["tool_call_errors"] = self.tool_errors
        usage = {"prompt_tokens": self.prompt_len, "completion_tokens": n, "total_tokens": self.prompt_len + n}
        base = {"id": f"chatcmpl-{self.call_id}", "created": int(time.time()), "model": self.model}
        if self.kind == "text":
            choice = {"index": 0, "text": self.text, "logprobs": self.logprobs, "finish_reason": self.finish_reason()}
            return {**base, "object": "text_completion", "choices": [choice], "usage": usage, "vintage": extra}
        calls = self.tool_calls
        msg: dict[str, Any] = {"role": "assistant", "content": self.content if (self.content or not calls) else None}
        if calls:
            msg["tool_calls"] = calls
        choice = {"index": 0, "message": msg, "logprobs": self.logprobs, "finish_reason": self.finish_reason()}
        return {**base, "object": "chat.completion", "choices": [choice], "usage": usage, "vintage": extra}

    def answer(self, stream: bool) -> dict[str, Any] | StreamingResponse:
        """:meth:`body`, or with ``stream`` its server-sent events (see the module docstring)."""
        body = self.body()
        if not stream:
            return body
        return _sse([body]) if self.kind == "text" else _stream_chat(body)


def logprobs_body(chat: Any, ids: list[int], behav_logprobs: list[float], kind: str) -> dict[str, Any]:
    """OpenAI ``logprobs`` of the sampled tokens: ``{"content": [...]}`` (chat) or ``{"tokens",
    "token_logprobs", ...}`` (text); ``behav_logprobs`` (mu) in nats, no alternatives
    (``top_logprobs`` empty)."""
    toks = [chat.decode_token(i) if hasattr(chat, "decode_token") else chat.decode([i]) for i in ids]
    if kind == "text":
        return {"tokens": toks, "token_logprobs": behav_logprobs, "top_logprobs": None, "text_offset": None}
    return {
        "content": [
            {"token": t, "logprob": m, "bytes": list(t.encode()), "top_logprobs": []}
            for t, m in zip(toks, behav_logprobs, strict=True)
        ]
    }


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
