"""The methods benchmark's paired comparison (``paired.md``) and the ``verdict`` grid, on hand-made
cell records; every expected number is worked by hand in the comment beside it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.methods_grid import binomial_se, grid, heldout_curve_score, paired_ci95
from benchmarks.methods_report import heldout_prompts, paired_markdown, paired_rows, report, run_scores

T_2DOF = 4.302653  # t(0.975, 2): Student's t quantile for 3 seeds


def rec(method: str, seed: int, after: float, *, evals=None, batch=None, n=None, extra=(), collapsed=False) -> dict:
    """A finished cell record with only what the paired comparison reads."""
    r = {"cell": f"{method}-W2-bf16-s{seed}-t", "method": method, "W": 2, "disc": "bf16", "seed": seed, "tag": "t"}
    r |= {"steps": 20, "steps_done": 20, "state": "finished", "reward_after_heldout": after, "collapsed": collapsed}
    r |= {"extra": list(extra), "curves": {"reward_mean": list(batch or [])}}
    if evals is not None:
        r["heldout_evals"] = [{"version": v, "tag": "during", "held_out": x, "n": n} for v, x in evals]
    if n is not None:
        r["heldout_n"] = n
    return r


def test_paired_t_interval_on_three_seeds():
    x = {0: 0.5, 1: 0.6, 2: 0.9, 3: 0.7}  # seed 3: the baseline has none, so it is not paired
    y = {0: 0.4, 1: 0.4, 2: 0.6, 4: 0.1}
    p = paired_ci95(x, y)
    # d = 0.5 - 0.4, 0.6 - 0.4, 0.9 - 0.6 = 0.1, 0.2, 0.3; mean 0.6 / 3 = 0.2;
    # sd = sqrt(((-0.1)^2 + 0^2 + 0.1^2) / 2) = sqrt(0.01) = 0.1; half-width 4.302653 * 0.1 / sqrt(3) = 0.248414.
    assert p["seeds"] == [0, 1, 2]
    assert p["diffs"] == pytest.approx([0.1, 0.2, 0.3])
    assert p["mean"] == pytest.approx(0.2)
    assert p["ci95"] == pytest.approx(T_2DOF * 0.1 / math.sqrt(3), rel=1e-6)
    assert p["ci95"] == pytest.approx(0.248414, abs=1e-6)
    # one common seed: a difference, no interval; a NaN score leaves its seed out
    one = paired_ci95({0: 0.5, 1: math.nan}, {0: 0.25, 1: 0.5})
    assert one["seeds"] == [0] and one["mean"] == pytest.approx(0.25) and math.isnan(one["ci95"])
    assert math.isnan(paired_ci95({0: 0.5}, {1: 0.5})["mean"])


def test_curve_score_is_the_mean_of_the_evaluations_after_version_zero():
    # versions 0, 5, 10, 15, 20: version 0 (the initial weights) is left out: (0.4 + 0.5 + 0.3 + 0.6) / 4 = 0.45
    evals = [{"version": v, "held_out": x} for v, x in ((0, 0.2), (5, 0.4), (10, 0.5), (15, 0.3), (20, 0.6))]
    assert heldout_curve_score(evals) == pytest.approx(0.45)
    # an evaluation that scored nothing is left out: (0.4 + 0.5 + 0.6) / 3 = 0.5
    evals[3]["held_out"] = math.nan
    assert heldout_curve_score(evals) == pytest.approx(0.5)
    # before and after only: a final point, not a curve
    assert math.isnan(heldout_curve_score([{"version": 0, "held_out": 0.2}, {"version": 20, "held_out": 0.6}]))
    assert math.isnan(heldout_curve_score([]))


def test_binomial_standard_error_and_where_n_comes_from():
    assert binomial_se(0.4, 128) == pytest.approx(math.sqrt(0.24 / 128))  # 0.0433
    assert binomial_se(0.25, 16) == pytest.approx(0.108253, abs=1e-6)  # sqrt(0.1875 / 16)
    assert math.isnan(binomial_se(math.nan, 64)) and math.isnan(binomial_se(0.5, 0))
    assert heldout_prompts(rec("snapshot", 0, 0.5, n=128, extra=["env.eval_prompts=64"])) == 128  # recorded
    assert heldout_prompts(rec("snapshot", 0, 0.5, extra=["env.eval_prompts=64"])) == 64  # the cell's setting
    assert heldout_prompts(rec("snapshot", 0, 0.5)) == 32  # BASE's


def test_paired_md_rows_of_two_runs():
    # recompute: after 0.25, evaluations v5 0.5 and v10 0.25 -> curve (0.5 + 0.25) / 2 = 0.375, batch (0.5 + 0.5) / 2 = 0.5
    # snapshot:  after 0.75, evaluations v5 0.5 and v10 0.75 -> curve 0.625, batch (0.5 + 1.0) / 2 = 0.75
    base = rec("recompute", 0, 0.25, evals=[(0, 0.25), (5, 0.5), (10, 0.25)], batch=[0.5, 0.5], n=16)
    snap = rec("snapshot", 0, 0.75, evals=[(0, 0.25), (5, 0.5), (10, 0.75)], batch=[0.5, 1.0], n=16)
    assert run_scores(snap) == pytest.approx({"heldout_after": 0.75, "heldout_curve": 0.625, "batch_curve": 0.75})
    rows = paired_rows([snap, base])
    assert [r["method"] for r in rows] == ["recompute", "snapshot"]  # the baseline first
    assert rows[0]["scores"]["heldout_after"]["paired"] is None
    assert rows[1]["scores"]["heldout_curve"]["paired"]["diffs"] == pytest.approx([0.25])
    lines = paired_markdown(rows).splitlines()
    # differences: after 0.75 - 0.25 = +0.5, curve 0.625 - 0.375 = +0.25, batch 0.75 - 0.5 = +0.25; one seed, no interval
    assert (
        "| recompute | 1 | 0/1 | 0.250 | baseline: s0 0.250 | - | 0.375 | baseline: s0 0.375 | - | 0.500 | baseline: s0 0.500 | - |"
        in lines
    )
    assert (
        "| snapshot | 1 | 0/1 | 0.750 | s0 +0.500 | +0.500 | 0.625 | s0 +0.250 | +0.250 | 0.750 | s0 +0.250 | +0.250 |"
        in lines
    )
    # evaluation noise, n = 16: after sqrt(0.25 * 0.75 / 16) = 0.108 for both (p = 0.25 and 0.75);
    # curve: (0.5 * 0.5 / 16 + 0.25 * 0.75 / 16) / 2^2 = (0.015625 + 0.01171875) / 4 = 0.0068359, sqrt = 0.083;
    # one seed: no run-to-run sd, no ratio, no sd of differences.
    assert "| recompute | 16 | 0.108 | - | - | - | 0.083 | - | - | - |" in lines
    assert "| snapshot | 16 | 0.108 | - | - | - | 0.083 | - | - | - |" in lines


def test_paired_md_three_seeds_interval_and_collapses_without_a_curve():
    base = [
        rec("recompute", s, a, collapsed=s == 1, extra=["env.eval_prompts=64"]) for s, a in enumerate((0.4, 0.4, 0.6))
    ]
    snap = [rec("snapshot", s, a, extra=["env.eval_prompts=64"]) for s, a in enumerate((0.5, 0.6, 0.9))]
    text = paired_markdown(paired_rows(base + snap))
    # snapshot's held-out after: mean 2.0 / 3 = 0.667, sd sqrt((0.1667^2 + 0.0667^2 + 0.2333^2) / 2) = 0.2082,
    # unpaired half-width 4.302653 * 0.2082 / sqrt(3) = 0.517; differences +0.1, +0.2, +0.3: mean +0.200 (+-0.248),
    # the interval includes 0 (no star).
    assert "| snapshot | 3 | 0/3 | 0.667 (+-0.517) | s0 +0.100, s1 +0.200, s2 +0.300 | +0.200 (+-0.248) |" in text
    assert "| recompute | 3 | 1/3 |" in text
    # noise, n = 64 from the cell's settings: sqrt((0.25 + 0.24 + 0.09) / 3 / 64) = sqrt(0.0030208) = 0.055;
    # SE / sd = 0.0550 / 0.2082 = 0.26; sd of the differences 0.1, 0.2, 0.3 = 0.100; were the runs independent:
    # recompute's sd of 0.4, 0.4, 0.6 = sqrt((0.0667^2 * 2 + 0.1333^2) / 2) = 0.1155, sqrt(0.2082^2 + 0.1155^2) = 0.238
    assert "| snapshot | 64 | 0.055 | 0.208 | 0.26 | 0.100 (0.238) |" in text
    assert "held-out curve: mean" not in text and "No held-out curve score: no run here was evaluated during" in text
    # differences +0.20, +0.25, +0.30: mean 0.25 > half-width 4.302653 * 0.05 / sqrt(3) = 0.124 -> starred
    snap[0]["reward_after_heldout"] = 0.6
    snap[1]["reward_after_heldout"] = 0.65
    assert "| +0.250 (+-0.124) * |" in paired_markdown(paired_rows(base + snap))


def test_a_configuration_without_the_baseline_has_no_paired_rows():
    assert paired_rows([rec("snapshot", 0, 0.5)]) == []
    assert "No configuration here has `recompute` runs" in paired_markdown([])


def test_report_remakes_a_folder_from_its_cells_without_running(tmp_path):
    (tmp_path / "cells").mkdir()
    for r in (rec("recompute", 0, 0.25, batch=[0.5]), rec("snapshot", 0, 0.75, batch=[0.75])):
        r |= {"final_reward": 0.5, "reward_first": 0.4, "steps_to_level": None}
        (tmp_path / "cells" / f"{r['cell']}.json").write_text(json.dumps(r))
    (tmp_path / "results.json").write_text(json.dumps({"meta": {"grid": "kept"}}))
    res = report(tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["meta"] == {"grid": "kept"} and saved["paired"]["baseline"] == "recompute"
    assert (
        [r["method"] for r in saved["paired"]["rows"]]
        == ["recompute", "snapshot"]
        == [r["method"] for r in res["paired"]["rows"]]
    )
    assert "| snapshot | 1 | 0/1 | 0.750 | s0 +0.500 | +0.500 |" in (tmp_path / "paired.md").read_text()
    assert (tmp_path / "table.md").is_file() and (tmp_path / "seeds.md").is_file()
    with pytest.raises(FileNotFoundError, match="no cell records"):
        report(tmp_path / "none")


def test_verdict_grid_is_paper_real_with_five_seeds_w4_and_evaluations_every_five_versions():
    from trainer.driver.config.schema import load_config

    cells = grid("verdict")
    assert len(cells) == 40 and len({c.name for c in cells}) == 40  # 4 methods x W 2, 4 x seeds 0-4
    assert cells[0].name == "smollm2-recompute-W2-bf16-s0-mb2-eval128"
    assert {c.method for c in cells} == {"recompute", "snapshot", "ppo_ewma", "loglinear_prox"}
    assert [c.W for c in cells] == [2] * 20 + [4] * 20  # W = 2 first
    assert [c.seed for c in cells[:8]] == [0] * 4 + [1] * 4  # a seed's methods next to each other
    # the training settings are paper_real's; only the held-out evaluation differs
    real = next(c for c in grid("paper_real") if c.method == "snapshot" and c.seed == 0)
    ours = next(c for c in cells if c.method == "snapshot" and c.seed == 0 and c.W == 2)
    added = set(ours.overrides(Path("/x"))) - set(real.overrides(Path("/x")))
    assert added == {"env.eval_prompts=128", "controller.eval_every=5"}
    cfg = load_config(None, ours.overrides(Path("/tmp/x")))
    assert (cfg.controller.eval_every, cfg.env.eval_prompts, cfg.controller.total_steps) == (5, 128, 20)
    assert (cfg.learner.ppo_mini_batches, cfg.learner.lr, cfg.rollout.dtype) == (2, 5e-5, "bfloat16")
    # held-out env seeds [1800, 1928) lie past the training seeds and inside the 2000-instance dataset
    assert cfg.env.train_seeds + cfg.env.eval_prompts <= cfg.env.kwargs["size"]
    # one evaluation's binomial error at p = 0.5, sqrt(0.25 / 128) = 0.044
    assert binomial_se(0.5, cfg.env.eval_prompts) == pytest.approx(0.0442, abs=1e-4)


def test_cli_accepts_the_verdict_grid(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    import benchmarks.methods
    import trainer.driver.cluster.netguard
    from vintage_cli.main import app

    ran = {}
    monkeypatch.setattr(trainer.driver.cluster.netguard, "reexec_with_loopback", lambda: None)
    monkeypatch.setattr(benchmarks.methods, "main", lambda **kw: ran.update(kw))
    res = CliRunner().invoke(app, ["bench", "methods", "--grid", "verdict", "--out", str(tmp_path / "v")])
    assert res.exit_code == 0, res.output
    assert ran["kind"] == "verdict" and ran["out_dir"] == tmp_path / "v"


def test_a_cell_record_keeps_its_held_out_evaluations():
    from benchmarks.methods import _Poller, cell_record

    cell = grid("verdict")[0]
    rows = [{"version": v, "reward_mean": x} for v, x in ((1, 0.25), (2, 0.5))]
    evals = [
        {"kind": "eval", "tag": t, "version": v, "held_out": x, "success_rate": x, "n": 128, "seconds": 1.0}
        for t, v, x in (("before", 0, 0.25), ("during", 1, 0.5), ("after", 2, 0.75))
    ]
    after = {"reward": 0.75, "success_rate": 0.75, "episodes": 128, "version": 2}
    summary = {"steps": 2, "state": "finished", "reward_before": {"reward": 0.25}, "reward_after": after}
    r = cell_record(cell, rows, summary, _Poller(Path("/nonexistent")), evals)
    assert r["heldout_n"] == 128 and r["success_after_heldout"] == 0.75
    assert [(e["tag"], e["version"], e["held_out"]) for e in r["heldout_evals"]] == [
        ("before", 0, 0.25),
        ("during", 1, 0.5),
        ("after", 2, 0.75),
    ]
    # curve (0.5 + 0.75) / 2 = 0.625 (version 0 left out); batch (0.25 + 0.5) / 2 = 0.375
    assert run_scores(r) == pytest.approx({"heldout_after": 0.75, "heldout_curve": 0.625, "batch_curve": 0.375})
    # a run recorded without evaluations keeps an empty list, not a curve
    assert cell_record(cell, rows, summary, _Poller(Path("/nonexistent")))["heldout_evals"] == []


def test_paper_real_stable_is_paper_real_with_the_demos_stabilisers():
    from trainer.driver.config.schema import load_config

    cells = grid("paper_real_stable")
    assert [(c.method, c.seed) for c in cells] == [(m, s) for s in (0, 1, 2) for m in ("recompute", "icepop")]
    real = next(c for c in grid("paper_real") if c.method == "icepop" and c.seed == 1)
    ours = next(c for c in cells if c.method == "icepop" and c.seed == 1)
    assert ours.name == "smollm2-icepop-W2-bf16-s1-mb2-demo"
    added = set(ours.overrides(Path("/x"))) - set(real.overrides(Path("/x")))
    assert added == {
        "loss.eps_high=0.28",
        "loss.dual_clip=3.0",
        'learner.lr_schedule="cosine"',
        "learner.lr_warmup_steps=2",
        "learner.lr_min_ratio=0.1",
        "loss.entropy_target=0.65",
        "loss.entropy_coef_delta=0.03",
        "loss.entropy_coef_max=0.5",
        "loss.entropy_coef_backoff=0.5",
        "loss.entropy_smoothing=0.5",
        "controller.dynamic_sampling=true",
    }
    # the same stabilisers as the demo's config file
    demo = load_config("deploy/configs/demo.toml", [])
    cfg = load_config(None, ours.overrides(Path("/tmp/x")))
    fields = [("loss", f) for f in ("eps_high", "dual_clip", "entropy_coef", "entropy_target", "entropy_coef_delta",
              "entropy_coef_max", "entropy_coef_backoff", "entropy_smoothing", "kl_coef")]  # fmt: skip
    fields += [("learner", f) for f in ("lr_schedule", "lr_warmup_steps", "lr_min_ratio")]
    for section, field in [*fields, ("controller", "dynamic_sampling")]:
        assert getattr(getattr(cfg, section), field) == getattr(getattr(demo, section), field), field


def test_spanning_grid_runs_agent_sessions_that_wait_on_their_tool():
    from trainer.driver.config.schema import load_config

    cells = grid("spanning")
    assert [(c.method, c.seed) for c in cells][:4] == [
        ("recompute", 0),
        ("snapshot", 0),
        ("ppo_ewma", 0),
        ("recompute", 1),
    ]
    cfg = load_config(None, cells[1].overrides(Path("/tmp/x")))
    assert (cfg.loss.method, cfg.model.path, cfg.agent.path) == ("snapshot", "smollm2", "rollout.agents.retail:run")
    assert cfg.env.kwargs == {"level": "easy", "max_turns": 3, "closing_turn": True}
    assert (cfg.agent.task_fields, cfg.agent.concurrency) == ({"tool_latency_s": 60}, 48)
    assert (cfg.controller.max_staleness, cfg.controller.total_steps, len(cells)) == (2, 12, 9)


def test_a_grid_with_stop_after_starts_no_cell_past_it(monkeypatch, tmp_path):
    """Cells of 100 s each under a 250 s limit: the cells started at 0, 100 and 200 s run, the one
    due at 300 s does not; outputs are written after each finished cell and once at the end."""
    import contextlib
    import types

    import benchmarks.methods as methods
    import trainer.driver.cluster.environment as environment
    import trainer.driver.cluster.session as session

    clock = {"t": 0.0}
    ran: list[str] = []
    writes: list[int] = []

    def fake_cell(cell, out_dir, console):
        ran.append(cell.name)
        clock["t"] += 100.0
        return {}

    monkeypatch.setattr(methods, "time", types.SimpleNamespace(perf_counter=lambda: clock["t"]))
    monkeypatch.setattr(methods, "run_cell", fake_cell)
    monkeypatch.setattr(methods, "folder_records", lambda out_dir: [])
    monkeypatch.setattr(methods, "write_outputs", lambda recs, out_dir, meta: writes.append(1) or {"rows": []})
    monkeypatch.setattr(methods, "table_markdown", lambda rows: "")
    monkeypatch.setattr(session, "ray_session", lambda cfg: contextlib.nullcontext())
    monkeypatch.setattr(environment, "defaults_env", lambda: None)
    cells = grid("verdict")[:5]
    methods.run_grid(cells, tmp_path, methods.Console(quiet=True), "verdict", stop_after_s=250.0)
    assert ran == [c.name for c in cells[:3]]
    assert len(writes) == 3 + 1
