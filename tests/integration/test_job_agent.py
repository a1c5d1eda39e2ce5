"""A short job that trains an OpenAI-client agent through the gateway: real Ray, DeepSpeed, HTTP.

The retail agent (``rollout.agents.retail:run``) on the tiny model: the job admits sessions under
the staleness rule, trains on the ended sessions and scores held-out tasks before and after with
the same agent; the accounting holds for sessions and trajectories alike.
"""

from __future__ import annotations

import pytest

from trainer.driver.config.schema import load_config
from trainer.driver.loop.job import run_job

pytestmark = pytest.mark.integration


def test_job_trains_an_agent_through_the_gateway(tmp_path, tiny_model_path, ray_cluster):
    cfg = load_config(
        "deploy/configs/agent-retail.toml",
        [
            'model.path="tiny"',
            'rollout.engine="transformers"',
            "rollout.sampling.max_tokens=6",
            "rollout.sampling.n=2",
            'env.kwargs={level = "easy", max_turns = 2}',
            "env.eval_prompts=2",
            "agent.concurrency=4",
            "controller.total_steps=2",
            "controller.batch_groups=1",
            "controller.max_staleness=1",
            "controller.time_budget_s=600",
            "learner.micro_batch_size=4",
            "learner.lr=1e-4",
            f'logging.run_dir="{tmp_path}"',
            "logging.trackers=[]",
            "logging.plots=false",
        ],
    )
    s = run_job(cfg)
    g = s["gateway"]
    assert (s["state"], s["steps"], s["accounting_ok"]) == ("finished", 2, True)
    assert s["consumed"] == 2 * 2  # two steps of one group of two sessions, no splits
    for tag in ("reward_before", "reward_after"):
        assert (s[tag]["episodes"], s[tag]["failed"]) == (2, 0)
    # every session the gateway opened ended or is open; training sessions became one trajectory each
    assert g["sessions_opened"] == g["sessions_open"] + g["sessions_ended"]
    assert g["sessions_ended"] == g["sessions_emitted"] + sum(g["sessions_dropped"].values())
    assert g["splits"] == 0 and g["sessions_refused"] == 0
    # no splits: one admitted session is one generated trajectory; held-out sessions (2 before, 2 after) are extra
    assert g["sessions_opened"] == s["generated"] + 2 + 2
    assert s["generated"] == g["trajectories_emitted"] + g["sessions_open"] + sum(g["sessions_dropped"].values())
    assert (tmp_path / "gateway.json").stat().st_mode & 0o777 == 0o600
