"""Adaptive entropy control: the entropy coefficient a version trains with, moved after every
version toward keeping the policy's entropy near a target (``loss.entropy_target``).

The coefficient follows Skywork-OR1's rule (He et al. 2025, "Skywork Open Reasoner 1 Technical
Report"): it rises by ``entropy_coef_delta`` after a version whose mean entropy was below the
target and falls by it otherwise, within ``[0, entropy_coef_max]``. Unlike Skywork-OR1, whose bonus
applies only while the last entropy was below the target, the bonus stays on at the current
coefficient and only the coefficient moves: with an on/off bonus the entropy of SmolLM2 runs fell
back within one or two versions of crossing the target and swung between 0.2 and 0.8 nats.

Two options make the control let go faster than it grips and read less noise:
``entropy_coef_backoff`` multiplies the coefficient by a factor above the target instead of
subtracting ``delta`` (additive increase, multiplicative decrease, as in TCP's congestion control,
Chiu and Jain 1989), and ``entropy_smoothing`` reads an exponential moving average of the
versions' entropies instead of the last one alone. Without a target the coefficient is the fixed
``loss.entropy_coef``.
"""

from __future__ import annotations

import math
from typing import Any

from trainer.algorithm.loss_config import LossConfig


def adaptive_entropy_coef(
    coef: float, entropy: float, target: float, delta: float, max_coef: float, backoff: float | None = None
) -> float:
    """The next version's entropy coefficient under adaptive entropy control: ``coef + delta`` when
    the mean entropy ``entropy`` (nats) was below ``target``, else ``coef - delta`` (or
    ``coef * backoff`` when ``backoff`` is given), clipped to ``[0, max_coef]``; unchanged when
    ``entropy`` is not finite (a step without loss tokens). The rule of Skywork-OR1 (He et al.
    2025, "Skywork Open Reasoner 1 Technical Report", adaptive entropy control), with TCP's
    multiplicative decrease as the option (Chiu and Jain 1989). Example: coef 0.004, delta 0.002,
    max 0.05, target 0.5: entropy 0.3 -> 0.006; entropy 0.7 -> 0.002, or 0.002 with backoff 0.5
    too, and coef 0.2 -> 0.1 with backoff 0.5 (0.198 without); coef 0.001, entropy 0.7 -> 0
    (not -0.001)."""
    if not math.isfinite(entropy):
        return coef
    if entropy < target:
        coef += delta
    else:
        coef = coef * backoff if backoff is not None else coef - delta
    return min(max(coef, 0.0), max_coef)


def smoothed_entropy(previous: float | None, entropy: float, smoothing: float) -> float | None:
    """The entropy the control reads after a version whose mean entropy was ``entropy`` (nats): the
    exponential moving average ``smoothing * previous + (1 - smoothing) * entropy``; the first
    finite entropy starts it (``previous`` None), a non-finite one leaves it. Example: smoothing
    0.5, previous 0.2, entropy 1.0 -> 0.6; previous None -> 1.0."""
    if not math.isfinite(entropy):
        return previous
    if previous is None:
        return entropy
    return smoothing * previous + (1.0 - smoothing) * entropy


class EntropyControl:
    """The entropy coefficient of a learner's next version (state: ``coef`` and the smoothed
    entropy ``entropy``).

    Args:
        cfg: the loss settings (``entropy_coef`` the starting coefficient; ``entropy_target``,
            ``entropy_coef_delta``, ``entropy_coef_max``, ``entropy_coef_backoff`` and
            ``entropy_smoothing`` the control; a target of 0 turns it off).
    """

    def __init__(self, cfg: LossConfig) -> None:
        self.cfg = cfg
        self.coef = cfg.entropy_coef
        """The coefficient the next version trains with."""
        self.entropy: float | None = None
        """The smoothed entropy (nats) the last move read; None before the first version."""

    def loss_config(self) -> LossConfig:
        """``cfg`` as the next version's steps use it: with the current coefficient (``cfg`` itself
        without a target)."""
        if self.cfg.entropy_target <= 0 or self.coef == self.cfg.entropy_coef:
            return self.cfg
        return self.cfg.model_copy(update={"entropy_coef": self.coef})

    def after_version(self, entropy: float) -> None:
        """After an applied version whose mean entropy was ``entropy`` (nats): when a target is set,
        smooth it (:func:`smoothed_entropy`) and move the coefficient on the smoothed value
        (:func:`adaptive_entropy_coef`)."""
        c = self.cfg
        if c.entropy_target > 0:
            self.entropy = smoothed_entropy(self.entropy, entropy, c.entropy_smoothing)
            if self.entropy is not None:
                self.coef = adaptive_entropy_coef(
                    self.coef, self.entropy, c.entropy_target, c.entropy_coef_delta, c.entropy_coef_max,
                    c.entropy_coef_backoff,
                )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """``{"coef", "entropy"}``, for checkpoints."""
        return {"coef": self.coef, "entropy": self.entropy}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict`; None (a checkpoint written before the control) keeps the start,
        and a state without ``entropy`` starts the smoothing afresh."""
        if state is not None:
            self.coef = float(state["coef"])
            self.entropy = state.get("entropy")
