"""The methods benchmark's quick grid, for real (vLLM, DeepSpeed, old-logit service; ~3 min on 2 CPUs).

Checks that the outputs exist and that the table has every method with finite numbers; it makes no
claim about which method wins (2 steps cannot tell) and no timing assertions.
"""

from __future__ import annotations

import json
import math

import pytest
from rich.console import Console

from benchmarks.methods import main
from benchmarks.methods_grid import METHODS

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory, tiny_model_path, ray_cluster):
    out = tmp_path_factory.mktemp("bench-methods")
    result = main(out_dir=out, quick=True, console=Console(quiet=True))
    return out, result


def test_output_files_exist(quick_result):
    out, result = quick_result
    for name in ("results.json", "table.md", "README.md", "reward_curves.png", "mask_kept.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert len(list((out / "cells").glob("*.json"))) == len(METHODS)
    assert json.loads((out / "results.json").read_text())["meta"]["grid"] == "quick"
    assert not any((out / "runs").glob("*/checkpoints"))  # deleted after each cell


def test_table_has_every_method_with_finite_values(quick_result):
    out, result = quick_result
    table = (out / "table.md").read_text()
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == set(METHODS)
    for m, r in rows.items():
        assert f"| {m} | 1 | bf16 |" in table
        for k in ("final_reward", "reward_first", "mask_kept_fraction", "clip_frac_low", "clip_frac_high",
                  "exact_token_fraction", "extra_s_per_step", "train_s", "wall_s"):  # fmt: skip
            assert math.isfinite(r[k]), (m, k, r[k])
        assert 0.0 <= r["final_reward"] <= 1.0 and 0.0 <= r["mask_kept_fraction"] <= 1.0
    # exact old logits only on the snapshot route, where the EWMA proxy error is measured
    assert rows["snapshot"]["exact_token_fraction"] == 1.0 and math.isfinite(rows["snapshot"]["proxy_abs_err"])
    assert rows["snapshot"]["oldlogit_bytes"] > 0 and rows["ppo_ewma"]["ewma_bytes"] > 0
    assert rows["recompute"]["exact_token_fraction"] == 0.0
