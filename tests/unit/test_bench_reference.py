"""The reference-placement benchmark's figures, from hand-made run records (no run is started)."""

from __future__ import annotations

import math

import pytest

from benchmarks.bench_reference import placement_record, table


def test_a_placement_takes_medians_after_the_first_step_and_the_peaks_by_part():
    rows = [
        {"train_s": 30.0, "ref_forward_s": 4.0, "old_logits_s": 9.0},
        {"train_s": 9.0, "ref_forward_s": 2.0, "old_logits_s": 0.5},
        {"train_s": 5.0, "ref_forward_s": 1.0, "old_logits_s": 0.1},
        {"train_s": 7.0, "ref_forward_s": 3.0, "old_logits_s": 0.3},
    ]
    summary = {"state": "finished", "steps": 4, "loop_s_per_step": 8.5,
               "peak_rss_gib": {"learner": 7.5, "oldlogit": 3.9, "job": 18.0}}  # fmt: skip
    r = placement_record(summary, rows)
    assert (r["train_s_median"], r["ref_forward_s_median"], r["old_logits_s_median"]) == (7.0, 2.0, 0.3)
    assert (r["steps"], r["learner_gib"], r["oldlogit_gib"], r["job_gib"]) == (4, 7.5, 3.9, 18.0)
    empty = placement_record({}, [])
    assert math.isnan(empty["train_s_median"]) and empty["learner_gib"] is None
    text = table({"learner": r, "service": r})
    assert "| train_s_median | 7.000 | 7.000 |" in text and "| steps | 4 | 4 |" in text


def test_the_median_of_a_single_later_step_is_that_step():
    r = placement_record({}, [{"train_s": 1.0}, {"train_s": 2.5}])
    assert r["train_s_median"] == pytest.approx(2.5) and math.isnan(r["ref_forward_s_median"])


def test_a_job_memory_variant_takes_each_parts_peak_and_the_median_step_after_the_first():
    from benchmarks.bench_job_memory import VARIANTS, memory_record

    summary = {"state": "finished", "steps": 3, "loop_s_per_step": 12.0,
               "peak_rss_gib": {"learner": 8.5, "oldlogit": 3.4, "job": 19.6}}  # fmt: skip
    r = memory_record(summary, [{"train_s": 40.0}, {"train_s": 9.0}, {"train_s": 5.0}, {"train_s": 7.0}])
    assert (r["learner_gib"], r["oldlogit_gib"], r["job_gib"], r["workers_gib"]) == (8.5, 3.4, 19.6, None)
    assert (r["train_s_median"], r["loop_s_per_step"], r["steps"]) == (7.0, 12.0, 3)
    assert VARIANTS["both"] == VARIANTS["checkpointing"] + VARIANTS["kv1"]
