"""The GPU check of a borrowed machine, run here on CPU (``--device cpu``, fp32) in a child process.

Every check runs for real: a DeepSpeed learner (gloo), the old-logit service, a publication read by
a second process through CPU shared memory, and three versions of the transformers engine's
sample-train-publish-load loop on the tiny model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def result(tmp_path_factory, tiny_model_path):
    out = tmp_path_factory.mktemp("gpu-check") / "result.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    # the budget is for a GPU; a shared CPU box may need more
    cmd = [sys.executable, "-m", "deploy.gpu_check", "--device", "cpu", "--out", str(out), "--budget-s", "900"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    failed = {k: c.get("error") for k, c in res.get("checks", {}).items() if not c["ok"]}
    assert proc.returncode == 0 and res["ok"], f"{failed or res.get('error')}\n{proc.stderr[-3000:]}"
    return res


def test_every_check_ran_and_passed(result):
    assert result["device"] == "cpu" and result["dtype"] == "float32"
    assert list(result["checks"]) == ["learner", "chunked", "oldlogit", "ipc", "loop"]
    assert all(c["ok"] and "error" not in c for c in result["checks"].values())
    assert result["machine"]["cuda_available"] is False


def test_learner_two_steps_per_batch(result):
    c = result["checks"]["learner"]
    assert c["version"] == 1 and c["optimizer_steps"] == 2 and c["zero_stage"] == 0
    first, second = c["steps"]
    # the first mini-batch's recompute reference is its own forward: ratio exactly 1, nothing clipped
    assert first["ratio_mean"] == first["ratio_min"] == first["ratio_max"] == 1.0
    assert first["clip_frac_low"] == first["clip_frac_high"] == 0.0
    # rewards 0, 1 in every group of two equal-length rows: GRPO advantages -1, +1 cancel in the
    # token mean (up to the behaviour weight exp(ref - mu), 1 within fp32 round-off: mu is the same model)
    assert abs(first["loss"]) <= 1e-6
    # 8 rows of 64 tokens, 48 trained each, split 4 + 4 rows
    assert first["tokens"] == second["tokens"] == 4 * 48
    # after the first step the reference is the weights before it: the ratio leaves 1
    assert second["ratio_min"] < 1.0 < second["ratio_max"]
    # lr 1e-3, two Adam steps: no element moves more than 1e-3 * (1 + 1.001358)
    assert c["adam_bound"] == pytest.approx(1e-3 * 2.001358, abs=1e-8)
    assert 0.0 < c["max_abs_weight_change"] and c["weight_change_less_rounding"] <= c["adam_bound"]


def test_chunked_equals_full_logits(result):
    c = result["checks"]["chunked"]
    assert (c["batch"], c["seq"], c["vocab"], c["timed_reps"]) == (2, 128, 49152, 1)
    assert c["tolerance"] == 1e-5 and c["max_abs_diff"] <= 1e-5
    assert c["full_peak_mib"] is None and c["chunked_peak_mib"] is None  # no allocator statistics on CPU


def test_oldlogit_service_matches_learner(result):
    c = result["checks"]["oldlogit"]
    assert c["version"] == 1 and c["service_device"] == "cpu"
    assert c["tokens"] == c["exact_tokens"] == 6 * (48 - 12)  # every sampled token of version 1 is exact
    assert c["max_abs_diff"] <= c["tolerance"] == 1e-5
    assert c["served_fingerprint"] == c["published_fingerprint"]


def test_second_process_reads_the_publication(result):
    c = result["checks"]["ipc"]
    assert c["transport"] == "host" and c["child_device"] == "cpu" and c["child_exitcode"] == 0
    assert c["tensors"] == 20  # 2 layers x 9 tensors + embedding + final norm (the head is tied)
    assert c["child_fingerprint"] == c["parent_fingerprint"]


def test_loop_publishes_three_versions(result):
    c = result["checks"]["loop"]
    assert c["versions"] == 3 and c["trajectories_per_version"] == 4 and c["max_tokens"] == 12  # CPU sizes
    assert [r["token_versions"] for r in c["rows"]] == [[0], [1], [2]]
    assert [(r["learner_version"], r["engine_version"]) for r in c["rows"]] == [(1, 1), (2, 2), (3, 3)]
    assert all(r["fingerprint_match"] for r in c["rows"])
    assert all(0.0 <= r["mean_reward"] <= 1.0 and 4 <= r["tokens"] <= 4 * 12 for r in c["rows"])
