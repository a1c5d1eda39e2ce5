"""The methods benchmark's bookkeeping (grids, seed pooling, tagged rows), on hand-made cell records."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.methods_grid import GRIDS, Cell, ci95, collapsed, grid
from benchmarks.methods_report import aggregate, folder_records, table_markdown


def record(method: str, W: int, seed: int, final: float, tag: str = "", state: str = "finished") -> dict:
    cell = Cell(method, W, "bf16", seed, 32, tag=tag)
    rec = {"cell": cell.name, "method": method, "W": W, "disc": "bf16", "seed": seed, "steps": 32, "tag": tag}
    rec["steps_done"] = 32
    rec |= {"state": state, "final_reward": final, "reward_first": 0.4, "reward_after_heldout": final + 0.1}
    rec["reward_before_heldout"] = 0.3
    rec |= {"steps_to_level": 10 + seed if final >= 0.6 else None}
    for k in ("mask_kept_fraction", "mask_kept_fraction_min", "clip_frac_low", "clip_frac_high", "exact_token_fraction",
              "proxy_abs_err", "discrepancy_kl", "ewma_resets", "oldlogit_bytes", "ewma_bytes", "old_logits_s",
              "ewma_s", "extra_s_per_step", "train_s", "staleness_mean", "wall_s"):  # fmt: skip
        rec[k] = 0.0
    rec["oldlogit_bytes"] = 2**20 * (seed + 1)
    return rec


def test_seeds_pool_into_one_row_with_mean_and_sample_sd():
    recs = [record("recompute", 1, 0, 0.4), record("recompute", 1, 1, 0.6), record("recompute", 1, 2, 0.8)]
    (row,) = aggregate(recs)
    assert row["seeds"] == 3
    assert row["final_reward"] == pytest.approx(0.6)
    assert row["final_reward_sd"] == pytest.approx(0.2)  # sd of 0.4, 0.6, 0.8 with ddof=1
    assert row["reward_after_heldout"] == pytest.approx(0.7)
    assert row["reached_level"] == 2 and row["steps_to_level"] == pytest.approx(11.5)  # seeds 1, 2: 11, 12
    assert row["oldlogit_bytes"] == pytest.approx(2 * 2**20)  # mean of 1, 2, 3 MiB


def test_one_seed_has_no_spread_and_tagged_cells_are_separate_rows():
    rows = aggregate([record("snapshot", 4, 0, 0.5), record("snapshot", 4, 0, 0.9, tag="lr3e-2")])
    assert [(r["tag"], r["final_reward"]) for r in rows] == [("", 0.5), ("lr3e-2", 0.9)]
    assert math.isnan(rows[0]["final_reward_sd"])
    table = table_markdown(rows)
    assert "| snapshot | 4 | bf16 | 1 | 0.400 -> 0.500 | 0.300 -> 0.600 |" in table
    assert "| snapshot [lr3e-2] | 4 | bf16 | 1 | 0.400 -> 0.900 | 0.300 -> 1.000 |" in table


def test_folder_records_keeps_finished_cells_only(tmp_path):
    (tmp_path / "cells").mkdir()
    stopped = record("ppo", 1, 2, 0.5) | {"steps_done": 3}  # stopped by a signal at step 3 of 32
    for r in (record("ppo", 1, 0, 0.5), record("ppo", 1, 1, 0.5, state="failed"), stopped):
        (tmp_path / "cells" / f"{r['cell']}.json").write_text(json.dumps(r))
    assert [r["cell"] for r in folder_records(tmp_path)] == ["ppo-W1-bf16-s0"]


def test_grids_have_unique_cell_names_and_unknown_kind_is_named():
    sizes = {k: len(grid(k)) for k in GRIDS}
    assert sizes == {
        "quick": 7, "reduced": 22, "seeds": 18, "lr": 6, "eps": 2, "full": 204, "confirm": 3,
        "paper": 30, "paper_lr": 6, "paper_real": 15, "paper_real_stable": 6,
        "paper_agent": 15, "verdict": 40, "spanning": 9,
    }  # fmt: skip
    for k in GRIDS:
        names = [c.name for c in grid(k)]
        assert len(names) == len(set(names)), k
    assert grid("lr")[0].name == "recompute-W4-bf16-s0-lr3e-2"
    with pytest.raises(ValueError, match="'bogus'"):
        grid("bogus")


def test_cli_names_an_unknown_grid_and_runs_nothing(tmp_path):
    from typer.testing import CliRunner

    from vintage_cli.main import app

    res = CliRunner().invoke(app, ["bench", "methods", "--grid", "bogus", "--out", str(tmp_path / "m")])
    assert res.exit_code == 2
    assert "grid='bogus'" in res.output and "seeds" in res.output
    assert not (tmp_path / "m").exists()


def test_interval_collapses_and_clip_columns_pool_over_seeds():
    recs = [record("snapshot", 2, s, f, tag="mb4") for s, f in enumerate((0.4, 0.6, 0.8))]
    for r, (c, hi, g) in zip(recs, ((False, 0.1, 0.2), (True, 0.3, 0.4), (False, 0.2, 0.0)), strict=True):
        r |= {"collapsed": c, "clip_frac_step_max": hi, "clip_grad_removed_frac": g}
    (row,) = aggregate(recs)
    assert row["final_reward_ci95"] == pytest.approx(4.302653 * 0.2 / math.sqrt(3), rel=1e-6)  # 0.4968
    assert row["collapsed"] == 1 and row["clip_frac_step_max"] == pytest.approx(0.2)
    assert row["clip_grad_removed_frac"] == pytest.approx(0.2)
    assert table_markdown([row]).rstrip().endswith("| +-0.497 | 1/3 | 0.200 | 0.200 |")
    assert math.isnan(ci95([0.5])) and ci95([0.5, 0.5]) == 0.0


def test_a_run_collapsed_when_it_ended_below_where_it_began():
    assert collapsed(0.3, 0.4) and not collapsed(0.4, 0.4) and not collapsed(0.9, 0.4)
    assert not collapsed(math.nan, 0.4)


def test_paper_grid_takes_several_updates_per_batch():
    cell = grid("paper")[0]
    assert cell.name == "recompute-W2-bf16-s0-mb4-lr5e-3" and cell.steps == 64
    o = cell.overrides(Path("/tmp/x"))
    assert o[-3:] == ["learner.ppo_mini_batches=4", "learner.micro_batch_size=8", "learner.lr=5e-3"]
    assert {c.method for c in grid("paper")} == {"recompute", "snapshot", "ppo_ewma", "loglinear_prox", "icepop"}


def test_a_cell_interrupted_before_its_last_step_is_not_complete():
    from benchmarks.methods import is_complete

    cell = grid("paper")[0]  # 64 steps
    assert is_complete({"state": "finished", "steps": 64, "steps_done": 64}, cell)
    assert not is_complete({"state": "finished", "steps": 64, "steps_done": 0}, cell)  # stopped by SIGINT
    assert not is_complete({"state": "failed", "steps": 64, "steps_done": 64}, cell)
    assert not is_complete({"state": "finished", "steps": 32, "steps_done": 32}, cell)


def test_the_agent_grid_runs_the_retail_agent_through_the_gateway_on_smollm2():
    from trainer.driver.config.schema import load_config

    cells = grid("paper_agent")
    assert len(cells) == 15 and cells[0].name == "smollm2-recompute-W2-bf16-s0-agent-mb2"
    cfg = load_config(None, cells[1].overrides(Path("/tmp/x")))  # snapshot, seed 0
    assert (cfg.agent.path, cfg.loss.method, cfg.rollout.dtype) == ("rollout.agents.retail:run", "snapshot", "bfloat16")
    assert (cfg.learner.ppo_mini_batches, cfg.rollout.sampling.n, cfg.controller.batch_groups) == (2, 4, 4)
    assert (cfg.controller.max_staleness, cfg.controller.total_steps, cfg.rollout.sampling.max_tokens) == (2, 20, 24)


def test_seeds_table_gives_every_run_by_seed_beside_the_interval_best_first():
    from benchmarks.methods_report import seeds_markdown

    recs = [record("snapshot", 2, s, f) for s, f in ((2, 0.8), (0, 0.4), (1, 0.6))]
    recs.append(record("recompute", 2, 0, 0.9))
    for r, (hi, g, e, x) in zip(
        recs, ((0.3, 0.1, 1.5, 0.5), (0.1, 0.2, 2.0, 9.0), (0.2, 0.3, 0.5, 0.4), (0.05, 0.0, 0.1, 0.0)), strict=True
    ):
        r |= {"clip_frac_step_max": hi, "clip_grad_removed_frac": g, "entropy_last": e, "extra_s_per_step": x}
    recs[0]["spanning_frac"] = 0.05  # one run recorded the share of partial rollouts, two did not
    first, second = seeds_markdown(recs).splitlines()[2:]
    # recompute's 0.9 ranks above snapshot's mean 0.6; one run has no interval.
    assert first.startswith("| recompute | 2 | bf16 | 1 | 0.900 | 0.900 (0.900-0.900) | s0 0.900 | 1.000 |")
    # snapshot: mean 0.6 +- 4.3027 * 0.2 / sqrt(3) = 0.497; held-out = final + 0.1; seeds in order 0, 1, 2;
    # steps to 0.6 for seeds 1 and 2 (11, 12); largest clip over runs 0.3; clipped share mean 0.2;
    # spanning sequences over the run that has them; old-logit MiB mean of 1, 2, 3; extra s/step median of 9.0, 0.4, 0.5 (a loaded run's 9.0 does not move it).
    assert second == (
        "| snapshot | 2 | bf16 | 3 | 0.600 (+-0.497) | 0.600 (0.400-0.800) | s0 0.400, s1 0.600, s2 0.800 | "
        "0.700 (+-0.497) | s0 0.300 -> 0.500, s1 0.300 -> 0.700, s2 0.300 -> 0.900 | 12 (2/3) | 0/3 | 0.300 | "
        "20.0% | s0 2.00, s1 0.50, s2 1.50 | 5.0% | 2.0 + 0.0 | 0.50 |"
    )
