"""``vintage bench learner`` for real on the tiny model (DeepSpeed learner and plain PyTorch step,
``--repeats 2 --batch 4 --pack``; ~15 s on 2 CPUs): the JSON has its keys, every figure is a finite
number, and both steps trained the same tokens. No timing assertions."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from benchmarks.bench_learner import LEARNER_PARTS, PLAIN_PARTS
from vintage_cli.main import app

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def result(tmp_path_factory, tiny_model_path):
    out = tmp_path_factory.mktemp("bench-learner") / "learner.json"
    r = CliRunner().invoke(
        app, ["bench", "learner", "--model", "tiny", "--repeats", "2", "--batch", "4", "--pack", "--out", str(out)]
    )
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert "ratio learner / plain (paired)" in r.output
    return json.loads(out.read_text())


def test_json_has_every_key(result):
    assert set(result) >= {"config", "batch", "tokens", "repeats", "summary", "machine"}
    c = result["config"]
    assert (c["model"], c["method"], c["dtype"], c["threads"], c["batch"], c["repeats"]) == (
        "tiny", "snapshot", "float32", 1, 4, 2,
    )  # fmt: skip
    assert set(result["summary"]) == {"plain", "learner", "ratio_learner_over_plain", "ratio_of_medians"}
    assert set(result["summary"]["plain"]) == {"step_s", *PLAIN_PARTS}
    assert set(result["summary"]["learner"]) == {"step_s", *LEARNER_PARTS, "remainder_s", "wall_s", "collate_s"}
    assert len(result["repeats"]) == 2
    for rep in result["repeats"]:
        for side in ("plain", "learner"):
            assert all(math.isfinite(v) for v in rep[side].values()), rep[side]
    for spread in [*result["summary"]["plain"].values(), *result["summary"]["learner"].values()]:
        assert spread["n"] == 1 and spread["min"] <= spread["median"] <= spread["max"]
    assert math.isfinite(result["summary"]["ratio_learner_over_plain"]["median"])


def test_both_steps_trained_the_same_tokens(result):
    b = result["batch"]
    assert b["padded_tokens"] == 4 * (64 + 32) and b["real_tokens"] == 4 * 64 + sum(b["completion_lengths"])
    assert b["trained_tokens"] == sum(b["completion_lengths"])
    # rows of 64 + 16..32 tokens: no two fit one packed row of 96, so packing saves no position
    assert result["config"]["pack"] is True and b["packed_tokens"] == 4 * 96
    assert result["tokens"] == {"plain": b["trained_tokens"], "learner": b["trained_tokens"], "equal": True}
    for rep in result["repeats"]:
        assert rep["plain"]["tokens"] == rep["learner"]["tokens"] == b["trained_tokens"]
        assert rep["learner"]["applied"] == 1.0
    assert [rep["learner"]["version"] for rep in result["repeats"]] == [1.0, 2.0]
