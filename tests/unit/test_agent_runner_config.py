"""The [agent] config section and the agent runner's pure helpers (no model, no server)."""

from __future__ import annotations

import json

import pydantic
import pytest

from trainer.driver.config.schema import JobConfig, load_config
from trainer.driver.sources.agent_runner import episode_reward, load_agent, read_tasks, task_sources


def test_agent_section_defaults_and_bad_path():
    cfg = JobConfig.model_validate({"agent": {"path": "rollout.agents.retail:run"}})
    assert (cfg.agent.concurrency, cfg.agent.tasks, cfg.gateway.host, cfg.gateway.port) == (8, "env", "127.0.0.1", 0)
    assert JobConfig().agent is None
    assert JobConfig.model_validate({"agent": {}}).agent.path is None  # outside agents only
    with pytest.raises(pydantic.ValidationError, match="agent.path"):
        JobConfig.model_validate({"agent": {"path": "not a path"}})
    with pytest.raises(pydantic.ValidationError, match="agent.concurrency"):
        JobConfig.model_validate({"agent": {"path": "a.b:c", "concurrency": 0}})


def test_gateway_waits_and_tool_call_feedback_settings():
    g = JobConfig().gateway
    assert (g.tool_call_feedback, g.submit_timeout_s, g.call_timeout_s) == (True, 30.0, 600.0)
    g = load_config(None, ["gateway.tool_call_feedback=false", "gateway.submit_timeout_s=2.5"]).gateway
    assert (g.tool_call_feedback, g.submit_timeout_s) == (False, 2.5)
    for field in ("submit_timeout_s", "call_timeout_s"):
        with pytest.raises(pydantic.ValidationError, match=f"gateway.{field}"):
            load_config(None, [f"gateway.{field}=0"])


def test_shipped_agent_config_loads():
    cfg = load_config("deploy/configs/agent-retail.toml")
    assert cfg.agent.path == "rollout.agents.retail:run" and cfg.model.path == "smollm2"
    assert cfg.rollout.sampling.n == 4 and cfg.gateway.max_session_tokens == 1024


async def _agent(task, client):
    return 1.0


def _sync(task, client):
    return 1.0


def test_load_agent_checks_the_signature():
    assert load_agent("rollout.agents.retail:run").__name__ == "run"
    with pytest.raises(ValueError, match="agent.path: .* is not an async function"):
        load_agent(f"{__name__}:_sync")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        load_agent("rollout.agents.retail:nope")


def test_episode_reward_reads_numbers_and_dicts():
    assert episode_reward(1) == 1.0 and episode_reward({"reward": 0.25, "turns": 3}) == 0.25
    for bad in (float("nan"), "1", {"score": 1.0}, True, None):
        with pytest.raises(ValueError, match="agent result"):
            episode_reward(bad)


def test_task_sources_env_and_jsonl(tmp_path):
    cfg = JobConfig.model_validate(
        {
            "env": {
                "path": "rollout.envs.retail:RetailEnv",
                "kwargs": {"level": "easy"},
                "train_seeds": 5,
                "eval_prompts": 2,
            },
            "agent": {"path": "a.b:c"},
        }
    )
    train, held = task_sources(cfg)
    env = {"path": "rollout.envs.retail:RetailEnv", "kwargs": {"level": "easy"}}
    assert [train(i)["seed"] for i in (0, 4, 5, 7)] == [0, 4, 0, 2] and train(0)["env"] == env
    assert held == [{"env": env, "seed": 5}, {"env": env, "seed": 6}]
    f = tmp_path / "tasks.jsonl"
    f.write_text("\n".join(json.dumps({"id": i}) for i in range(5)) + "\n\n")
    cfg2 = cfg.model_copy(update={"agent": cfg.agent.model_copy(update={"tasks": str(f)})})
    train, held = task_sources(cfg2)
    assert [train(i)["id"] for i in range(4)] == [0, 1, 2, 0] and held == [{"id": 3}, {"id": 4}]
    fields = cfg2.agent.model_copy(update={"task_fields": {"tool_latency_s": 10, "id": -1}})
    train, held = task_sources(cfg2.model_copy(update={"agent": fields}))
    assert train(1) == {"tool_latency_s": 10, "id": 1} and held[0] == {"tool_latency_s": 10, "id": 3}
    fields = cfg.agent.model_copy(update={"task_fields": {"tool_latency_s": 2.5}})
    train, held = task_sources(cfg.model_copy(update={"agent": fields}))
    assert train(6) == {"tool_latency_s": 2.5, "env": env, "seed": 1} and held[1]["tool_latency_s"] == 2.5
    f.write_text('{"id": 1}\n[2]\n')
    with pytest.raises(ValueError, match=r"tasks.jsonl:2 is not a JSON object"):
        read_tasks(str(f))


def test_gateway_token_is_secret_and_long_enough(tmp_path):
    from trainer.driver.config.schema import write_resolved

    cfg = JobConfig.model_validate({"agent": {"path": "a.b:c"}, "gateway": {"token": "t" * 20}})
    assert cfg.gateway.token.get_secret_value() == "t" * 20
    assert "t" * 20 not in write_resolved(cfg, tmp_path).read_text()
    with pytest.raises(pydantic.ValidationError, match="gateway.token"):
        JobConfig.model_validate({"gateway": {"token": "short"}})
