"""Typed step metrics: the learner's float dict becomes one typed row, extras ride along, and the row
written to ``metrics.jsonl`` reads back with the same names."""

from __future__ import annotations

import pydantic
import pytest

from trainer.driver.records.metrics_log import MetricsLog, StepMetrics, read_metrics

LEARNER = {  # floats, as the learner sends them over Ray
    "version": 3.0,
    "consumed_version": 2.0,
    "applied": 1.0,
    "skipped_steps": 0.0,
    "loss": -0.125,
    "tokens": 96.0,
    "exact_token_fraction": 0.75,
    "mask_kept_fraction": 0.5,
    "zero_variance_groups": 1.0,
    "tokens_per_s": 48.0,
    "clip_frac_low": 0.25,
    "old_logits_s": 0.5,
    "train_s": 2.0,
}
DRIVER = {
    "reward_mean": 0.25,
    "reward_max": 1.0,
    "staleness_mean": 0.5,
    "staleness_max": 1,
    "staleness_hist": {0: 48, 1: 48},
    "publish_s": 1.5,
    "dropped_stale": 2,
}


def test_learner_floats_become_typed_fields_and_extras_ride_along():
    m = StepMetrics(**LEARNER, **DRIVER)
    assert (m.version, m.consumed_version, m.applied, m.skipped_steps, m.zero_variance_groups) == (3, 2, True, 0, 1)
    assert m.model_extra == {"clip_frac_low": 0.25, "dropped_stale": 2}
    assert m.row()["mask_kept_fraction"] == 0.5 and m.row()["clip_frac_low"] == 0.25


def test_a_missing_field_is_named():
    with pytest.raises(pydantic.ValidationError, match="reward_mean"):
        StepMetrics(**LEARNER, **{k: v for k, v in DRIVER.items() if k != "reward_mean"})


def test_row_round_trips_through_metrics_jsonl(tmp_path):
    log = MetricsLog(tmp_path)
    log.log(3, StepMetrics(**LEARNER, **DRIVER))
    log.close()
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert row["step"] == 3 and row["version"] == 3 and row["applied"] is True
    assert row["staleness_hist"] == {"0": 48, "1": 48} and row["exact_token_fraction"] == 0.75
    assert row["dropped_stale"] == 2 and row["zero_variance_groups"] == 1


class Recorder:
    def __init__(self):
        self.logged = []

    def log(self, step, scalars):
        self.logged.append((step, scalars))

    def close(self):
        pass


def test_eval_records_are_their_own_kind_and_reach_the_trackers_as_eval_names(tmp_path):
    from trainer.driver.records.heldout import eval_record

    tracker = Recorder()
    log = MetricsLog(tmp_path, [tracker])
    scores = {"reward": 0.375, "success_rate": 0.5, "episodes": 8, "version": 2}
    log.log_eval(eval_record("before", {**scores, "version": 0}, seconds=4.0, waited_s=4.0))
    log.log(3, StepMetrics(**LEARNER, **DRIVER))
    log.log_eval(eval_record("during", scores, seconds=3.0, waited_s=0.5))
    log.close()
    (step,) = read_metrics(tmp_path / "metrics.jsonl")  # the step rows only, as before
    assert step["step"] == 3 and "kind" not in step
    evals = read_metrics(tmp_path / "metrics.jsonl", kind="eval")
    assert [(e["step"], e["version"], e["tag"], e["held_out"], e["n"]) for e in evals] == [
        (0, 0, "before", 0.375, 8),
        (2, 2, "during", 0.375, 8),
    ]
    assert tracker.logged[2] == (
        2,
        {"eval/held_out": 0.375, "eval/success_rate": 0.5, "eval/n": 8.0, "eval/seconds": 3.0, "eval/waited_s": 0.5},
    )


def test_the_reward_plot_draws_the_held_out_curve_beside_the_batch_reward(tmp_path):
    from trainer.driver.records.heldout import eval_record
    from trainer.driver.records.metrics_log import held_out_series, plot_run

    log = MetricsLog(tmp_path)
    for v, r in ((0, 0.25), (2, 0.5)):
        log.log_eval(eval_record("x", {"reward": r, "success_rate": r, "episodes": 8, "version": v}, 1.0, 1.0))
        log.log(v + 1, StepMetrics(**LEARNER, **DRIVER))
    log.close()
    assert held_out_series(tmp_path / "metrics.jsonl") == ([0, 2], [0.25, 0.5], 8)
    assert [p.name for p in plot_run(tmp_path)] == ["reward.png", "staleness.png"]
