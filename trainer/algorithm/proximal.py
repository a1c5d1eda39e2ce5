"""Proximal references for the decoupled loss: which log-prob plays pi_old for each token.

All functions return ``[batch, seq]`` fp32 log-probs (nats), detached: a reference never carries
gradient. Per-token versions are the ground truth; staleness of a token is
``k = policy_version - versions[t]`` with ``policy_version`` the learner version that consumes the
batch (queue time counts), so ``k >= 0``.

Invariant: exact old log-probs win token by token. :func:`proximal_reference` builds the configured
proxy for every token, then puts the exact value wherever one is available, so a mixed batch is exact where it can be.
A proxy that is not finite on a token (e.g. mu was NaN) falls back to the detached current log-prob,
so the loss never sees NaN; ``nonfinite_behav_frac`` in the loss metrics counts such tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

PROXIES = ("behav", "recompute", "linear_prox", "loglinear_prox", "ewma")
RECOMPUTE_PROXIES = ("recompute", "linear_prox", "loglinear_prox")
"""Proxies built from the consuming version's log-probs (taken once per batch with several optimizer steps)."""


def at_least_fp32(x: Tensor) -> Tensor:
    """fp32 for half, bf16 and fp32 inputs; fp64 stays fp64 (so gradcheck can run in double)."""
    return x if x.dtype == torch.float64 else x.float()


def _as_bool(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def token_staleness(versions: Tensor, policy_version: int, loss_mask: Tensor) -> Tensor:
    """k = policy_version - versions ``[B, T]`` (long) on masked-in tokens, 0 elsewhere.

    ``policy_version`` is the learner version that consumes the batch, so queue time counts. Raises
    ValueError if a masked-in token claims a version newer than the learner's.
    """
    mask = _as_bool(loss_mask)
    k = torch.where(mask, policy_version - versions.long(), 0)
    if bool((k < 0).any()):
        raise ValueError(f"versions newer than policy_version={policy_version} on masked-in tokens")
    return k


def staleness_alpha(staleness: Tensor) -> Tensor:
    """alpha = (k - 1) / k for k >= 1, and 0 for k = 0 ``[B, T]`` fp32.

    The proxies below interpolate, per token, between mu (version V - k) and the current policy
    (version V) to stand in for pi at version V - 1, the policy before the latest update: alpha is
    the fraction of the way, (V - 1 - (V - k)) / k. k = 1 gives alpha = 0 (ref = mu, exact in version
    space). k = 0 would need extrapolation past mu; vintage uses alpha = 0 there too.
    """
    k = staleness.float()
    return torch.where(k > 1, (k - 1) / k.clamp(min=1), 0.0)


def prox_recompute(logprobs: Tensor) -> Tensor:
    """ref = logp at the consuming version, detached (the AReaL-style recompute baseline).

    With one optimizer step per rollout batch that is the current forward's own log-prob; with
    several, the log-probs taken once under the weights the batch started from (the consuming
    version), so the second and later mini-batches see a ratio away from 1."""
    return at_least_fp32(logprobs.detach())


def prox_exact(old_logprobs: Tensor) -> Tensor:
    """ref = exact pi_old at each token's own version (served by the old-logit routes), detached."""
    return at_least_fp32(old_logprobs.detach())


def prox_loglinear(behav_logprobs: Tensor, logprobs_detached: Tensor, staleness: Tensor) -> Tensor:
    """Log-linear proxy (A-3PO): ref = mu + alpha (logp_detached - mu), alpha from :func:`staleness_alpha`.

    Then w * r = exp(ref - mu) exp(logp - ref) = exp(logp - mu) exactly, and clipping r to
    [1 - eps, 1 + eps] clips the total ratio to [(1 - eps)^(1/(1-alpha)), (1 + eps)^(1/(1-alpha))]
    (e.g. k = 2, eps = 0.2 -> [0.64, 1.44]).
    """
    alpha = staleness_alpha(staleness)
    lp = at_least_fp32(logprobs_detached.detach())
    mu = at_least_fp32(behav_logprobs.detach())
    return mu + alpha * (lp - mu)


def prox_linear(behav_logprobs: Tensor, logprobs_detached: Tensor, staleness: Tensor) -> Tensor:
    """Linear proxy: ref = log((1 - alpha) e^mu + alpha e^logp_detached), via logaddexp.

    With R = exp(logp - mu), r = R / (1 - alpha + alpha R), so clipping r to [1 - eps, 1 + eps]
    clips R to [(1 - eps)(1 - alpha) / (1 - alpha (1 - eps)), (1 + eps)(1 - alpha) / (1 - alpha (1 + eps))]
    (k = 2, eps = 0.2: [2/3, 1.5]).
    """
    alpha = staleness_alpha(staleness)
    lp = at_least_fp32(logprobs_detached.detach())
    mu = at_least_fp32(behav_logprobs.detach())
    mixed = torch.logaddexp(torch.log1p(-alpha) + mu, torch.log(alpha.clamp(min=1e-30)) + lp)
    return torch.where(alpha > 0, mixed, mu)


def mix_reference(exact_old_logprobs: Tensor, exact_mask: Tensor | None, proxy: Tensor) -> Tensor:
    """Token by token: the exact old log-prob where usable (:func:`resolve_exact_mask`), else the proxy.

    Returns ``[B, T]`` detached: tokens of an evicted version get the proxy, the rest exact.
    """
    exact = resolve_exact_mask(exact_old_logprobs, exact_mask)
    return torch.where(exact, prox_exact(exact_old_logprobs), at_least_fp32(proxy.detach()))


def resolve_exact_mask(exact_old_logprobs: Tensor, exact_mask: Tensor | None) -> Tensor:
    """``[B, T]`` bool: tokens whose exact old log-prob is usable (flagged exact *and* finite).

    ``exact_mask`` None means "exact where finite" (the wire format puts NaN where one is missing).
    """
    finite = torch.isfinite(exact_old_logprobs)
    return finite if exact_mask is None else _as_bool(exact_mask) & finite


def proximal_reference(
    proxy: str,
    logprobs: Tensor,
    behav_logprobs: Tensor,
    *,
    staleness: Tensor | None = None,
    ewma_logprobs: Tensor | None = None,
    old_logprobs: Tensor | None = None,
    exact_mask: Tensor | None = None,
    loss_mask: Tensor | None = None,
    recompute_logprobs: Tensor | None = None,
) -> Tensor:
    """The reference ``prox_logprobs`` ``[B, T]`` the loss uses, detached.

    ``proxy`` is one of :data:`PROXIES`: "behav" (mu itself: plain PPO on pi_theta/mu), "recompute"
    (current logp), "linear_prox" / "loglinear_prox" (need ``staleness``), "ewma" (needs
    ``ewma_logprobs``, the log-probs under the EWMA weights). If ``old_logprobs`` is given, exact
    values replace the proxy token by token (see :func:`resolve_exact_mask`); when they cover every
    token of ``loss_mask``, the proxy is not needed and its inputs may be None (the learner can skip
    the EWMA forward).

    ``recompute_logprobs`` ``[B, T]``: the log-probs under the weights of the consuming version,
    taken before the batch's first optimizer step; "recompute" and the linear proxies use it in
    place of ``logprobs`` (needed from the second optimizer step on one batch). None: the current
    ``logprobs`` are those weights' (one optimizer step per batch).
    """
    lp = prox_recompute(logprobs if recompute_logprobs is None else recompute_logprobs)
    if old_logprobs is not None and loss_mask is not None:
        if bool((resolve_exact_mask(old_logprobs, exact_mask) | ~_as_bool(loss_mask)).all()):
            proxy = "recompute"  # placeholder for masked-out slots only
    if proxy == "behav":
        ref = at_least_fp32(behav_logprobs.detach())
    elif proxy == "recompute":
        ref = lp
    elif proxy in ("linear_prox", "loglinear_prox"):
        if staleness is None:
            raise ValueError(f"proxy={proxy!r} needs per-token staleness")
        fn = prox_linear if proxy == "linear_prox" else prox_loglinear
        ref = fn(behav_logprobs, lp, staleness)
    elif proxy == "ewma":
        if ewma_logprobs is None:
            raise ValueError("proxy='ewma' needs ewma_logprobs (log-probs under the EWMA weights)")
        ref = at_least_fp32(ewma_logprobs.detach())
    else:
        raise ValueError(f"unknown proxy={proxy!r}; expected one of {PROXIES}")
    ref = torch.where(torch.isfinite(ref), ref, lp)
    if old_logprobs is not None:
        ref = mix_reference(old_logprobs, exact_mask, ref)
    return ref
