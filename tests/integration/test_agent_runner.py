"""OpenAI-client agents through the gateway: the retail agent gives the in-process loop's tokens, and
the agent runner admits, collects and evaluates sessions with the buffer's accounting held.

The real rollout worker (tiny model, transformers engine), the real gateway over HTTP on
127.0.0.1 and the official ``openai`` client; no Ray or learner (the job's loop is covered elsewhere).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from protocol import EnvRef, RolloutRequest, SamplingParams
from rollout.agent import TemplateChatFormat
from rollout.agents import retail
from rollout.engine import EngineConfig, make_engine
from rollout.gateway import Gateway, GatewayServer, WorkerBackend
from rollout.worker import RolloutWorkerCore
from trainer.driver.config.schema import JobConfig
from trainer.driver.sources.agent_runner import AgentRunner
from trainer.driver.sources.buffer import TrajectoryBuffer

pytestmark = pytest.mark.integration
CTX = 1024
RETAIL = "rollout.envs.retail:RetailEnv"


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return make_engine(EngineConfig(kind="transformers", model_path=str(tiny_model_path), max_model_len=CTX))


@pytest.fixture(scope="module")
def chat(tiny_model_path):
    return TemplateChatFormat(AutoTokenizer.from_pretrained(tiny_model_path))


def test_retail_agent_through_the_gateway_gives_the_in_process_tokens(engine, chat):
    kwargs = {"level": "easy", "max_turns": 3}
    ref_core = RolloutWorkerCore(engine, chat=chat, worker_id="in-process")
    ref_core.submit(
        RolloutRequest(
            request_id="ref",
            group_id="g",
            env=EnvRef(path=RETAIL, kwargs=kwargs, seed=7),
            sampling=SamplingParams(max_tokens=10, seed=11),
        )
    )
    (ref,) = ref_core.run_until_idle()
    assert ref.info["turns"] == 3  # a random model never solves it: three turns, two observations between

    core = RolloutWorkerCore(engine, chat=chat)
    core.start()
    backend = WorkerBackend.over_core(core)
    gw = Gateway(backend, chat, CTX, default_max_tokens=10)
    server = GatewayServer(gw).start()
    try:
        s = gw.open_session(group_id="g")

        async def play():
            client = openai.AsyncOpenAI(
                base_url=f"{server.url}/sessions/{s.session_id}/v1", api_key=s.key, max_retries=0
            )
            try:  # the engine samples the same tokens: the same per-call seed as the in-process episode
                return await retail.run({"seed": 7, "env": {"kwargs": kwargs}, "sampling_seed": 11}, client)
            finally:
                await client.close()

        out = asyncio.run(play())
        (t,) = gw.end_session(s.session_id, reward=out["reward"]).trajectories
    finally:
        server.stop()
        backend.close()
        core.stop()
    assert (out["turns"], out["reward"]) == (3, ref.reward)
    assert t.token_ids.tolist() == ref.token_ids.tolist()
    assert t.loss_mask.tolist() == ref.loss_mask.tolist()
    assert t.versions.tolist() == ref.versions.tolist()
    assert t.turn_boundaries == ref.turn_boundaries and t.prompt_len == ref.prompt_len
    np.testing.assert_allclose(t.behav_logprobs, ref.behav_logprobs, atol=1e-6)
    assert gw.status().splits == 0


def test_agent_runner_admits_collects_and_evaluates_with_accounting(engine, chat, tiny_model_path):
    cfg = JobConfig.model_validate(
        {
            "model": {"path": "tiny"},
            "env": {"path": RETAIL, "kwargs": {"level": "easy", "max_turns": 2}, "train_seeds": 10, "eval_prompts": 3},
            "agent": {"path": "rollout.agents.retail:run", "concurrency": 4},
            "rollout": {"sampling": {"n": 2, "max_tokens": 4, "temperature": 1.0}},
            "controller": {"batch_groups": 1, "max_staleness": 0},
        }
    )
    core = RolloutWorkerCore(engine, chat=chat)
    core.start()
    version = {"v": 0}
    buffer = TrajectoryBuffer(capacity=64, max_staleness=0)
    runner = AgentRunner(cfg, core.submit, core.poll, lambda: version["v"], buffer, tiny_model_path, CTX)
    try:
        # admission at version 0, max_staleness 0, batch 1 group x 2: one group of 2 episodes
        assert runner.top_up() == 2 and buffer.submitted == 2
        assert runner.top_up() == 0
        admin = {"Authorization": f"Bearer {runner.gateway.admin_token}"}
        assert httpx.post(f"{runner.url}/v1/sessions", headers=admin, json={}).status_code == 429
        deadline = time.monotonic() + 60
        while runner.gateway.status().sessions_ended < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        got = runner.poll()
        assert len(got) == 2 and {t.group_id for t in got} == {"v0-t0"}
        for t in got:  # two calls per episode (max_turns 2), 4 tokens budget each
            assert (len(t.turn_boundaries), t.reward, t.info["turns"]) == (2, 0.0, 2)
            assert t.num_generated == sum(e - s for s, e in t.turn_boundaries) <= 8
            buffer.offer(t)
        assert len(buffer.take(2, consuming_version=0, group_size=2)) == 2 and buffer.accounting_ok()
        version["v"] = 1  # the learner moved on: room for one more group (an outside session takes one seat)
        r = httpx.post(f"{runner.url}/v1/sessions", headers=admin, json={"group_id": "outside"})
        assert r.status_code == 200
        assert runner.top_up() == 0  # one seat left, a group needs two
        runner.gateway.end_session(r.json()["id"])  # ended without calls: dropped, with its reason
        runner.poll()
        assert buffer.dropped["no_calls"] == 1 and buffer.submitted == 3 and buffer.accounting_ok()
        ev = runner.evaluate("after")
        assert (ev["episodes"], ev["failed"], ev["reward"], ev["success_rate"]) == (3, 0, 0.0, 0.0)
        assert runner.poll() == [] and buffer.accounting_ok()  # evaluation sessions are never trained on
    finally:
        runner.close()
        core.stop()
