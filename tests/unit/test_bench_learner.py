"""The learner benchmark's pure parts: the spread over repeats, the learner's split and remainder,
the paired ratio, the table's rows and the completion lengths (hand values)."""

from __future__ import annotations

import math

import pytest

from benchmarks.bench_learner import (
    LEARNER_PARTS,
    completion_lengths,
    format_table,
    learner_split,
    spread,
    summarize,
    table_rows,
)


def test_spread_leaves_the_warm_up_out():
    assert spread([9.0, 2.0, 4.0, 3.0]) == {"median": 3.0, "min": 2.0, "max": 4.0, "n": 3}
    assert spread([9.0, 2.0, 4.0]) == {"median": 3.0, "min": 2.0, "max": 4.0, "n": 2}  # median of [2, 4]
    assert spread([5.0]) == {"median": 5.0, "min": 5.0, "max": 5.0, "n": 1}  # one value: itself
    empty = spread([])
    assert empty["n"] == 0 and math.isnan(empty["median"])


def test_learner_split_remainder_and_collation():
    """step 1.0 s = 0.2 forward and loss + 0.4 backward + 0.2 optimizer + 0.05 EWMA update + 0.15 left over;
    the call took 1.1 s, so 0.1 s went on collation outside step_s."""
    m = {
        "step_s": 1.0,
        "forward_loss_s": 0.2,
        "backward_s": 0.4,
        "optimizer_s": 0.2,
        "ewma_update_s": 0.05,
        "loss": 3.0,
    }
    s = learner_split(m, wall_s=1.1)
    assert s["remainder_s"] == pytest.approx(0.15) and s["collate_s"] == pytest.approx(0.1)
    assert s["ewma_forward_s"] == 0.0 and s["ref_forward_s"] == 0.0 and s["recompute_forward_s"] == 0.0
    assert set(s) == {"step_s", *LEARNER_PARTS, "remainder_s", "wall_s", "collate_s"}
    assert s["step_s"] == pytest.approx(sum(s[p] for p in LEARNER_PARTS) + s["remainder_s"])


def _repeat(plain_s: float, learner_s: float) -> dict:
    plain = {"step_s": plain_s, "forward_loss_s": plain_s / 4, "backward_s": plain_s / 2, "optimizer_s": plain_s / 4}
    learner = learner_split({"step_s": learner_s, "backward_s": learner_s / 2}, learner_s + 0.01)
    return {"plain": plain, "learner": learner}


def test_summarize_pairs_the_ratio_per_repeat():
    """Plain 1.0, 2.0, 2.5 s and learner 5.0, 3.0, 6.0 s: the warm-up pair is left out; paired
    ratios 1.5 and 2.4 (median 1.95), medians 2.25 and 4.5 (ratio 2.0)."""
    s = summarize([_repeat(1.0, 5.0), _repeat(2.0, 3.0), _repeat(2.5, 6.0)])
    assert s["ratio_learner_over_plain"]["median"] == pytest.approx(1.95)
    assert s["ratio_learner_over_plain"]["min"] == pytest.approx(1.5)
    assert s["ratio_learner_over_plain"]["max"] == pytest.approx(2.4)
    assert s["ratio_of_medians"] == pytest.approx(2.0)
    assert s["plain"]["step_s"]["median"] == pytest.approx(2.25)
    assert s["plain"]["backward_s"] == {"median": pytest.approx(1.125), "min": 1.0, "max": 1.25, "n": 2}
    assert s["learner"]["remainder_s"]["median"] == pytest.approx(2.25)  # half of 3.0 and 6.0
    assert s["learner"]["collate_s"]["median"] == pytest.approx(0.01)


def test_table_rows_in_order_with_the_parts_indented():
    s = summarize([_repeat(1.0, 5.0), _repeat(2.0, 3.0), _repeat(2.5, 6.0)])
    rows = table_rows(s)
    labels = [label for label, _ in rows]
    assert labels[:5] == [
        "plain step", "  forward + loss", "  backward", "  optimizer (clip, AdamW, zero_grad)", "learner step (step_s)",
    ]  # fmt: skip
    assert labels[5 : 5 + len(LEARNER_PARTS)] == [f"  {p}" for p in LEARNER_PARTS]
    assert labels[-4:] == [
        "  remainder (step_s - parts)", "learner train_step wall", "  collation (wall - step_s)",
        "ratio learner / plain (paired)",
    ]  # fmt: skip
    assert rows[0][1] is s["plain"]["step_s"] and rows[-1][1] is s["ratio_learner_over_plain"]
    result = {
        "config": {"model": "tiny", "params": 1000, "method": "snapshot", "dtype": "float32", "threads": 1,
                   "device": "cpu", "batch": 2, "prompt": 4, "completion": 3, "repeats": 3, "pack": False},
        "batch": {"padded_tokens": 14, "real_tokens": 12, "padded_over_real": 14 / 12, "trained_tokens": 5,
                  "packed_tokens": 14, "packed_over_real": 14 / 12},
        "tokens": {"plain": 5.0, "learner": 5.0},
        "summary": s,
    }  # fmt: skip
    text = format_table(result)
    assert (
        "padded 14, real 12 (padded / real 1.167), packed 14 (packed / real 1.167; the learner pads), trained 5" in text
    )
    assert "2 measured repeat(s)" in text
    line = next(x for x in text.splitlines() if x.startswith("ratio learner / plain (paired)"))
    assert line.split()[-3:] == ["1.9500", "1.5000", "2.4000"]


def test_completion_lengths_first_row_longest_others_from_half_up():
    lengths = completion_lengths(16, 32, seed=0)
    assert len(lengths) == 16 and lengths[0] == 32 and all(16 <= n <= 32 for n in lengths)
    assert lengths == completion_lengths(16, 32, seed=0)
    assert completion_lengths(3, 1, seed=0) == [1, 1, 1]
    assert completion_lengths(1, 5, seed=0) == [5]
