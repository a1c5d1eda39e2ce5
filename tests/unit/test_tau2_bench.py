"""tau2-bench through the adapter: tau2's own orchestrator and evaluator, scripted models over HTTP.

The agent's and the user's "LLMs" are a scripted OpenAI-compatible server on 127.0.0.1; everything
else (tau2's LLMAgent/UserSimulator, litellm, the mock domain's tools and database, the evaluator)
is real. Rewards are tau2's: 1.0 exactly when the final DB equals the one the gold actions produce
(and the other parts of the task's reward basis hold).
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from rollout.envs import tau2_bench as tb
from tests.scripted_openai import ScriptedServer

GOLD_CREATE = ("create_task", {"user_id": "user_1", "title": "Important Meeting"})
USER = [{"content": "Please create a task called 'Important Meeting' for user_1."}, {"content": "Thanks! ###STOP###"}]


def _play(scripts, task_kwargs, task_id="create_task_1"):
    with ScriptedServer(scripts) as s:
        kw = dict(task_kwargs)
        if not kw.get("solo"):
            kw["user"] = {"model": "usersim", "base_url": s.base_url}
        task = tb.load_tasks("mock", task_ids=[task_id], **kw)[0]
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key="test-key")
        out = asyncio.run(tb.run(task, client))
        return out, s.requests


def test_gold_actions_score_one():
    out, reqs = _play({"policy": [{"tool_calls": [GOLD_CREATE]}, {"content": "Done."}], "usersim": list(USER)}, {})
    assert out["reward"] == 1.0
    assert out["termination_reason"] == "user_stop"
    assert out["reward_basis"] == ["DB", "COMMUNICATE"]
    assert out["reward_breakdown"] == {"DB": 1.0, "COMMUNICATE": 1.0}
    assert out["db_match"] is True
    assert out["tool_calls"] == [{"name": "create_task", "arguments": GOLD_CREATE[1]}]
    assert out["agent_turns"] == 2  # the model's two turns; tau2's fixed greeting is not one
    # request order: user opens, agent calls the tool, agent answers after the tool result, user stops
    assert [r["model"] for r in reqs] == ["usersim", "policy", "policy", "usersim"]
    first = reqs[1]
    assert first["messages"][0]["role"] == "system" and "<policy>" in first["messages"][0]["content"]
    assert {t["function"]["name"] for t in first["tools"]} == {
        "create_task",
        "get_users",
        "update_task_status",
        "transfer_to_human_agents",
    }
    assert first["temperature"] == 1.0
    assert [m["role"] for m in reqs[2]["messages"]] == ["system", "assistant", "user", "assistant", "tool"]


def test_wrong_action_scores_zero():
    wrong = ("create_task", {"user_id": "user_1", "title": "Unimportant Meeting"})
    out, _ = _play({"policy": [{"tool_calls": [wrong]}, {"content": "Done."}], "usersim": list(USER)}, {})
    assert out["reward"] == 0.0
    assert out["termination_reason"] == "user_stop"
    assert out["reward_breakdown"] == {"DB": 0.0, "COMMUNICATE": 1.0}
    assert out["db_match"] is False


def test_solo_mode_gold_and_extra_write():
    """Solo: the agent works from the ticket and ends with tau2's `done` tool; no user model at all."""
    gold = ("update_task_status", {"task_id": "task_1", "status": "completed"})
    out, reqs = _play(
        {"policy": [{"tool_calls": [gold]}, {"tool_calls": [("done", {})]}]}, {"solo": True}, "update_task_1"
    )
    assert (out["reward"], out["termination_reason"]) == (1.0, "agent_stop")
    assert [r["model"] for r in reqs] == ["policy", "policy"]
    assert "<ticket>" in reqs[0]["messages"][0]["content"] and reqs[0]["tool_choice"] == "required"
    # the gold write, then a second write that changes the DB: the final state no longer matches
    extra = ("create_task", {"user_id": "user_1", "title": "Extra"})
    out, _ = _play(
        {"policy": [{"tool_calls": [gold]}, {"tool_calls": [extra]}, {"tool_calls": [("done", {})]}]},
        {"solo": True},
        "update_task_1",
    )
    assert (out["reward"], out["db_match"]) == (0.0, False)


def test_empty_reply_is_an_agent_error_scored_zero():
    out, _ = _play({"policy": [{"content": ""}], "usersim": list(USER)}, {})
    assert out["reward"] == 0.0 and out["termination_reason"] == "agent_error"
    assert "AssistantMessage must have either content or tool calls" in out["error"]


def test_http_failure_is_raised_not_scored():
    with pytest.raises(tb.ModelCallError, match="InternalServerError"):
        _play({"usersim": list(USER)}, {})  # the agent's model has no script: HTTP 500


def test_load_tasks_trials_solo_filter_and_errors():
    tasks = tb.load_tasks("mock", trials=2, solo=True)
    # tau2's solo rule: a ticket and gold actions, or an initial state with no user turn in its
    # history. Of the 9 mock tasks, 3 fail it: the NL-only one (no actions) and the two whose
    # history opens with a user message.
    solo_ids = [
        "create_task_1",
        "create_task_1_with_env_assertions",
        "update_task_1",
        "update_task_with_initialization_data",
        "update_task_with_initialization_actions",
        "impossible_task_1",
    ]
    assert [t["task_id"] for t in tasks] == solo_ids * 2
    assert [t["trial"] for t in tasks] == [0] * 6 + [1] * 6
    with pytest.raises(ValueError, match="domain: 'shop'"):
        tb.load_tasks("shop", solo=True)
    with pytest.raises(ValueError, match=r"task_ids: \['nope'\]"):
        tb.load_tasks("mock", task_ids=["nope"], solo=True)
    with pytest.raises(ValueError, match="user: a user simulator model is required"):
        tb.load_tasks("mock", task_ids=["create_task_1"])
    with pytest.raises(ValueError, match="temperature"):
        tb.load_tasks("mock", task_ids=["create_task_1"], solo=True, temperature=0.0)
    assert len(tb.load_tasks("retail", split="test", user={"model": "u", "base_url": "http://x/v1"})) == 40


def test_task_source_seeds_to_tasks():
    src = tb.Tau2TaskSource(domains=["mock"], heldout_from=100, solo=True)
    # 6 solo mock tasks in both pools (the mock domain has no split)
    assert (len(src.train), len(src.held_out)) == (6, 6)
    pick = [(src.task(s)["task_id"], src.task(s)["trial"]) for s in (0, 7, 100, 113)]
    assert pick == [
        ("create_task_1", 0),
        ("create_task_1_with_env_assertions", 1),  # 7 = 1 * 6 + 1
        ("create_task_1", 0),
        ("create_task_1_with_env_assertions", 2),  # 113 - 100 = 13 = 2 * 6 + 1
    ]
    user = {"model": "u", "base_url": "http://127.0.0.1:9/v1"}
    r = tb.Tau2TaskSource(["retail", "airline"], 1000, "train", "test", user=user, temperature=0.7)
    # retail 74 train + airline 30 train; retail 40 test + airline 20 test
    assert (len(r.train), len(r.held_out)) == (104, 60)
    assert (r.task(74)["domain"], r.task(74)["split"]) == ("airline", "train")
    assert (r.task(1060)["task_id"], r.task(1060)["trial"]) == (r.held_out[0]["task_id"], 1)
    assert r.task(5)["temperature"] == 0.7
    with pytest.raises(ValueError, match="heldout_from"):
        tb.Tau2TaskSource(["mock"], 0, solo=True)


def test_env_seeded_task_through_run():
    """The job's ``tasks = "env"`` form: ``{"env": {"path", "kwargs"}, "seed"}`` -> task of that seed."""
    gold = ("create_task", {"user_id": "user_1", "title": "Important Meeting"})
    task = {
        "env": {
            "path": "rollout.envs.tau2_bench:Tau2TaskSource",
            "kwargs": {"domains": ["mock"], "heldout_from": 100, "solo": True},
        },
        "seed": 6,  # 6 % 6 = 0: create_task_1, trial 1
    }
    with ScriptedServer({"policy": [{"tool_calls": [gold]}, {"tool_calls": [("done", {})]}]}) as s:
        out = asyncio.run(tb.run(task, openai.AsyncOpenAI(base_url=s.base_url, api_key="k")))
    assert (out["task_id"], out["trial"], out["reward"]) == ("create_task_1", 1, 1.0)
