"""Adaptive entropy control: the entropy coefficient a version trains with, moved after every
version toward keeping the policy's entropy near a target (``loss.entropy_target``).

The rule is Skywork-OR1's (He et al. 2025, "Skywork Open Reasoner 1 Technical Report"): the
coefficient rises by ``entropy_coef_delta`` after a version whose mean entropy was below the target
and falls by it otherwise, within ``[0, entropy_coef_max]``, and the bonus is applied only while
the last version's entropy was below the target. Without a target the coefficient is the fixed
``loss.entropy_coef``.
"""

from __future__ import annotations

import math
from typing import Any

from trainer.algorithm.loss_config import LossConfig


def adaptive_entropy_coef(coef: float, entropy: float, target: float, delta: float, max_coef: float) -> float:
    """The next version's entropy coefficient under adaptive entropy control: ``coef + delta`` when
    the step's mean entropy ``entropy`` (nats) was below ``target``, else ``coef - delta``, clipped
    to ``[0, max_coef]``; unchanged when ``entropy`` is not finite (a step without loss tokens).
    The rule of Skywork-OR1 (He et al. 2025, "Skywork Open Reasoner 1 Technical Report", adaptive
    entropy control). Example: coef 0.004, delta 0.002, max 0.05: entropy 0.3 below target 0.5 ->
    0.006; entropy 0.7 -> 0.002; coef 0.001, entropy 0.7 -> 0 (not -0.001)."""
    if not math.isfinite(entropy):
        return coef
    step = delta if entropy < target else -delta
    return min(max(coef + step, 0.0), max_coef)


class EntropyControl:
    """The entropy coefficient of a learner's next version (state: ``coef``, ``last_entropy``).

    Args:
        cfg: the loss settings (``entropy_coef`` the starting coefficient; ``entropy_target``,
            ``entropy_coef_delta``, ``entropy_coef_max`` the control; a target of 0 turns it off).
    """

    def __init__(self, cfg: LossConfig) -> None:
        self.cfg = cfg
        self.coef = cfg.entropy_coef
        """The coefficient the next version uses while its entropy is below the target."""
        self.last_entropy = math.nan
        """The mean policy entropy (nats) of the last applied version."""

    def loss_config(self) -> LossConfig:
        """``cfg`` as the next version's steps use it: with the current coefficient while the last
        version's entropy was below the target and 0 otherwise (``cfg`` itself without a target)."""
        if self.cfg.entropy_target <= 0:
            return self.cfg
        coef = self.coef if self.last_entropy < self.cfg.entropy_target else 0.0
        return self.cfg.model_copy(update={"entropy_coef": coef})

    def after_version(self, entropy: float) -> None:
        """After an applied version whose mean entropy was ``entropy`` (nats): move the coefficient
        (:func:`adaptive_entropy_coef`, with a target) and record the entropy when finite."""
        c = self.cfg
        if c.entropy_target > 0:
            self.coef = adaptive_entropy_coef(
                self.coef, entropy, c.entropy_target, c.entropy_coef_delta, c.entropy_coef_max
            )
        if math.isfinite(entropy):
            self.last_entropy = entropy

    def state_dict(self) -> dict[str, Any]:
        """``{"coef", "last_entropy"}``, for checkpoints."""
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict`; None (a checkpoint written before the control) keeps the start."""
        if state is not None:
            self.coef, self.last_entropy = float(state["coef"]), float(state["last_entropy"])
