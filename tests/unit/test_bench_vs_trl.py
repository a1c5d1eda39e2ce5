"""The vintage-vs-TRL benchmark's pure parts: the shared prompts and reward, TRL's config mapped from
vintage's, and the throughput/ratio bookkeeping. Needs no TRL (the benchmark itself does)."""

from __future__ import annotations

import math

import pytest

from benchmarks.trl_side import trl_config_kwargs
from benchmarks.vs_trl_shared import (
    EnvReward,
    completion_text,
    heldout_seeds,
    prompt_rows,
    side_record,
    summarize,
    table_markdown,
)
from trainer.driver.config.schema import load_config

ENV = "rollout.envs.reasoning_gym_env:ReasoningGymEnv"
KW = {"dataset": "basic_arithmetic", "level": "easy", "size": 2000}
SYSTEM = "You are a helpful assistant. Solve the task and finish with a line 'Answer: <answer>'."


def test_prompt_rows_are_the_env_reset_messages_of_each_seed():
    rows = prompt_rows(ENV, KW, [0, 1800, 3800])
    assert [r["seed"] for r in rows] == [0, 1800, 3800]
    assert rows[0]["prompt"] == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Calculate 0 + 4."}]
    assert rows[1]["prompt"][1] == {"role": "user", "content": "Calculate 2 + 5."}
    assert rows[2]["prompt"] == rows[1]["prompt"]  # seed 3800 picks task 3800 % 2000 = 1800


def test_env_reward_scores_trl_completions_by_seed():
    reward = EnvReward(ENV, KW)
    assert reward.__name__ == "env_reward"
    done = [[{"role": "assistant", "content": "Answer: 7"}], "Answer: 8", "2 + 5 = 7", "Answer: 4", "no idea"]
    # seed 1800 asks 2 + 5 (answer 7), seed 0 asks 0 + 4 (answer 4); a bare last number counts
    assert reward(prompts=None, completions=done, seed=[1800, 1800, 1800, 0, 0]) == [1.0, 0.0, 1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="seed: 1 seeds for 2 completions"):
        reward(completions=["a", "b"], seed=[0])


def test_completion_text_takes_the_last_message_or_the_string():
    assert completion_text("Answer: 3") == "Answer: 3"
    assert completion_text([{"role": "assistant", "content": "x"}]) == "x"
    assert completion_text([]) == ""


def test_heldout_seeds_follow_training_seeds_and_stay_inside_the_env():
    assert heldout_seeds(1800, 3, 2000) == [1800, 1801, 1802]
    assert heldout_seeds(1800, 200, 2000)[-1] == 1999
    assert heldout_seeds(5, 2, None) == [5, 6]
    with pytest.raises(ValueError, match=r"eval_prompts: 201 held-out seeds .* \(at most 200\)"):
        heldout_seeds(1800, 201, 2000)
    with pytest.raises(ValueError, match="eval_prompts: must be >= 1, got 0"):
        heldout_seeds(1800, 0, 2000)


def test_trl_config_mirrors_the_demo_config():
    cfg = load_config("deploy/configs/demo.toml")
    kw = trl_config_kwargs(cfg, "/tmp/out")
    # demo: 2 prompts x 8 samples, micro-batch 16, lr 5e-5, 48 tokens, T = 1, clip 1.0, fp32 learner
    assert kw["per_device_train_batch_size"] == 16 and kw["gradient_accumulation_steps"] == 1
    assert kw["num_generations"] == 8 and kw["max_completion_length"] == 48 and kw["temperature"] == 1.0
    # cosine from 5e-5 to 5e-6 over the 40 steps after 2 warm-up steps
    assert kw["learning_rate"] == 5e-5 and kw["lr_scheduler_type"] == "cosine_with_min_lr" and kw["warmup_steps"] == 2
    assert kw["lr_scheduler_kwargs"] == {"min_lr_rate": 0.1} and kw["max_steps"] == 40
    assert (kw["adam_beta1"], kw["adam_beta2"], kw["adam_epsilon"], kw["weight_decay"]) == (0.9, 0.999, 1e-8, 0.0)
    assert kw["optim"] == "adamw_torch_fused" and kw["max_grad_norm"] == 1.0
    assert kw["bf16"] is False and kw["beta"] == 0.0 and kw["num_iterations"] == 1
    assert (kw["epsilon"], kw["epsilon_high"], kw["loss_type"]) == (0.2, 0.28, "dapo")
    assert kw["use_vllm"] is False and kw["gradient_checkpointing"] is False and kw["shuffle_dataset"] is False
    assert kw["output_dir"] == "/tmp/out" and kw["seed"] == 0


def test_trl_config_splits_the_batch_into_micro_batches_and_refuses_what_trl_lacks():
    kw = trl_config_kwargs(load_config("deploy/configs/demo.toml", ["learner.micro_batch_size=4"]), "o")
    assert (kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"]) == (4, 4)  # 16 = 4 x 4
    with pytest.raises(ValueError, match="learner.micro_batch_size: 5 does not divide the batch of 16"):
        trl_config_kwargs(load_config("deploy/configs/demo.toml", ["learner.micro_batch_size=5"]), "o")
    with pytest.raises(ValueError, match="loss.advantage: 'rloo'"):
        trl_config_kwargs(load_config("deploy/configs/demo.toml", ['loss.method="ppo"']), "o")
    kw = trl_config_kwargs(load_config("deploy/configs/demo.toml", ['learner.dtype="bfloat16"']), "o")
    assert kw["bf16"] is True


def test_side_record_rates_from_counts_and_step_times():
    r = side_record(steps=4, samples=64, loop_s=40.0, step_end_s=[30.0, 40.0, 50.0, 60.0], tokens=1000)
    assert r["s_per_step"] == pytest.approx(10.0)  # 40 s / 4 steps
    assert (r["tokens"], r["tokens_per_s"]) == (1000, 25.0)  # 1000 tokens / 40 s
    assert r["s_per_step_steady"] == pytest.approx(10.0)  # (60 - 30) / 3
    assert r["samples_per_s"] == pytest.approx(1.6)  # 64 / 40
    assert r["samples_per_s_wall"] == pytest.approx(64 / 60)
    assert (r["first_step_s"], r["last_step_s"]) == (30.0, 60.0)
    one = side_record(steps=1, samples=16, loop_s=8.0, step_end_s=[50.0])
    assert one["s_per_step_steady"] is None and one["s_per_step"] == 8.0 and one["samples_per_s_wall"] == 0.32
    none = side_record(steps=0, samples=0, loop_s=0.0, step_end_s=[])
    assert none["s_per_step"] is None and none["samples_per_s"] is None and none["first_step_s"] is None
    assert none["tokens"] is None and none["tokens_per_s"] is None


def _side(tokens_per_s: float | None, reward: float | None, s_per_step: float = 10.0) -> dict:
    """A side whose completions per second are a tenth of its tokens per second."""
    samples = None if tokens_per_s is None else tokens_per_s / 10
    return {"tokens_per_s": tokens_per_s, "samples_per_s": samples, "samples_per_s_wall": 1.0,
            "s_per_step": s_per_step, "heldout": {"reward": reward, "success_rate": reward}}  # fmt: skip


def test_summarize_ratios_and_goal():
    q = summarize(_side(30.0, 0.30, 5.0), _side(20.0, 0.25, 10.0))
    assert q["tokens_per_s_ratio"] == 1.5  # 30 / 20
    assert q["samples_per_s_ratio"] == pytest.approx(1.5)  # 3 / 2
    assert q["s_per_step_ratio"] == pytest.approx(0.5)
    assert q["reward_diff"] == pytest.approx(0.05)
    assert q["goal_met"] is True
    assert summarize(_side(20.0, 0.5), _side(20.0, 0.5))["goal_met"] is True  # equal tokens/s and reward suffice
    assert summarize(_side(19.0, 0.30), _side(20.0, 0.25))["goal_met"] is False  # 0.95x
    assert summarize(_side(30.0, 0.20), _side(20.0, 0.25))["goal_met"] is False  # reward -0.05
    undefined = summarize(_side(24.0, 0.3), _side(None, None))
    assert undefined["tokens_per_s_ratio"] is None and undefined["reward_diff"] is None
    assert undefined["goal_met"] is False


def test_table_shows_both_sides_and_the_ratios():
    v = side_record(steps=4, samples=64, loop_s=40.0, step_end_s=[30.0, 40.0, 50.0, 60.0], tokens=1000)
    t = side_record(steps=2, samples=32, loop_s=40.0, step_end_s=[35.0, 55.0], tokens=800)
    v |= {"configuration": "async", "heldout": {"reward": 0.5, "success_rate": 0.5}}
    t |= {"configuration": "sync", "heldout": {"reward": 0.375, "success_rate": 0.25}}
    table = table_markdown({"vintage": v, "trl": t, "base": {"reward": 0.25}, "ratios": summarize(v, t)})
    assert "| completions / s (loop) | 1.60 | 0.80 | 2.00x |" in table
    assert "| completion tokens trained | 1000 | 800 |  |" in table
    assert "| completion tokens / s (loop) | 25.0 | 20.0 | 1.25x |" in table
    assert "| held-out reward (untrained: 0.250) | 0.500 | 0.375 | +0.125 |" in table
    assert "| s / step after the first | 10.00 | 20.00 |  |" in table
    assert math.isclose(summarize(v, t)["reward_diff"], 0.125)
