"""The GPU check's pass criteria, as pure functions with their derivations (``deploy.gpu_check``).

* :func:`adam_step_bound`: how far one bias-corrected Adam step can move one weight;
* :func:`logprob_tolerance`: how far two computations of one log-prob may differ when each rounds
  the logits on its own;
* :func:`weight_change_excess`: the largest weight change once the readings' rounding is taken off.
"""

from __future__ import annotations

import math

BF16_REL = 2.0**-8
"""Largest relative rounding error of one bfloat16 value (8 significant bits, round to nearest)."""
FP32_TOL = 1e-5
"""Log-prob tolerance (nats) between two fp32 computations of the same values in another order."""


def adam_step_bound(t: int, beta1: float = 0.9, beta2: float = 0.999) -> float:
    """Largest ``|update| / lr`` of one element at bias-corrected Adam step ``t`` (no eps, no decay).

    Adam (Kingma & Ba 2015, Algorithm 1): ``m_hat = sum_k c_k g_k``, ``v_hat = sum_k d_k g_k^2`` with
    ``c_k = (1 - b1) b1^(t-k) / (1 - b1^t)`` and ``d_k = (1 - b2) b2^(t-k) / (1 - b2^t)``; by
    Cauchy-Schwarz ``|m_hat| / sqrt(v_hat) <= sqrt(sum_k c_k^2 / d_k)`` for every gradient history.
    Step 1: exactly 1; step 2 with the defaults: 1.00136. eps only lowers the step.

    Raises:
        ValueError: ``t`` < 1.
    """
    if t < 1:
        raise ValueError(f"t: Adam steps count from 1, got {t}")
    c = [(1 - beta1) * beta1 ** (t - k) / (1 - beta1**t) for k in range(1, t + 1)]
    d = [(1 - beta2) * beta2 ** (t - k) / (1 - beta2**t) for k in range(1, t + 1)]
    # a gradient with no weight in m_hat adds nothing; one with weight in m_hat but none in v_hat
    # (b2 = 0 with momentum) leaves the step unbounded
    terms = [ci * ci / di if di > 0 else math.inf for ci, di in zip(c, d, strict=True) if ci != 0]
    return math.sqrt(sum(terms))


def logprob_tolerance(dtype: str, max_abs_logit: float) -> float:
    """Largest difference (nats) of one log-prob between two computations that round the same
    logits separately: fp32 :data:`FP32_TOL`; bfloat16 ``4 * BF16_REL * max|logit| + FP32_TOL``.

    Why: each path rounds a logit ``x`` to bf16 with error <= ``|x| * 2^-8``, so two paths differ by
    <= ``2 |x|max 2^-8`` per logit, and ``log_softmax_i = x_i - logsumexp(x)`` moves by at most twice
    the largest logit change (logsumexp is 1-Lipschitz in the max norm).

    Raises:
        ValueError: an unknown ``dtype`` or a non-finite ``max_abs_logit``.
    """
    if not math.isfinite(max_abs_logit):
        raise ValueError(f"max_abs_logit: must be finite, got {max_abs_logit}")
    if dtype == "float32":
        return FP32_TOL
    if dtype == "bfloat16":
        return 4 * BF16_REL * abs(max_abs_logit) + FP32_TOL
    raise ValueError(f"dtype: {dtype!r} is not float32 or bfloat16")


def weight_change_excess(before: dict, after: dict, rel: float) -> float:
    """``max_i (|after_i - before_i| - rel * max(|before_i|, |after_i|))`` over every element of
    every tensor: the largest weight change once the readings' own rounding (``rel`` of the
    magnitude) is taken off. Example: before 1.0, after 1.003, rel 0.001 -> 0.003 - 0.001003 = 0.001997.
    """
    worst = -math.inf
    for k, b in before.items():
        a, b = after[k].double(), b.double()
        worst = max(worst, float(((a - b).abs() - rel * a.abs().maximum(b.abs())).max()))
    return worst
