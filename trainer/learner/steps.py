"""Metrics of one learner step: micro-batch metrics folded per optimizer step, optimizer steps
combined per rollout batch. Pure functions over floats (no torch; the ranks' reduction is passed in)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence


def reads_taken_recompute(mini_batches: int, epochs: int, recompute: bool) -> list[bool]:
    """Which mini-batches of a pass read a recompute reference taken before the batch's first step
    (``recompute``: several optimizer steps and a proxy built from the current log-probs): all of
    them with several passes, and all but the first of a single pass, whose own forward is at the
    consuming version. Example: 3 mini-batches, 1 pass -> ``[False, True, True]``; 2 passes ->
    ``[True, True, True]``; without ``recompute`` every entry is False."""
    return [recompute and (j > 0 or epochs > 1) for j in range(mini_batches)]


def sum_max_min(means: dict[str, float], weight: float, acc: dict[str, list[float]]) -> None:
    """Fold one micro-batch's metric means into ``acc``: ``{name: [weighted sum, weight, max, min]}``
    with ``weight`` its loss tokens (``n_tokens`` is skipped; a micro-batch without tokens adds nothing)."""
    for k, v in means.items():
        if k == "n_tokens":
            continue
        a = acc.setdefault(k, [0.0, 0.0, -math.inf, math.inf])
        if weight > 0:
            a[0] += v * weight
            a[1] += weight
            a[2] = max(a[2], v)
            a[3] = min(a[3], v)


_SUMMED = (
    "ewma_forward_s", "forward_loss_s", "backward_s", "optimizer_s", "ewma_update_s", "micro_batches",
    "ewma_forward_micro_batches", "proxy_err_sum", "proxy_err_tokens",
)  # fmt: skip
_OWN_RULE = ("tokens", "applied", "grad_norm", "ewma_kept_frac", "lr")


def reduce_metrics(
    acc: dict[str, list[float]], all_reduce: Callable[[list[float], str], list[float]]
) -> dict[str, float]:
    """The loss metrics of one optimizer step from :func:`sum_max_min`'s accumulator, over
    micro-batches and ranks (``all_reduce(values, op)`` with ``op`` "sum" or "max"): token-weighted
    means, ``*_max`` / ``*_min`` the extremes; 0 for a metric no micro-batch with tokens gave.
    Example (one rank): ``{"ratio_max": [2.5, 2, 1.5, 1.0], "entropy": [3.0, 2, 2.0, 1.0]}`` ->
    ``{"ratio_max": 1.5, "entropy": 1.5}``."""
    keys = sorted(acc)
    sums = all_reduce([acc[k][0] for k in keys] + [acc[k][1] for k in keys], "sum")
    hi = all_reduce([acc[k][2] for k in keys] + [-acc[k][3] for k in keys], "max")
    out = {}
    for j, k in enumerate(keys):
        w = sums[len(keys) + j]
        if k.endswith("_max"):
            out[k] = hi[j] if w > 0 else 0.0
        elif k.endswith("_min"):
            out[k] = -hi[len(keys) + j] if w > 0 else 0.0
        else:
            out[k] = sums[j] / w if w > 0 else 0.0
    return out


def _mean_or_nan(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def combine_step_metrics(steps: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The metrics of one learner step from those of its optimizer steps (in order).

    Each step's dict holds ``tokens`` (its loss-token count N), ``applied``, ``grad_norm``,
    ``ewma_kept_frac`` and the loss library's metrics. Rules: phase seconds, micro-batch counts and
    the proxy-error sums add up; ``ewma_reset`` takes the largest, ``*_max`` the largest and
    ``*_min`` the smallest over the steps with loss tokens (NaN when no step had one); ``grad_norm`` is the mean over applied steps (``grad_norm_max`` the largest; NaN when
    none applied), ``ewma_kept_frac`` the mean over steps that measured it and ``lr`` the last step's; every other metric is
    the token-weighted mean (plain mean when no step has a token). Derived: ``optimizer_steps``
    (applied) and ``optimizer_steps_total``, ``proxy_abs_err`` = proxy-error sum / tokens (NaN
    without exact tokens), ``clip_frac_step_max`` = the largest ``clip_frac_low + clip_frac_high``
    of one step, ``clip_grad_removed_frac`` = sum of N * ``pg_weight_clipped`` / sum of
    N * ``pg_weight`` (0 without gradient weight).

    Example: steps with 10 and 30 tokens and ``clip_frac_high`` 0.1 and 0.3 give
    ``clip_frac_high`` 0.25 and ``clip_frac_step_max`` 0.3 (``clip_frac_low`` 0).
    """
    weights = [float(s["tokens"]) for s in steps]
    total = sum(weights)
    out: dict[str, float] = {}
    keys = list(dict.fromkeys(k for s in steps for k in s))
    for k in keys:
        if k in _OWN_RULE:
            continue
        pairs = [(s[k], w) for s, w in zip(steps, weights, strict=True) if k in s]
        vals = [v for v, _ in pairs]
        if k in _SUMMED:
            out[k] = float(sum(vals))
        elif k == "ewma_reset":
            out[k] = float(max(vals))
        elif k.endswith(("_max", "_min")):
            # extremes over the steps that had loss tokens (an empty step's 0 is no ratio); NaN if none
            seen = [v for v, w in pairs if w > 0 and math.isfinite(v)]
            out[k] = float((max if k.endswith("_max") else min)(seen)) if seen else math.nan
        elif total > 0:
            out[k] = float(sum(v * w for v, w in pairs) / sum(w for _, w in pairs)) if any(w for _, w in pairs) else 0.0
        else:
            out[k] = float(sum(vals) / len(vals))
    applied = [s for s in steps if s.get("applied", 0.0) > 0]
    norms = [s["grad_norm"] for s in applied if math.isfinite(s.get("grad_norm", math.nan))]
    out["grad_norm"] = _mean_or_nan(norms)
    out["grad_norm_max"] = max(norms) if norms else math.nan
    out["ewma_kept_frac"] = _mean_or_nan([s.get("ewma_kept_frac", math.nan) for s in steps])
    if any("lr" in s for s in steps):  # the rate of the batch's last optimizer step
        out["lr"] = float([s["lr"] for s in steps if "lr" in s][-1])
    out["optimizer_steps"] = float(len(applied))
    out["optimizer_steps_total"] = float(len(steps))
    err_n = out.pop("proxy_err_tokens", 0.0)
    err = out.pop("proxy_err_sum", 0.0)
    out["proxy_abs_err"], out["proxy_err_tokens"] = (err / err_n if err_n > 0 else math.nan), err_n
    out["clip_frac_step_max"] = max(s.get("clip_frac_low", 0.0) + s.get("clip_frac_high", 0.0) for s in steps)
    pg = sum(s.get("pg_weight", 0.0) * w for s, w in zip(steps, weights, strict=True))
    pg_clipped = sum(s.get("pg_weight_clipped", 0.0) * w for s, w in zip(steps, weights, strict=True))
    out["clip_grad_removed_frac"] = pg_clipped / pg if pg > 0 else 0.0
    return out
