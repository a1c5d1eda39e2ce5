"""tau2-bench through the real gateway: the tiny model in vLLM behind it, tau2's agent in front.

The tiny random model never writes a valid tool
call, so rewards are 0 here; what is checked is the wiring: which calls reach the gateway, and that
a training session played by tau2 becomes trajectories whose loss mask covers exactly the sampled
tokens (user turns and the system prompt masked out) with a version on every sampled token.
"""

from __future__ import annotations

import asyncio

import numpy as np
import openai
import pytest

from protocol import NO_VERSION
from rollout.envs import tau2_bench as tb
from rollout.tau2_eval import evaluate, serve_model
from tests.scripted_openai import ScriptedServer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served(tiny_model_path):
    with serve_model(str(tiny_model_path), engine="vllm", max_model_len=2048, max_tokens=16) as s:
        yield s


def test_eval_through_gateway_untracked(served):
    base_url, key, gateway = served
    before = gateway.status().untracked_calls
    report = evaluate("mock", base_url, key, trials=1, task_ids=["create_task_1"], solo=True, progress=False)
    (ep,) = report["episodes"]
    # solo mode: the first reply is plain text, which tau2's solo agent refuses -> reward 0
    assert (ep["reward"], ep["termination_reason"]) == (0.0, "agent_error")
    assert ep["error"] == "ValueError: LLMSoloAgent only supports tool calls."
    # exactly one call reached the gateway, on the admin key: served, never trained on
    assert gateway.status().untracked_calls - before == 1
    assert gateway.take_ended() == []


def test_training_session_played_by_tau2(served):
    base_url, key, gateway = served
    # the session is opened and ended in process, as the gateway's agent runner does
    s = gateway.open_session()
    sess = {"id": s.session_id, "key": s.key, "base_url": f"{base_url.removesuffix('/v1')}/sessions/{s.session_id}/v1"}
    user = [{"content": "Please create a task."}, {"content": "Still there?"}, {"content": "Bye ###STOP###"}]
    with ScriptedServer({"usersim": user}) as us:
        task = tb.load_tasks("mock", task_ids=["create_task_1"], user={"model": "usersim", "base_url": us.base_url})[0]
        client = openai.AsyncOpenAI(base_url=sess["base_url"], api_key=sess["key"])
        out = asyncio.run(tb.run(task, client))
    # user, agent, user, agent, user(stop): two agent turns, both plain text
    assert (out["termination_reason"], out["agent_turns"], out["reward"]) == ("user_stop", 2, 0.0)
    calls = list(gateway.session(sess["id"]).calls)  # the gateway frees them when the session ends
    gateway.end_session(sess["id"], reward=out["reward"])
    (ended,) = gateway.take_ended()
    assert ended.dropped is None and ended.reward == 0.0
    assert len(calls) == 2
    assert len(ended.trajectories) == 1 + max(c.segment for c in calls)
    for i, t in enumerate(ended.trajectories):
        mine = [c for c in calls if c.segment == i]
        sampled = [tok for c in mine for tok in c.completion_ids]
        mask = t.loss_mask.astype(bool)
        # the loss mask covers exactly the sampled tokens, in order; everything else is context
        assert t.token_ids[mask].tolist() == sampled
        assert int(mask.sum()) == sum(len(c.completion_ids) for c in mine)
        # one version per token: 0 (no weight update happened) on sampled tokens, none on context
        assert len(t.versions) == len(t.token_ids)
        assert t.versions[mask].tolist() == [0] * len(sampled)
        assert np.all(t.versions[~mask] == NO_VERSION)
    # the user's second turn is in the trajectory holding the second call, masked out
    still = gateway.chat.tok.encode("Still there?", add_special_tokens=False)
    t = ended.trajectories[calls[1].segment]
    ids = t.token_ids.tolist()
    at = [j for j in range(len(ids)) if ids[j : j + len(still)] == still]
    assert len(at) == 1 and t.loss_mask[at[0] : at[0] + len(still)].tolist() == [0] * len(still)
