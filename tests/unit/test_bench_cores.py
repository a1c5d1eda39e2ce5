"""The cores benchmark's pure figures: the steady median, the load rule and one policy's ratios (hand values)."""

from __future__ import annotations

import math

import pytest

from benchmarks.bench_cores import LOAD_LIMIT, compare, readable, steady_median


def test_steady_median_leaves_the_warm_up_step_out():
    assert steady_median([9.0, 2.0, 4.0, 3.0]) == 3.0
    assert steady_median([9.0, 2.0, 4.0]) == 3.0  # median of [2, 4]
    assert steady_median([5.0]) == 5.0
    assert math.isnan(steady_median([]))


def test_readable_only_when_every_load_is_within_the_limit():
    assert LOAD_LIMIT == 2.5
    assert readable([0.4, 2.5]) and not readable([0.4, 2.51]) and readable([])


def test_compare_gives_both_ratios_against_their_goals():
    alone = {"learner_s": 10.0, "loads": [1.0, 1.2]}
    loop = {"learner_s": 10.5, "loop_over_learner": 1.05, "loop_s_per_step": 11.025, "completions_per_s": 1.45,
            "old_logits_s_per_step": 0.4, "loads": [1.1, 3.0]}  # fmt: skip
    c = compare(alone, loop)
    assert c["in_loop_over_alone"] == 1.05 and c["learner_goal_met"]  # 10.5 / 10 <= 1.1
    assert c["loop_over_learner"] == 1.05 and not c["loop_goal_met"]  # 1.05 > 1.02
    assert not c["readable"]  # one load of 3.0 > 2.5
    assert c["old_logits_s_per_step"] == 0.4
    slow = compare(
        {"learner_s": 10.0, "loads": [0.5]}, {**loop, "learner_s": 12.0, "loop_over_learner": 1.01, "loads": [0.5]}
    )
    assert (
        slow["in_loop_over_alone"] == 1.2
        and not slow["learner_goal_met"]
        and slow["loop_goal_met"]
        and slow["readable"]
    )


def test_the_spinning_policy_is_the_plan_with_libgomps_own_wait():
    from benchmarks.bench_cores import POLICIES, POLICY_ENV

    assert POLICIES["plan_spin"] == POLICIES["plan"]
    assert POLICY_ENV == {"plan_spin": {"GOMP_SPINCOUNT": "300000"}}


@pytest.mark.parametrize("policy", ["one_each", "threads", "plan", "plan_spin"])
def test_every_job_of_the_benchmark_is_a_valid_config(policy, tmp_path):
    from benchmarks.bench_cores import CONFIG, POLICIES, job_sets
    from trainer.driver.config.schema import load_config

    sets = [*job_sets("tiny", 8, 2, str(tmp_path)), *(o.format(cores=2) for o in POLICIES[policy])]
    cfg = load_config(CONFIG, sets)
    assert (cfg.controller.max_staleness, cfg.controller.eval_every, cfg.env.eval_prompts) == (2, 0, 0)
