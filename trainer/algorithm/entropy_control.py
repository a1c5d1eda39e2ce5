"""Adaptive entropy control: the entropy coefficient a version trains with, moved after every
version toward keeping the policy's entropy near a target (``loss.entropy_target``).

The coefficient follows Skywork-OR1's rule (He et al. 2025, "Skywork Open Reasoner 1 Technical
Report"): it rises by ``entropy_coef_delta`` after a version whose mean entropy was below the
target and falls by it otherwise, within ``[0, entropy_coef_max]``. Unlike Skywork-OR1, whose bonus
applies only while the last entropy was below the target, the bonus stays on at the current
coefficient and only the coefficient moves: with an on/off bonus the entropy of SmolLM2 runs fell
back within one or two versions of crossing the target and swung between 0.2 and 0.8 nats. Without
a target the coefficient is the fixed ``loss.entropy_coef``.
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
    """The entropy coefficient of a learner's next version (state: ``coef``).

    Args:
        cfg: the loss settings (``entropy_coef`` the starting coefficient; ``entropy_target``,
            ``entropy_coef_delta``, ``entropy_coef_max`` the control; a target of 0 turns it off).
    """

    def __init__(self, cfg: LossConfig) -> None:
        self.cfg = cfg
        self.coef = cfg.entropy_coef
        """The coefficient the next version trains with."""

    def loss_config(self) -> LossConfig:
        """``cfg`` as the next version's steps use it: with the current coefficient (``cfg`` itself
        without a target)."""
        if self.cfg.entropy_target <= 0 or self.coef == self.cfg.entropy_coef:
            return self.cfg
        return self.cfg.model_copy(update={"entropy_coef": self.coef})

    def after_version(self, entropy: float) -> None:
        """After an applied version whose mean entropy was ``entropy`` (nats): move the coefficient
        (:func:`adaptive_entropy_coef`) when a target is set."""
        c = self.cfg
        if c.entropy_target > 0:
            self.coef = adaptive_entropy_coef(
                self.coef, entropy, c.entropy_target, c.entropy_coef_delta, c.entropy_coef_max
            )

    def state_dict(self) -> dict[str, Any]:
        """``{"coef"}``, for checkpoints."""
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict`; None (a checkpoint written before the control) keeps the start."""
        if state is not None:
            self.coef = float(state["coef"])
