"""The learning-rate schedule over optimizer steps: linear warm-up, then constant, linear or cosine
decay to a floor. A pure function of the step count (no optimizer, no torch), so a resumed run that
restores the count continues at the same rate."""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_multiplier(step: int, schedule: str, warmup_steps: int, decay_steps: int | None, min_ratio: float) -> float:
    """Factor on the peak learning rate for optimizer step ``step`` (0-based count of applied steps).

    Warm-up (Goyal et al. 2017, "Accurate, large minibatch SGD"): for ``step < warmup_steps`` the
    factor is ``(step + 1) / (warmup_steps + 1)``, so the first step already moves. After it, with
    progress ``p = min(1, (step - warmup_steps) / (decay_steps - warmup_steps))`` (1 when
    ``decay_steps <= warmup_steps``) and floor ``f = min_ratio``:

    - ``constant``: 1;
    - ``linear``: ``f + (1 - f) (1 - p)``;
    - ``cosine``: ``f + (1 - f) (1 + cos(pi p)) / 2`` (Loshchilov & Hutter 2017, "SGDR", without restarts).

    Example: warm-up 2, decay to step 10, floor 0.1, cosine: steps 0, 1 -> 1/3, 2/3; step 2 -> 1.0;
    step 6 -> 0.55; step 10 and after -> 0.1.

    Raises:
        ValueError: an unknown ``schedule``, a negative ``step`` or ``warmup_steps``, ``min_ratio``
            outside [0, 1], or no ``decay_steps`` for a decaying schedule.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"learner.lr_schedule: unknown schedule {schedule!r}; expected one of {SCHEDULES}")
    if step < 0 or warmup_steps < 0:
        raise ValueError(f"step ({step}) and learner.lr_warmup_steps ({warmup_steps}) must be >= 0")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"learner.lr_min_ratio: {min_ratio} is outside [0, 1]")
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    if decay_steps is None:
        raise ValueError(f"learner.lr_decay_steps: None with lr_schedule = {schedule!r}")
    span = decay_steps - warmup_steps
    p = 1.0 if span <= 0 else min(1.0, (step - warmup_steps) / span)
    shape = 1.0 - p if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
    return min_ratio + (1.0 - min_ratio) * shape
