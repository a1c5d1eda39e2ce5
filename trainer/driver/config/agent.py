"""The ``[agent]`` and ``[gateway]`` sections: agents written against the OpenAI API and the
gateway they call (its section, :class:`rollout.gateway.config.GatewayConfig`, is the gateway's own
settings, passed to it whole)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from rollout.gateway.config import GatewayConfig
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


__all__ = ["AgentConfig", "GatewayConfig"]
