"""Policy losses for vintage: ratios, discrepancy corrections, policy losses, aggregation.

Small pure functions over tensors (no state, no Ray, no collectives). Per generated token t with advantage A_t and loss mask m_t::

    d_t  = exp(ref_t - mu_t)                        discrepancy ratio (detached)
    w_t  = min(d_t, C)                              truncated IS weight (optional)
    k_t  = m_t * 1[low <= d_t <= high]              two-sided discrepancy mask (optional)
    r_t  = exp(logp_t - ref_t)                      staleness ratio (gradient through logp)
    L    = -sum_t k_t * w_t * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t) / N

Conventions (each is tested in ``tests/unit/test_losses*.py``):

- Shapes: per-token tensors are ``[batch, seq]``; log-probs are in nats. ``loss_mask`` is 1 only on
  tokens the model sampled; ``advantages`` may be ``[batch]`` (broadcast over the sequence).
- Staleness of a token ``k = policy_version - versions[t]`` where ``policy_version`` is the learner
  version that consumes the batch (queue time counts), so ``k >= 0``.
- Numerical safety: every log-ratio is formed with :func:`safe_log_ratio`, which puts 0 in masked or
  non-finite slots *before* ``exp`` (so neither values nor gradients see ``0 * inf``) and clamps the
  exponent to +-``MAX_LOG_RATIO``. A non-finite ``behav_logprobs`` on a masked-in token gives a
  neutral discrepancy ratio 1 (as if mu equalled the reference); a non-finite proxy reference falls
  back to the detached current log-prob. Both are counted in the metrics, never silently fixed.
- Denominator N: fixed by ``loss_mask`` and the aggregation mode alone. Tokens rejected by the
  discrepancy mask stay in N: N can then be counted once per optimizer step, before any forward, and
  summed over micro-batches and data-parallel ranks; a rejected token lowers the loss magnitude
  instead of re-weighting the survivors (``mask_kept_fraction`` reports how much was rejected).
- Every loss returns ``(loss, metrics)``: a scalar to minimise and a ``dict[str, float]``.

Proximal references (which log-prob plays pi_old) live in :mod:`trainer.algorithm.proximal`, advantages and
length helpers in :mod:`trainer.algorithm.advantages`, the named methods in :mod:`trainer.algorithm.loss_config`;
:func:`compute_policy_loss` ties them together for the learner.
"""

from __future__ import annotations

import torch
from torch import Tensor

from protocol import ROUTE_TRAITS
from trainer.algorithm.loss_config import LossConfig
from trainer.algorithm.proximal import at_least_fp32, proximal_reference, resolve_exact_mask

MAX_LOG_RATIO = 20.0
"""Bound on every exponent argument (nats): exp(20) ~ 4.9e8 is finite in fp32 and bf16."""

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
LEVELS = ("token", "seq_product", "seq_geomean")
KL_ESTIMATORS = ("k1", "k2", "k3")
K3_MAX = 10.0
"""Largest per-token k3 value (nats), as verl bounds its ``low_var_kl``: one token whose reference
log-prob is far below the policy's cannot dominate the penalty (k3 grows as e^-x)."""


# ----------------------------------------------------------------------------------------------
# log-probs and ratios


def _as_bool(loss_mask: Tensor) -> Tensor:
    return loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0


def safe_log_ratio(num: Tensor, den: Tensor, loss_mask: Tensor, bound: float | None = MAX_LOG_RATIO) -> Tensor:
    """``num - den`` ``[B, T]`` (fp32, nats) where masked-in and both finite, else 0; clamped to +-bound.

    The replacement happens with ``torch.where`` before any ``exp``, so a NaN or an overflowing
    difference in a masked slot gets a zero gradient instead of ``0 * inf = NaN``.
    """
    valid = _as_bool(loss_mask) & torch.isfinite(num) & torch.isfinite(den)
    diff = torch.where(valid, at_least_fp32(num) - at_least_fp32(den), torch.zeros((), device=num.device))
    return diff if bound is None else diff.clamp(-bound, bound)


def _to_level(log_ratio: Tensor, loss_mask: Tensor, level: str) -> Tensor:
    """Token log-ratios ``[B, T]`` -> the same at ``level``, broadcast back to ``[B, T]``."""
    if level == "token":
        return log_ratio
    mask = _as_bool(loss_mask)
    total = torch.where(mask, log_ratio, 0.0).sum(-1, keepdim=True)  # [B, 1]
    if level == "seq_product":
        seq = total
    elif level == "seq_geomean":
        seq = total / mask.sum(-1, keepdim=True).clamp(min=1)
    else:
        raise ValueError(f"unknown level={level!r}; expected one of {LEVELS}")
    return seq.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).expand_as(log_ratio)


def discrepancy_ratio(ref: Tensor, behav_logprobs: Tensor, loss_mask: Tensor, level: str = "token") -> Tensor:
    """d = exp(ref - mu) ``[B, T]``, detached: the same-version train/inference mismatch.

    ``level``: "token" (one ratio per token); "seq_product" (prod_t d_t over the sequence's
    masked-in tokens, the exact sequence likelihood ratio); "seq_geomean" (its geometric mean
    exp(mean_t log d_t), length-normalised as in GSPO). Sequence values are broadcast to every token.
    Masked or non-finite slots contribute log d = 0, i.e. a neutral ratio 1.
    """
    log_d = safe_log_ratio(ref.detach(), behav_logprobs.detach(), loss_mask)
    return torch.exp(_to_level(log_d, loss_mask, level))


def staleness_ratio(logprobs: Tensor, ref: Tensor, loss_mask: Tensor) -> Tensor:
    """r = exp(logp - ref) ``[B, T]``; gradient flows through ``logprobs`` only (ref is detached)."""
    return torch.exp(safe_log_ratio(logprobs, ref.detach(), loss_mask))


def tis_weight(d: Tensor, cap: float) -> Tensor:
    """Truncated importance weight min(d, C) ``[B, T]``, detached (Yao et al. 2025, "Your efficient
    RL framework secretly brings you off-policy RL training"; Ionides 2008 for truncated IS)."""
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got cap={cap!r}")
    return d.detach().clamp(max=cap)


def icepop_mask(d: Tensor, low: float, high: float) -> Tensor:
    """Two-sided mask 1[low <= d <= high] ``[B, T]`` as float (IcePop / masked IS, Ling team 2025).

    Tokens (or, with a sequence-level d, whole sequences) whose discrepancy ratio leaves the band get
    no gradient. Multiply by ``loss_mask`` to get the kept set.
    """
    if not 0 <= low < high:
        raise ValueError(f"need 0 <= low < high, got low={low!r}, high={high!r}")
    d = d.detach()
    return ((d >= low) & (d <= high)).float()


# ----------------------------------------------------------------------------------------------
# aggregation


def local_counts(loss_mask: Tensor) -> dict[str, int]:
    """Local denominators to sum over micro-batches and ranks: masked-in tokens, and sequences with
    at least one masked-in token. Pass the sums as ``global_token_count`` / ``global_seq_count``."""
    mask = _as_bool(loss_mask)
    return {"tokens": int(mask.sum()), "seqs": int(mask.any(-1).sum())}


def aggregate(
    per_token: Tensor,
    loss_mask: Tensor,
    mode: str = "token_mean",
    global_token_count: float | Tensor | None = None,
    global_seq_count: float | Tensor | None = None,
) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar; masked slots (even NaN ones) are ignored.

    - "token_mean": sum over masked-in tokens / N_tokens. N_tokens is ``global_token_count`` (the
      token count of the whole optimizer batch, summed over micro-batches and data-parallel ranks)
      or, if None, this call's own count. With the global count, summing the micro-batch losses
      gives the same value and gradient whatever the split (e.g. 2 tokens of loss 1 + 8 of 0 ->
      0.2). Data-parallel engines that *average* gradients over ranks need the loss scaled by the
      world size.
    - "seq_mean_token_mean": mean over sequences of each sequence's token mean (same example, one sequence each: 0.5).
    - "seq_mean_token_sum": mean over sequences of each sequence's token sum.
    Sequence modes divide by ``global_seq_count`` (sequences with >= 1 masked-in token) or the local
    count. Empty denominators count as 1, so an all-masked batch gives 0, not NaN.
    """
    mask = _as_bool(loss_mask)
    values = torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    if mode == "token_mean":
        denom = mask.sum() if global_token_count is None else global_token_count
        return values.sum() / torch.as_tensor(denom, dtype=values.dtype, device=values.device).clamp(min=1)
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation mode={mode!r}; expected one of {AGGREGATIONS}")
    seq_sum = values.sum(-1)  # [B]
    if mode == "seq_mean_token_mean":
        seq_sum = seq_sum / mask.sum(-1).clamp(min=1)
    denom = mask.any(-1).sum() if global_seq_count is None else global_seq_count
    return seq_sum.sum() / torch.as_tensor(denom, dtype=values.dtype, device=values.device).clamp(min=1)


# ----------------------------------------------------------------------------------------------
# metrics helpers


@torch.no_grad()
def _stats(prefix: str, x: Tensor, mask: Tensor) -> dict[str, Tensor]:
    n = mask.sum().clamp(min=1)
    x = x.detach().float()
    empty = ~mask.any()
    hi = torch.where(mask, x, -torch.inf).max()
    lo = torch.where(mask, x, torch.inf).min()
    return {
        f"{prefix}_mean": torch.where(mask, x, 0.0).sum() / n,
        f"{prefix}_max": torch.where(empty, 0.0, hi),
        f"{prefix}_min": torch.where(empty, 0.0, lo),
    }


@torch.no_grad()
def _frac(flag: Tensor, mask: Tensor) -> Tensor:
    return (flag & mask).sum() / mask.sum().clamp(min=1)


def _floats(metrics: dict[str, Tensor | float]) -> dict[str, float]:
    """One device sync for all tensor metrics."""
    keys = [k for k, v in metrics.items() if isinstance(v, Tensor)]
    values = torch.stack([metrics[k].detach().float().reshape(()) for k in keys]).tolist() if keys else []
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, Tensor)}
    out.update(zip(keys, values, strict=True))
    return out


def _token_advantages(advantages: Tensor, loss_mask: Tensor) -> Tensor:
    """``[B]`` or ``[B, T]`` -> ``[B, T]`` fp32 with 0 in masked slots."""
    adv = at_least_fp32(advantages.detach())
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1).expand(loss_mask.shape)
    return torch.where(_as_bool(loss_mask), adv, 0.0)


# ----------------------------------------------------------------------------------------------
# policy losses


def _clipped_surrogate(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float, dual_clip: float | None) -> Tensor:
    """Per-token -min(r A, clip(r, 1-eps_low, 1+eps_high) A), dual-clipped at -c A for A < 0."""
    per_token = torch.maximum(-ratio * adv, -ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    if dual_clip is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -dual_clip * adv), per_token)
    return per_token


def _check_clip(eps_low: float, eps_high: float, dual_clip: float | None) -> None:
    if not 0 < eps_low < 1:
        raise ValueError(f"eps_low must be in (0, 1), got eps_low={eps_low!r}")
    if not eps_high > 0:
        raise ValueError(f"eps_high must be > 0, got eps_high={eps_high!r}")
    if dual_clip is not None and not dual_clip > 1 + eps_high:
        raise ValueError(f"dual_clip must be > 1 + eps_high, got dual_clip={dual_clip!r}")


def clipped_tokens(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float, dual_clip: float | None) -> Tensor:
    """``[B, T]`` bool: tokens whose clipped surrogate is the constant branch, so they get no gradient.

    A > 0 and r > 1 + eps_high, A < 0 and r < 1 - eps_low (Schulman et al. 2017, eq. 7), and with
    the dual clip A < 0 and r > c (Ye et al. 2020). Example (eps 0.2, c 3): r 1.3 with A = 1,
    r 0.7 with A = -1 and r 3.5 with A = -1 are clipped; r 1.3 with A = -1 is not.
    """
    out = ((ratio > 1 + eps_high) & (adv > 0)) | ((ratio < 1 - eps_low) & (adv < 0))
    if dual_clip is not None:
        out = out | ((ratio > dual_clip) & (adv < 0))
    return out


def _policy_metrics(
    log_r: Tensor, adv: Tensor, mask: Tensor, eps_low, eps_high, dual_clip, weights: Tensor | None = None
) -> dict[str, Tensor]:
    """Clip fractions, KL and ratio stats; ``pg_weight`` and ``pg_weight_clipped`` are token means of
    |w r A|, the size of each token's policy-gradient factor d(-w r A)/d(log pi), over all tokens and
    over the clipped ones: their quotient is the share of the gradient weight the clip removed."""
    with torch.no_grad():
        r = log_r.detach().exp()
        g = (r * adv).abs() if weights is None else (weights.detach() * r * adv).abs()
        g = torch.where(mask, g, 0.0)
        n = mask.sum().clamp(min=1)
        m = {
            "pg_weight": g.sum() / n,
            "pg_weight_clipped": torch.where(clipped_tokens(r, adv, eps_low, eps_high, dual_clip), g, 0.0).sum() / n,
            "clip_frac_low": _frac((r < 1 - eps_low) & (adv < 0), mask),
            "clip_frac_high": _frac((r > 1 + eps_high) & (adv > 0), mask),
            # k3 estimate of KL(ref || pi_theta) from tokens sampled near ref: (r - 1) - log r
            "approx_kl": torch.where(mask, torch.expm1(log_r.detach()) - log_r.detach(), 0.0).sum()
            / mask.sum().clamp(min=1),
            "n_tokens": mask.sum().float(),
            **_stats("ratio", r, mask),
        }
        if dual_clip is not None:
            m["dual_clip_frac"] = _frac((r > dual_clip) & (adv < 0), mask)
    return m


def ppo_clip_loss(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    weights: Tensor | None = None,
    aggregation: str = "token_mean",
    global_token_count: float | Tensor | None = None,
    global_seq_count: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7) with asymmetric clip and dual clip.

    r = exp(logprobs - prox_logprobs) ``[B, T]``, prox detached; per token
    ``-w * min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``, and for A < 0 additionally capped at
    ``-c A`` (dual clip, Ye et al. 2020, "Mastering complex control in MOBA games", c > 1 + eps_high).
    ``weights`` ``[B, T]`` is a detached per-token factor (discrepancy weight times mask). With
    ``prox_logprobs = behav_logprobs`` this is plain PPO on pi_theta/mu. Denominator: see
    :func:`aggregate`. Gradient only through ``logprobs``.
    """
    _check_clip(eps_low, eps_high, dual_clip)
    mask = _as_bool(loss_mask)
    log_r = safe_log_ratio(logprobs, prox_logprobs.detach(), mask)  # [B, T]
    adv = _token_advantages(advantages, mask)  # [B, T]
    per_token = _clipped_surrogate(log_r.exp(), adv, eps_low, eps_high, dual_clip)
    if weights is not None:
        per_token = per_token * weights.detach()
    loss = aggregate(per_token, mask, aggregation, global_token_count, global_seq_count)
    return loss, _floats(_policy_metrics(log_r, adv, mask, eps_low, eps_high, dual_clip, weights))


def discrepancy_weights(
    prox_logprobs: Tensor,
    behav_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    level: str = "token",
    weight_cap: float | None = 5.0,
    mask_bounds: tuple[float, float] = (0.5, 2.0),
    apply_mask: bool = False,
    exact_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Detached per-token factor w_t * keep_t ``[B, T]`` from d = exp(prox - mu) at ``level``.

    ``weight_cap`` C gives w = min(d, C) (None: no weight, w = 1); ``apply_mask`` multiplies by the
    two-sided mask on ``mask_bounds``. ``mask_kept_fraction`` (fraction of masked-in tokens with d inside
    the bounds) is reported even when the mask is not applied: PPO-EWMA resets on it. Also reports
    d stats, the k3 discrepancy KL mean(d - 1 - log d), the fraction of non-finite mu on masked-in
    tokens (given ratio 1), and with ``exact_mask`` the fraction of tokens with an exact reference.
    Metrics are 0-dim tensors here, so the caller converts all of them with one device sync.
    """
    mask = _as_bool(loss_mask)
    d = discrepancy_ratio(prox_logprobs, behav_logprobs, mask, level)  # [B, T]
    keep = icepop_mask(d, *mask_bounds)
    weights = torch.ones_like(d) if weight_cap is None else tis_weight(d, weight_cap)
    if apply_mask:
        weights = weights * keep
    with torch.no_grad():
        log_d = d.log()
        metrics = {
            # no valid token: nothing was rejected (1.0), so an empty batch never triggers an EWMA reset
            "mask_kept_fraction": torch.where(mask.any(), _frac(keep.bool(), mask), 1.0),
            "weight_mean": torch.where(mask, weights, 0.0).sum() / mask.sum().clamp(min=1),
            "weight_capped_frac": _frac(d > weight_cap, mask) if weight_cap is not None else torch.zeros(()),
            "discrepancy_kl": torch.where(mask, torch.expm1(log_d) - log_d, 0.0).sum() / mask.sum().clamp(min=1),
            "nonfinite_behav_frac": _frac(~torch.isfinite(behav_logprobs), mask),
            **_stats("discrepancy", d, mask),
        }
        if exact_mask is not None:
            metrics["exact_token_fraction"] = _frac(_as_bool(exact_mask), mask)
    return weights, metrics


def gspo_loss(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    weights: Tensor | None = None,
    aggregation: str = "seq_mean_token_mean",
    global_token_count: float | Tensor | None = None,
    global_seq_count: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO sequence-ratio loss (Zheng et al. 2025, "Group Sequence Policy Optimization", GSPO-token).

    s_i = exp(mean_t (logp - prox)) over sequence i's masked-in tokens; each token uses
    s_it = sg[s_i] * exp(logp_t - sg[logp_t]) (value s_i, gradient s_i * grad log pi_t), clipped as
    PPO with the paper's small eps. With a per-sequence advantage and the default
    "seq_mean_token_mean" aggregation this equals the sequence-level GSPO objective.
    """
    _check_clip(eps_low, eps_high, None)
    mask = _as_bool(loss_mask)
    log_r = safe_log_ratio(logprobs, prox_logprobs.detach(), mask)  # [B, T]
    log_s = _to_level(log_r.detach(), mask, "seq_geomean")  # [B, T], constant per row
    log_s_tok = torch.where(mask, log_s + log_r - log_r.detach(), 0.0)
    adv = _token_advantages(advantages, mask)
    per_token = _clipped_surrogate(log_s_tok.exp(), adv, eps_low, eps_high, None)
    if weights is not None:
        per_token = per_token * weights.detach()
    loss = aggregate(per_token, mask, aggregation, global_token_count, global_seq_count)
    metrics = _policy_metrics(log_s_tok, adv, mask, eps_low, eps_high, None, weights)
    metrics["approx_kl"] = torch.where(mask, torch.expm1(log_r) - log_r, 0.0).detach().sum() / mask.sum().clamp(min=1)
    return loss, _floats(metrics)


# ----------------------------------------------------------------------------------------------
# regularisers: KL to a frozen reference, entropy bonus


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, loss_mask: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate ``[B, T]`` (nats) of KL(pi_theta || pi_ref), 0 off ``loss_mask``.

    With x = logprobs - ref_logprobs (ref detached; masked or non-finite slots give x = 0, see
    :func:`safe_log_ratio`), the estimators of Schulman (2020), "Approximating KL divergence":

    - ``k1 = x``: unbiased for KL(pi_theta || pi_ref) on tokens sampled from pi_theta; its gradient
      is grad log pi_theta, whose expectation under pi_theta is 0, so as a loss it pulls nothing
      toward the reference in expectation (it only adds noise);
    - ``k2 = x^2 / 2``: gradient x grad log pi_theta, whose expectation under pi_theta is the
      gradient of KL(pi_theta || pi_ref) (the reverse KL);
    - ``k3 = e^-x - 1 + x`` (the "low-variance" form, >= 0, unbiased for KL(pi_theta || pi_ref)):
      gradient (1 - e^-x) grad log pi_theta, whose expectation under pi_theta is the gradient of
      KL(pi_ref || pi_theta) (the forward KL; Tang & Munos 2025, "On a few pitfalls in KL divergence
      gradient estimation for RL"); its value is capped at :data:`K3_MAX`.

    Example: x = 0.5 gives k1 = 0.5, k2 = 0.125, k3 = e^-0.5 - 1 + 0.5 = 0.106531.

    Raises:
        ValueError: an unknown ``estimator``.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"loss.kl_estimator: unknown estimator {estimator!r}; expected one of {KL_ESTIMATORS}")
    x = safe_log_ratio(logprobs, ref_logprobs.detach(), loss_mask)
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x.square()
    return (torch.expm1(-x) + x).clamp(max=K3_MAX)


def kl_in_reward(behav_logprobs: Tensor, ref_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """Per-sequence KL estimate ``[B]`` (nats) of the sampling policy from the reference: the sum
    over each sequence's loss tokens of ``log mu_t - log pi_ref_t`` (the k1 estimator of
    :func:`kl_penalty`, summed along the sampled sequence; non-finite slots count 0).

    It is the per-token KL penalty of the reward (Ziegler et al. 2019; Ouyang et al. 2022,
    InstructGPT, eq. 2) summed as an outcome estimator sums token rewards (verl's
    ``use_kl_in_reward``): the sequence's reward becomes ``r - kl_reward_coef * kl_in_reward``
    before its group's advantages. Its expectation under mu is KL(mu || pi_ref) of the whole sequence.

    Example: log mu ``[-1.0, -2.0]``, log pi_ref ``[-1.5, -1.0]`` on two loss tokens: 0.5 - 1.0 = -0.5.
    """
    return kl_penalty(behav_logprobs, ref_logprobs, loss_mask, "k1").sum(-1)


def regularisers(
    logprobs: Tensor,
    loss_mask: Tensor,
    cfg: LossConfig,
    *,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    global_token_count: float | Tensor | None = None,
    global_seq_count: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The stabilisers beside the correction: ``kl_coef * agg(k(logp - ref)) - entropy_coef * agg(H)``.

    ``logprobs`` ``[B, T]`` (pi_theta, with gradient), ``ref_logprobs`` ``[B, T]`` (the frozen
    reference policy's log-probs, needed when ``cfg.kl_coef > 0``; reported as ``kl_ref`` whenever
    given), ``entropy`` ``[B, T]`` nats (with gradient when ``cfg.entropy_coef > 0``). Both terms use
    the policy loss's aggregation and denominators (:func:`aggregate`), so they do not depend on the
    micro-batch split either. Metrics: ``kl_ref`` (token mean of k3, the KL estimate to the
    reference, reported whatever the estimator), ``kl_loss`` and ``entropy_loss`` (the two terms'
    aggregated values before their coefficients).

    Raises:
        ValueError: ``cfg.kl_coef > 0`` without ``ref_logprobs``, or ``cfg.entropy_coef > 0``
            without ``entropy``.
    """
    mask = _as_bool(loss_mask)
    total = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    metrics: dict[str, Tensor] = {}
    agg = {"global_token_count": global_token_count, "global_seq_count": global_seq_count}
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"loss.kl_coef = {cfg.kl_coef} needs ref_logprobs (the frozen reference's log-probs)")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError(f"loss.entropy_coef = {cfg.entropy_coef} needs the per-token entropy of the forward")
    if ref_logprobs is not None:
        with torch.no_grad():
            metrics["kl_ref"] = aggregate(kl_penalty(logprobs.detach(), ref_logprobs, mask, "k3"), mask)
        if cfg.kl_coef > 0:
            kl = aggregate(kl_penalty(logprobs, ref_logprobs, mask, cfg.kl_estimator), mask, cfg.aggregation, **agg)
            total = total + cfg.kl_coef * kl
            metrics["kl_loss"] = kl.detach()
    if entropy is not None and cfg.entropy_coef > 0:
        ent = aggregate(at_least_fp32(entropy), mask, cfg.aggregation, **agg)
        total = total - cfg.entropy_coef * ent
        metrics["entropy_loss"] = ent.detach()
    return total, metrics


# ----------------------------------------------------------------------------------------------
# entry point


def compute_policy_loss(
    logprobs: Tensor,
    behav_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cfg: LossConfig,
    *,
    old_logprobs: Tensor | None = None,
    exact_mask: Tensor | None = None,
    ewma_logprobs: Tensor | None = None,
    staleness: Tensor | None = None,
    recompute_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    global_token_count: float | Tensor | None = None,
    global_seq_count: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The loss the learner calls: reference, discrepancy correction, policy loss, regularisers.

    With a reference other than mu this is decoupled PPO (Hilton et al. 2022, "Batch
    size-invariance for policy optimization", eq. 2; AReaL, Fu et al. 2025): per token
    ``-w * keep * min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`` with the detached
    w = min(exp(prox - mu), behav_weight_cap) and optional two-sided mask keep
    (:func:`discrepancy_weights`) and r = exp(logp - prox). Example: mu = 0.2, prox = 0.4,
    pi_theta = 0.6, A = 1, eps 0.2 -> loss -2.4, zero gradient; pi_theta = 0.44 -> -2.2, gradient -2.2.

    logprobs ``[B, T]`` (pi_theta, with gradient), behav_logprobs ``[B, T]`` (mu), advantages ``[B]``
    or ``[B, T]``, loss_mask ``[B, T]``. ``old_logprobs`` (exact pi_old, NaN where missing) and
    ``exact_mask`` are required when ``cfg.oldlogit_route`` is set and ignored otherwise;
    ``ewma_logprobs`` when the proxy is "ewma"; ``staleness`` ``[B, T]`` for the linear proxies; ``recompute_logprobs``
    ``[B, T]`` (the consuming version's log-probs, taken before the batch's first optimizer step)
    from the second optimizer step on one batch, for "recompute" and the linear proxies (see
    :func:`trainer.algorithm.proximal.proximal_reference`). Metrics add ``exact_token_fraction`` (0 without a
    route). ``ref_logprobs`` (the frozen reference policy) and ``entropy`` (per-token, with
    gradient) feed :func:`regularisers`, whose terms are added to the policy loss.

    Raises:
        ValueError: an input the route, the proxy or a regulariser needs is missing.
    """
    mask = _as_bool(loss_mask)
    if not ROUTE_TRAITS[cfg.oldlogit_route].exact:
        old_logprobs = exact_mask = None
    elif old_logprobs is None:
        raise ValueError(f"oldlogit_route={cfg.oldlogit_route!r} needs old_logprobs (NaN where missing)")
    prox = proximal_reference(
        cfg.proxy, logprobs, behav_logprobs, staleness=staleness, ewma_logprobs=ewma_logprobs,
        old_logprobs=old_logprobs, exact_mask=exact_mask, loss_mask=mask, recompute_logprobs=recompute_logprobs,
    )  # fmt: skip
    exact = torch.zeros_like(mask) if old_logprobs is None else resolve_exact_mask(old_logprobs, exact_mask)
    weights, dmetrics = discrepancy_weights(
        prox, behav_logprobs, mask, level=cfg.level, weight_cap=cfg.behav_weight_cap,
        mask_bounds=(cfg.mask_low, cfg.mask_high), apply_mask=cfg.discrepancy_mask, exact_mask=exact,
    )  # fmt: skip
    common = {
        "eps_low": cfg.eps_low, "eps_high": cfg.eps_high, "weights": weights, "aggregation": cfg.aggregation,
        "global_token_count": global_token_count, "global_seq_count": global_seq_count,
    }  # fmt: skip
    if cfg.policy_loss == "gspo":
        loss, metrics = gspo_loss(logprobs, prox, advantages, mask, **common)
    else:
        loss, metrics = ppo_clip_loss(logprobs, prox, advantages, mask, dual_clip=cfg.dual_clip, **common)
    extra, rmetrics = regularisers(
        logprobs, mask, cfg, ref_logprobs=ref_logprobs, entropy=entropy,
        global_token_count=global_token_count, global_seq_count=global_seq_count,
    )  # fmt: skip
    metrics.update(_floats({**dmetrics, **rmetrics}))
    return loss + extra, metrics


@torch.no_grad()
def proxy_diagnostics(
    cfg: LossConfig,
    logprobs: Tensor,
    behav_logprobs: Tensor,
    old_logprobs: Tensor,
    loss_mask: Tensor,
    exact_mask: Tensor,
    staleness: Tensor | None = None,
    ewma_logprobs: Tensor | None = None,
    recompute_logprobs: Tensor | None = None,
) -> dict[str, float]:
    """How well the configured proxy stands in for the exact pi_old on one micro-batch, as sums over
    its tokens (all ``[B, T]``; log-probs in nats, masks bool):

    * ``err``: sum over loss tokens with an exact old log-prob of |proxy - ``old_logprobs``|
      (:func:`trainer.algorithm.proximal.proximal_reference`, ``cfg.proxy``), ``err_n`` their count;
      both 0 when the proxy is "ewma" and its forward did not run (``ewma_logprobs`` None);
    * ``ewma_keep``: loss tokens the discrepancy mask on pi_ewma / mu keeps (:func:`icepop_mask` at
      ``cfg.mask_low`` / ``mask_high``), ``ewma_n`` the loss tokens; 0 without ``ewma_logprobs``.

    Example: proxy "behav", mu = [-1, -2], exact old [-1.5, -2.5] on both loss tokens: err = 1.0,
    err_n = 2.
    """
    out = {"err": 0.0, "err_n": 0.0, "ewma_keep": 0.0, "ewma_n": 0.0}
    mask = loss_mask.bool()
    exact = exact_mask & mask
    if bool(exact.any()) and (ewma_logprobs is not None or cfg.proxy != "ewma"):
        proxy = proximal_reference(
            cfg.proxy, logprobs, behav_logprobs, staleness=staleness, ewma_logprobs=ewma_logprobs,
            recompute_logprobs=recompute_logprobs,
        )  # fmt: skip
        out["err"], out["err_n"] = float((proxy - old_logprobs).abs()[exact].sum()), float(exact.sum())
    if ewma_logprobs is not None:
        keep = icepop_mask(discrepancy_ratio(ewma_logprobs, behav_logprobs, loss_mask), cfg.mask_low, cfg.mask_high)
        out["ewma_keep"], out["ewma_n"] = float((keep.bool() & mask).sum()), float(mask.sum())
    return out
