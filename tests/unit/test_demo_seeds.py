"""benchmarks.demo_seeds bookkeeping on hand-made run folders."""

from __future__ import annotations

import json
import math

from benchmarks.demo_seeds import main, seed_record, summarize


def run_folder(root, seed, before, after, state="finished", rows=()):
    d = root / f"demo-s{seed}"
    d.mkdir(parents=True)
    summary = {"state": state, "end_reason": "total_steps", "steps": 40, "wall_s": 880.0,
               "reward_before": {"success_rate": before}, "reward_after": {"success_rate": after}}  # fmt: skip
    (d / "summary.json").write_text(json.dumps(summary))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_seed_record_reads_the_collapse_signals(tmp_path):
    rows = [
        {"reward_mean": 0.2, "entropy": 2.0, "clip_frac_step_max": 0.1, "ratio_max": 1.5, "grad_norm": 3.0, "zero_variance_groups": 0},
        {"reward_mean": 0.6, "entropy": 0.5, "clip_frac_step_max": 0.3, "ratio_max": 9.0, "grad_norm": 39.0, "zero_variance_groups": 2},
        {"loaded": True},  # a row without a reward (not a step) is left out
    ]  # fmt: skip
    rec = seed_record(3, run_folder(tmp_path, 3, 0.25, 0.5, rows=rows))
    assert rec["gain"] == 0.25 and rec["steps"] == 40
    assert (rec["entropy_min"], rec["clip_frac_step_max"], rec["ratio_max"], rec["grad_norm_max"]) == (
        0.5,
        0.3,
        9.0,
        39.0,
    )
    assert rec["zero_variance_groups"] == 2 and rec["batch_reward_last5"] == 0.4


def test_median_range_and_runs_above_start(tmp_path):
    for seed, (b, a) in enumerate([(0.2, 0.3), (0.3, 0.6), (0.25, 0.75), (0.3, 0.1)], start=1):
        run_folder(tmp_path, seed, b, a)
    run_folder(tmp_path, 9, 0.2, math.nan, state="failed")
    records = [seed_record(s, tmp_path / f"demo-s{s}") for s in (1, 2, 3, 4, 9)]
    s = summarize(records)
    # gains 0.1, 0.3, 0.5, -0.2 (the failed seed is left out): median 0.2, 3 of 4 above
    assert s["runs"] == 4 and s["above_start"] == 3 and s["seeds"] == [1, 2, 3, 4]
    assert (
        math.isclose(s["gain_median"], 0.2) and math.isclose(s["gain_min"], -0.2) and math.isclose(s["gain_max"], 0.5)
    )
    assert math.isclose(s["after_median"], 0.45) and s["after_min"] == 0.1


def test_finished_seeds_are_read_not_run_again(tmp_path):
    run_folder(tmp_path / "runs", 1, 0.2, 0.6)
    result = main([1], tmp_path / "out", tmp_path / "runs")
    assert result["summary"]["above_start"] == 1
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| 1 | 0.200 | 0.600 | +0.400 | 40 | 880 |" in table
    assert "1 of 1 runs ended above their start; gain median +0.400" in table
