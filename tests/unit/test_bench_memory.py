"""bench_memory's estimate of the learner's peak over its state, by hand."""

from __future__ import annotations

import pytest

from benchmarks.bench_memory import STATE_BYTES_PER_PARAM, learner_peak_over_state


def test_the_learner_state_is_five_fp32_copies_of_the_weights():
    """1,000 parameters: 1,000 x (weights + gradients + Adam m + Adam v + EWMA) x 4 bytes = 20,000
    bytes; a pass adding 10,000 bytes peaks at 30,000 / 20,000 = 1.5, one adding none at 1.0."""
    assert STATE_BYTES_PER_PARAM == 20
    assert learner_peak_over_state(1000, 10_000) == pytest.approx(1.5)
    assert learner_peak_over_state(1000, 0) == pytest.approx(1.0)
