"""Request bodies of the gateway's OpenAI API, and the checks a call's sampling must pass.

Every refusal is an :class:`rollout.gateway.errors.ApiError` 400 naming the field as sent.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollout.gateway.errors import ApiError

GREEDY_TEMPERATURE = 1e-3
"""Temperature that stands in for ``temperature = 0`` outside training sessions (the engine needs T > 0)."""


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
    """One OpenAI chat message (``role``, ``content``, an assistant's ``tool_calls``, a tool's ``tool_call_id``)."""

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
    """One OpenAI ``tools`` entry (a function schema)."""

    type: Literal["function"] = "function"
    function: _ToolFunction


class Sampling(_Body):
    """The sampling fields shared by chat and text completions (as the OpenAI API names them)."""

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


class ChatRequest(Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str]


def _param(loc: tuple) -> str:
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def validate(model: type[BaseModel], body: Any) -> Any:
    """``model`` validated from ``body``. Raises ApiError 400 naming the first bad field (``messages[0].role``)."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        # union members add their type name to the location; drop it so the field is named as sent
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in ("str", "int"))))
        raise ApiError(400, f"{_param(loc)}: {err['msg']}", _param(loc)) from None


def finite(v: Any) -> bool:
    """True for an int or float (not a bool) that is finite."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def number(v: Any, name: str) -> float | None:
    """``v`` as a float (None stays None). Raises ApiError 400 naming ``name`` when not a finite number."""
    if v is None:
        return None
    if not finite(v):
        raise ApiError(400, f"{name}: must be a finite number, got {v!r}", name)
    return float(v)


async def read_json(request: Request, default: Any = None) -> Any:
    """The request's JSON object (``default`` for an empty body when given).

    Raises:
        ApiError: 400 when the body is not JSON or not a JSON object.
    """
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


def _refuse_unreproducible(req: Sampling) -> None:
    """Refuse sampling the learner cannot score (it reproduces plain temperature sampling only)."""
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


def sampling_choice(req: Sampling, train: bool, train_temperature: float) -> tuple[float, list[str]]:
    """``(temperature, stop strings)`` of a call; ``train``: the call belongs to a training session.

    A training session samples at ``train_temperature`` (the one the learner scores at); outside
    one, ``temperature = 0`` becomes :data:`GREEDY_TEMPERATURE`.

    Raises:
        ApiError: 400 for sampling the learner cannot reproduce, more than 4 or empty stop strings,
            or, in a training session, ``temperature`` 0 or other than ``train_temperature``.
    """
    _refuse_unreproducible(req)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4 or any(not x for x in stop):
        raise ApiError(400, f"stop: up to 4 non-empty strings, got {stop!r}", "stop")
    t = req.temperature
    if train:
        if t == 0:
            raise ApiError(
                400, "temperature: 0 (greedy) in a training session; importance ratios need T > 0", "temperature"
            )
        if t is not None and abs(t - train_temperature) > 1e-9:
            raise ApiError(
                400, f"temperature: {t} differs from the training temperature {train_temperature}", "temperature"
            )
        return train_temperature, stop
    if t is None:
        return train_temperature, stop
    return (GREEDY_TEMPERATURE if t == 0 else t), stop
