"""benchmarks.demo_seeds bookkeeping on hand-made run folders (no run is started)."""

from __future__ import annotations

import json
import math

import pytest

import benchmarks.demo_seeds as demo_seeds
from benchmarks.demo_seeds import main, run_seed, seed_record, summarize


@pytest.fixture(autouse=True)
def no_real_runs(monkeypatch):
    """No test starts a real ``vintage run``: a test that expects a run replaces this with its own
    recorder."""
    monkeypatch.setattr(demo_seeds.subprocess, "run", lambda cmd, **kw: pytest.fail(f"would run {cmd}"))


def run_folder(root, seed, before, after, state="finished", rows=(), evals=(), name=None, **summary_extra):
    """A run folder as ``vintage run`` leaves it: ``summary.json`` and ``metrics.jsonl`` (the step
    ``rows``, then one ``kind = "eval"`` record per ``(version, success rate, tag)`` of ``evals``)."""
    d = root / (name or f"demo-s{seed}")
    d.mkdir(parents=True)
    summary = {"state": state, "end_reason": "total_steps", "steps": 40, "wall_s": 880.0,
               "reward_before": {"success_rate": before}, "reward_after": {"success_rate": after}, **summary_extra}  # fmt: skip
    (d / "summary.json").write_text(json.dumps(summary))
    records = [
        {"step": v, "kind": "eval", "tag": tag, "version": v, "held_out": s, "success_rate": s, "n": 64}
        for v, s, tag in evals
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*rows, *records]))
    return d


def steps(entropies, kl=None):
    """Step rows with these entropies (nats) and, when given, these ``kl_ref`` values."""
    return [
        {"step": i, "reward_mean": 0.5, "entropy": e, **({"kl_ref": kl[i]} if kl else {}), "filtered_groups": 3 * i}
        for i, e in enumerate(entropies)
    ]


def curve(*points):
    """``(version, success)`` pairs tagged before (first), after (last) and during (the rest)."""
    last = len(points) - 1
    return [(v, s, "before" if i == 0 else "after" if i == last else "during") for i, (v, s) in enumerate(points)]


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
    # no eval records: before (v0) and after (v40) from the summary are the evaluations
    assert (rec["best"], rec["best_version"], rec["holds"], rec["below_start"]) == (0.5, 40, True, False)
    assert rec["entropy_last"] == 0.5 and rec["filtered_groups"] is None and math.isnan(rec["kl_ref_last5"])


def test_a_run_that_peaks_and_falls_back_does_not_hold(tmp_path):
    # evals 0.20 (v0), 0.50 (v10), 0.84 (v20), 0.56 (v30), 0.48 (v40, after): best 0.84 at v20;
    # 0.48 < 0.84 - 0.08 = 0.76 so it does not hold; gain 0.48 - 0.20 = +0.28, above its start.
    # Entropy 1.2, 0.9, 0.3, 0.4, 0.35, 0.45 -> last 0.45, min 0.3; kl_ref of the last 5 steps
    # 0.02, 0.03, 0.04, 0.05, 0.06 -> 0.04 (the first step's 0.01 is left out).
    rows = steps([1.2, 0.9, 0.3, 0.4, 0.35, 0.45], kl=[0.01, 0.02, 0.03, 0.04, 0.05, 0.06])
    evals = curve((0, 0.20), (10, 0.50), (20, 0.84), (30, 0.56), (40, 0.48))
    rec = seed_record(1, run_folder(tmp_path, 1, 0.20, 0.48, rows=rows, evals=evals, filtered_groups=17))
    assert (rec["before"], rec["best"], rec["best_version"], rec["after"]) == (0.20, 0.84, 20, 0.48)
    assert rec["holds"] is False and rec["below_start"] is False
    assert math.isclose(rec["gain"], 0.28)
    assert (rec["entropy_last"], rec["entropy_min"]) == (0.45, 0.3)
    assert math.isclose(rec["kl_ref_last5"], 0.04)
    assert rec["filtered_groups"] == 17  # the summary's run total, not the last row's 15
    assert rec["evals"] == [[0, 0.20], [10, 0.50], [20, 0.84], [30, 0.56], [40, 0.48]]


def test_a_run_that_keeps_most_of_its_best_holds(tmp_path):
    # evals 0.25 (v0), 0.60 (v20), 0.70 (v30), 0.70 (v35), 0.64 (v40): best 0.70 at v30 (the tie goes to
    # the earlier version); 0.64 >= 0.62 holds; gain +0.39. filtered_groups from the last step row (3 * 2).
    evals = curve((0, 0.25), (20, 0.60), (30, 0.70), (35, 0.70), (40, 0.64))
    rec = seed_record(2, run_folder(tmp_path, 2, 0.25, 0.64, rows=steps([1.0, 0.8, 0.7]), evals=evals))
    assert (rec["best"], rec["best_version"], rec["holds"], rec["below_start"]) == (0.70, 30, True, False)
    assert math.isclose(rec["gain"], 0.39) and rec["filtered_groups"] == 6 and rec["entropy_last"] == 0.7


def test_holding_is_decided_at_exactly_best_minus_the_margin(tmp_path):
    # best 0.84, after 0.76 = 0.84 - 0.08: holds despite float rounding of the difference
    evals = curve((0, 0.20), (20, 0.84), (40, 0.76))
    assert seed_record(1, run_folder(tmp_path, 1, 0.20, 0.76, evals=evals))["holds"] is True


def test_a_run_below_its_start(tmp_path):
    evals = curve((0, 0.30), (20, 0.35), (40, 0.25))
    rec = seed_record(1, run_folder(tmp_path, 1, 0.30, 0.25, evals=evals))
    assert rec["below_start"] is True and rec["holds"] is False and rec["best_version"] == 20


def test_median_range_and_runs_above_start(tmp_path):
    for seed, (b, a) in enumerate([(0.2, 0.3), (0.3, 0.6), (0.25, 0.75), (0.3, 0.1)], start=1):
        run_folder(tmp_path, seed, b, a)
    run_folder(tmp_path, 9, 0.2, math.nan, state="failed")
    records = [seed_record(s, tmp_path / f"demo-s{s}") for s in (1, 2, 3, 4, 9)]
    s = summarize(records)
    # gains 0.1, 0.3, 0.5, -0.2 (the failed seed is left out): median 0.2, 3 of 4 above, 1 below
    assert s["runs"] == 4 and s["above_start"] == 3 and s["below_start"] == 1 and s["seeds"] == [1, 2, 3, 4]
    assert (
        math.isclose(s["gain_median"], 0.2) and math.isclose(s["gain_min"], -0.2) and math.isclose(s["gain_max"], 0.5)
    )
    assert math.isclose(s["after_median"], 0.45) and s["after_min"] == 0.1
    assert s["goals"]["every_run_holds"] is False  # the failed seed does not hold, nor does seed 4


def test_the_goals_are_met_when_every_run_holds_none_falls_and_gain_and_entropy_medians_are_high(tmp_path):
    # gains 0.39, 0.30, 0.25 (median 0.30, the goal's edge); each ends within 0.08 of its best (0.64 vs
    # 0.70, 0.50 vs 0.55, 0.45 vs 0.50); last-step entropies 0.7, 0.5, 0.9 (median 0.7)
    runs = [
        (1, [(0, 0.25), (20, 0.70), (40, 0.64)], 0.7),
        (2, [(0, 0.20), (20, 0.55), (40, 0.50)], 0.5),
        (3, [(0, 0.20), (20, 0.50), (40, 0.45)], 0.9),
    ]
    for seed, points, ent in runs:
        run_folder(tmp_path, seed, points[0][1], points[-1][1], rows=steps([1.5, ent]), evals=curve(*points))
    s = summarize([seed_record(seed, tmp_path / f"demo-s{seed}") for seed, _, _ in runs])
    assert s["hold"] == 3 and s["below_start"] == 0 and s["runs"] == 3
    assert math.isclose(s["gain_median"], 0.30) and s["entropy_last_median"] == 0.7
    assert s["goals"] == {
        "every_run_holds": True,
        "none_below_start": True,
        "gain_median": True,
        "entropy_last_median": True,
    }
    assert s["goals_met"] is True


def test_the_goals_fail_one_by_one(tmp_path):
    # seed 1 peaks at 0.84 and ends at 0.48 (does not hold, gain +0.28); seed 2 holds at +0.35; seed 3
    # ends below its start (0.30 -> 0.25). Gains 0.28, 0.35, -0.05: median 0.28 < 0.30. Last-step
    # entropies 0.45, 0.6, 0.2: median 0.45 < 0.5.
    runs = [
        (1, [(0, 0.20), (10, 0.50), (20, 0.84), (30, 0.56), (40, 0.48)], 0.45),
        (2, [(0, 0.25), (20, 0.62), (40, 0.60)], 0.6),
        (3, [(0, 0.30), (40, 0.25)], 0.2),
    ]
    for seed, points, ent in runs:
        run_folder(tmp_path, seed, points[0][1], points[-1][1], rows=steps([1.5, ent]), evals=curve(*points))
    s = summarize([seed_record(seed, tmp_path / f"demo-s{seed}") for seed, _, _ in runs])
    assert s["hold"] == 2 and s["below_start"] == 1 and math.isclose(s["gain_median"], 0.28)
    assert s["entropy_last_median"] == 0.45
    assert not any(s["goals"].values()) and s["goals_met"] is False


def test_finished_seeds_are_read_not_run_again(tmp_path):
    run_folder(tmp_path / "runs", 1, 0.2, 0.6, rows=steps([1.0, 0.6]), evals=curve((0, 0.2), (20, 0.7), (40, 0.6)))
    result = main([1], tmp_path / "out", tmp_path / "runs")
    assert result["summary"]["above_start"] == 1 and result["sets"] == [] and result["tag"] is None
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| seed | before | best (version) | after | holds | entropy (last / min) | gain |" in table
    assert "| 1 | 0.200 | 0.700 (v20) | 0.600 | no | 0.60 / 0.60 | +0.400 | 40 | 880 |" in table
    assert "1 of 1 runs ended above their start, 0 below; gain median +0.400" in table
    assert "0 of 1 runs hold (after >= best - 0.08); last-step entropy median 0.60 nats." in table
    assert "Goals NOT met: every run holds (0 of 1): NOT met; none below start: met;" in table


def test_seeds_whose_run_folder_is_gone_are_read_from_the_earlier_results_of_the_same_settings(tmp_path, monkeypatch):
    run_folder(tmp_path / "runs", 1, 0.2, 0.6, name="demo-new-s1", evals=curve((0, 0.2), (20, 0.7), (40, 0.6)))
    main([1], tmp_path / "out", tmp_path / "runs", tag="new")
    (tmp_path / "runs" / "demo-new-s1" / "summary.json").unlink()
    run_folder(tmp_path / "runs", 2, 0.3, 0.9, name="demo-new-s2", evals=curve((0, 0.3), (20, 0.9)))
    monkeypatch.setattr(demo_seeds.subprocess, "run", lambda cmd, **kw: pytest.fail(f"ran {cmd}"))
    result = main([1, 2], tmp_path / "out", tmp_path / "runs", tag="new")
    assert [(r["seed"], r["before"], r["best"], r["after"]) for r in result["seeds"]] == [
        (1, 0.2, 0.7, 0.6),
        (2, 0.3, 0.9, 0.9),
    ]
    assert result["summary"]["gain_median"] == pytest.approx(0.5)


def test_earlier_results_of_other_settings_are_not_read(tmp_path, monkeypatch):
    run_folder(tmp_path / "runs", 1, 0.2, 0.6, name="demo-new-s1")
    main([1], tmp_path / "out", tmp_path / "runs", tag="new")
    (tmp_path / "runs" / "demo-new-s1" / "summary.json").unlink()
    calls = []
    monkeypatch.setattr(demo_seeds.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    main([1], tmp_path / "out", tmp_path / "runs", sets=["loss.kl_coef=0.05"], tag="new")
    assert len(calls) == 1 and "loss.kl_coef=0.05" in calls[0]


def test_a_seed_recorded_as_failed_is_run_again(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(demo_seeds.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    run_folder(tmp_path / "runs", 1, 0.2, 0.6, name="demo-new-s1", state="failed")
    assert main([1], tmp_path / "out", tmp_path / "runs", tag="new")["seeds"][0]["state"] == "failed"
    (tmp_path / "runs" / "demo-new-s1" / "summary.json").unlink()
    main([1], tmp_path / "out", tmp_path / "runs", tag="new")
    assert len(calls) == 2 and "controller.seed=1" in calls[1]


def test_a_tag_names_the_folders_and_sets_are_recorded(tmp_path):
    run_folder(tmp_path / "runs", 1, 0.2, 0.6, name="demo-kl-s1")
    result = main([1], tmp_path / "out", tmp_path / "runs", sets=["loss.kl_coef=0.05"], tag="kl")
    assert result["seeds"][0]["state"] == "finished" and result["tag"] == "kl"
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["sets"] == ["loss.kl_coef=0.05"]
    assert saved["command"].endswith("--tag kl --set loss.kl_coef=0.05")


def test_a_run_gets_the_sets_before_the_benchmarks_own_and_records_them(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(demo_seeds.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    d = run_seed(4, tmp_path, sets=["loss.kl_coef=0.05", "controller.total_steps=20"], tag="kl")
    assert d == tmp_path / "demo-kl-s4"
    cmd = calls[0]
    assert cmd[1:3] == ["run", demo_seeds.CONFIG]
    assert cmd[3:7] == ["--set", "loss.kl_coef=0.05", "--set", "controller.total_steps=20"]
    assert cmd[7:9] == ["--set", "controller.seed=4"] and f'logging.run_dir="{d}"' in cmd
    assert json.loads((d / "demo_seeds.json").read_text()) == {
        "config": demo_seeds.CONFIG,
        "sets": ["loss.kl_coef=0.05", "controller.total_steps=20"],
    }


def test_a_runs_environment_is_added_to_this_processs_and_recorded(tmp_path, monkeypatch):
    envs = []
    monkeypatch.setattr(demo_seeds.subprocess, "run", lambda cmd, **kw: envs.append(kw["env"]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)  # conftest's environment defaults set one
    d = run_seed(2, tmp_path, tag="mem-mmap", env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert envs[0]["MALLOC_MMAP_THRESHOLD_"] == "65536" and envs[0]["OMP_NUM_THREADS"] == "1"
    recorded = json.loads((d / "demo_seeds.json").read_text())
    assert recorded == {"config": demo_seeds.CONFIG, "sets": [], "env": {"MALLOC_MMAP_THRESHOLD_": "65536"}}
    run_seed(3, tmp_path, tag="plain")
    assert "MALLOC_MMAP_THRESHOLD_" not in envs[1]
    assert "env" not in json.loads((tmp_path / "demo-plain-s3" / "demo_seeds.json").read_text())


def test_a_finished_run_of_other_sets_is_not_read_as_this_one(tmp_path):
    d = run_folder(tmp_path, 1, 0.2, 0.6, name="demo-kl-s1")
    (d / "demo_seeds.json").write_text(json.dumps({"config": demo_seeds.CONFIG, "sets": ["loss.kl_coef=0.1"]}))
    with pytest.raises(ValueError, match="loss.kl_coef=0.1"):
        run_seed(1, tmp_path, sets=["loss.kl_coef=0.05"], tag="kl")
    assert run_seed(1, tmp_path, sets=["loss.kl_coef=0.1"], tag="kl") == d


@pytest.mark.parametrize(
    ("sets", "tag"), [(["controller.seed=3"], None), (["logging.run_dir=x"], None), (["novalue"], None), ([], "a/b")]
)
def test_bad_sets_and_tags_are_refused_before_any_run(tmp_path, monkeypatch, sets, tag):
    monkeypatch.setattr(demo_seeds.subprocess, "run", lambda *a, **kw: pytest.fail("a run was started"))
    with pytest.raises(ValueError):
        main([1], tmp_path / "out", tmp_path / "runs", sets=sets, tag=tag)


def test_before_and_after_come_from_the_eval_records_where_the_summary_lacks_them(tmp_path):
    # a resumed run: the summary's before is the resumed segment's (v20, 0.5), not version 0's 0.2;
    # its after is absent, so the last evaluation tagged after (v40, 0.6) is read
    evals = [(0, 0.2, "before"), (20, 0.5, "before"), (40, 0.6, "after")]
    d = run_folder(tmp_path, 1, 0.5, None, evals=evals)
    rec = seed_record(1, d)
    assert (rec["before"], rec["after"], rec["best"], rec["best_version"]) == (0.2, 0.6, 0.6, 40)
    assert math.isclose(rec["gain"], 0.4) and rec["holds"] is True
