"""The ``[agent]`` and ``[gateway]`` sections: agents written against the OpenAI API and the
gateway they call."""

from __future__ import annotations

from typing import Any

from pydantic import Field, SecretStr

from trainer.driver.config.base import Section


class AgentConfig(Section):
    """Train an agent written against the OpenAI API: the job runs it against the gateway.

    ``path`` names ``async def run(task: dict, client: openai.AsyncOpenAI) -> float | dict``; a dict
    result carries the reward under ``"reward"``. Each call the agent makes is recorded token-in /
    token-out; each episode (one session) becomes one trajectory, or one per segment when the
    agent's history stops extending the rendered ids.
    """

    path: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """Import path ``package.module:run`` of the agent coroutine; ``None`` serves only agents that run
    elsewhere and open their own sessions (``POST /v1/sessions``), with no held-out evaluation."""
    concurrency: int = Field(8, ge=1, le=4096)
    """Most agent episodes running at once (training and evaluation each)."""
    tasks: str = "env"
    """Task source: ``"env"`` (task ``{"env": {"path", "kwargs"}, "seed": s}`` for the env seeds of
    ``[env]``: training seeds ``[0, train_seeds)``, held-out ``[train_seeds, train_seeds + eval_prompts)``)
    or a JSONL file of task objects (one per line; held-out tasks from ``eval_tasks``)."""
    eval_tasks: str | None = None
    """JSONL file of held-out tasks (with ``tasks`` a JSONL file); ``None``: the last ``env.eval_prompts`` lines."""
    task_fields: dict[str, Any] = Field(default_factory=dict)
    """Fields added to every task, training and held-out (a field the task already holds keeps its
    own value), e.g. ``{tool_latency_s = 10}`` for an agent that reads it."""
    timeout_s: float = Field(600.0, gt=0.0)
    """An episode still running after this many seconds is cancelled and its session dropped (``agent_timeout``)."""


class GatewayConfig(Section):
    """The OpenAI-compatible gateway the agents call (started when ``[agent]`` is set)."""

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
