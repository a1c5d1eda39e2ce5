"""The gateway's settings: the ``[gateway]`` section of a job's config, passed whole to
:meth:`rollout.gateway.Gateway.from_config`, :meth:`rollout.gateway.WorkerBackend.from_config` and
:meth:`rollout.gateway.GatewayServer.from_config`. Unknown fields and non-finite numbers are refused,
as in every section. Imports nothing but pydantic."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretStr


class GatewayConfig(BaseModel):
    """The OpenAI-compatible gateway the agents call (started when ``[agent]`` is set)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    host: str = "127.0.0.1"
    """Bind address; loopback by default."""
    port: int = Field(0, ge=0, le=65535)
    """0 picks a free port (printed at start, written to ``<run_dir>/gateway.json``)."""
    token: SecretStr | None = Field(None, min_length=16)
    """Admin bearer token for ``POST /v1/sessions`` (at least 16 characters); ``None`` generates one.
    Either way it is written to ``<run_dir>/gateway.json`` (mode 0600) and redacted in ``config.resolved.json``."""
    max_body_bytes: int = Field(8 << 20, ge=1024, le=1 << 30)
    """Largest request body accepted (413 above it): a whole conversation with its tool schemas."""
    max_session_tokens: int | None = Field(None, ge=2)
    """Most tokens one trajectory of a session may hold; a call beyond it ends with ``length`` and the session
    is reported truncated. ``None``: the engine's context length."""
    max_tokens: int | None = Field(None, ge=1)
    """Completion budget of a call that gives none; ``None``: ``rollout.sampling.max_tokens``."""
    model_name: str = "vintage"
    """Model id listed by ``GET /v1/models`` (calls may name any model)."""
    tool_call_feedback: bool = True
    """Answer a reply holding a ``<tool_call>`` that does not parse as text with an error note after it
    (no ``tool_calls``; the model reads the note as a ``tool`` turn when the agent sends the reply back; the
    sampled tokens are trained on as sampled). ``false``: return the calls that parsed, leave the rest as text."""
    submit_timeout_s: float = Field(30.0, gt=0.0)
    """How long a call no rollout worker takes (every worker late, or none running) is submitted again,
    seconds; then it is answered 503 (``unavailable.not_taken``)."""
    call_timeout_s: float = Field(600.0, gt=0.0)
    """Longest wait for a taken call's result, seconds (its worker may have hung); then it is answered 503
    (``unavailable.timeout``) and its result, should it come later, is discarded. A call whose worker is
    found dead, hung or removed does not wait for this: it is submitted again at once."""
    group_wait_s: float = Field(120.0, gt=0.0, allow_inf_nan=False)
    """Longest wait, seconds, for a GRPO group of ``rollout.sampling.n`` sessions to fill after its first session
    ended; then its ended sessions are trained on anyway, each trajectory with a baseline (the mean reward of
    the group's other sessions, or for a session alone the mean of the last 32 sessions' rewards; see
    ``rollout.gateway.groups``), counted in ``groups_partial``. A session opened without a ``group_id`` is
    such a group of one at once."""
    session_idle_s: float | None = Field(600.0, gt=0.0, allow_inf_nan=False)
    """End a session with no call running and no request (call, reward) for this many seconds, dropped as
    ``idle`` and never trained on: its agent is gone, and an open session holds its place under the staleness
    admission rule (enough of them would admit no new session again). ``None``: never."""
