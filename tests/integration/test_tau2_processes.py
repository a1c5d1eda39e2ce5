"""tau2 episodes in spawned worker processes (``VINTAGE_TAU2_PROCESSES``), scripted models over HTTP.

Each worker process imports tau2 and litellm (~5-15 s here), so this lives with the integration tests.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from rollout.envs import tau2_bench as tb
from tests.scripted_openai import ScriptedServer

pytestmark = pytest.mark.integration


def test_episodes_in_worker_processes(monkeypatch):
    """``VINTAGE_TAU2_PROCESSES``: the same episodes, played in spawned processes, score the same."""
    monkeypatch.setenv("VINTAGE_TAU2_PROCESSES", "2")
    monkeypatch.setattr(tb, "_POOL", None)
    gold = ("update_task_status", {"task_id": "task_1", "status": "completed"})
    wrong = ("update_task_status", {"task_id": "task_1", "status": "pending"})
    done = {"tool_calls": [("done", {})]}
    scripts = {"gold": [{"tool_calls": [gold]}, done], "wrong": [{"tool_calls": [wrong]}, done]}

    async def both(base_url):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="k")
        tasks = [tb.load_tasks("mock", task_ids=["update_task_1"], solo=True, agent_model=m)[0] for m in scripts]
        tasks.append({**tasks[0], "agent_model": "unscripted"})
        return await asyncio.gather(*(tb.run(t, client) for t in tasks), return_exceptions=True)

    try:
        with ScriptedServer(scripts) as s:
            good, bad, failed = asyncio.run(both(s.base_url))
    finally:
        tb._POOL.shutdown()
    assert (good["reward"], good["db_match"]) == (1.0, True)
    assert (bad["reward"], bad["db_match"]) == (0.0, False)
    assert isinstance(failed, tb.ModelCallError) and "InternalServerError" in str(failed)
