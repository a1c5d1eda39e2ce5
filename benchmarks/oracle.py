"""Exact oracle of the policy-gradient corrections on a softmax bandit: bias, variance, trust region.

    python -m benchmarks.oracle [--out results/oracle] [--max-lag 8] [--delta-scale 1]

No sampling, no model, no Ray: every expectation below is a finite sum over the K actions, so each
number is exact up to float64 rounding, and the whole table takes seconds on one CPU core. The
losses are the learner's own (:func:`trainer.algorithm.losses.compute_policy_loss` with
:func:`trainer.algorithm.loss_config.loss_config`), so the oracle checks the real code.

The problem (each choice is an argument of the functions below; the defaults make the table):

- Bandit. K = 5 actions with rewards r = (1, 0.75, 0.5, 0.25, 0) and policy pi_theta = softmax(theta)
  ``[K]``. True objective J(theta) = E_{a ~ pi_theta}[r(a)]; its gradient (policy-gradient theorem,
  Williams 1992, for a softmax) is dJ/dtheta_j = pi_j (r_j - J).
- Versions. theta_0 = (-1, -0.5, 0, 0.5, 1) (the worst action most likely, so learning moves every
  probability) and theta_{i+1} = theta_i + eta dJ/dtheta(theta_i): exact on-policy expected-gradient
  ascent with eta = 1, one version per optimizer step, versions 0..V with V = the largest lag (8). The
  learner is at version V; a token of lag k was sampled by version v = V - k. With eta = 1 a version
  moves the largest log-prob by about 0.08 nats, so the exact reference's clip (+-0.2) starts to
  bind around lag 3.
- Discrepancy. The inference engine samples from mu = softmax(theta_v + delta) with a fixed
  delta = (0.2, -0.1, 0, -0.2, 0.1) nats (scaled by ``--delta-scale``; 0 gives the table without
  discrepancy); the learner's exact old policy is pi_old = softmax(theta_v).
- Advantage. A(a) = r(a) - E_mu[r]: the exact value of the group-mean baseline the learner's
  estimators approximate (GRPO without the std division, RLOO in the large-group limit). A baseline
  moves no expected gradient where the weights are exact importance ratios, and does where a clip or
  mask drops actions. The methods' ``advantage`` setting is the learner's, applied before the loss,
  and plays no part here.
- Methods. ``ppo`` (reference mu, no weight), ``decoupled_ppo`` (weight min(d, 5) on d = ref/mu),
  ``tis`` (weight min(d, 2)), ``icepop`` (mask 1[0.5 <= d <= 2], no weight), these three with the reference recomputed
  at the current version V, ``loglinear_prox`` and ``linear_prox`` (A-3PO proxies with the token's
  staleness k), ``ppo_ewma`` (the EWMA of the weights, :class:`trainer.algorithm.ewma.EwmaProximal`
  started at theta_0 and updated with theta_1..theta_V, beta = W / (W + 2), W = k unless ``--window``;
  it holds fp32 weights), ``snapshot`` (the exact pi_old of version v). Each with the clip, cap and
  mask of its preset in :data:`trainer.algorithm.loss_config.METHODS`. The EWMA's automatic reset is
  not modelled (its kept mass is reported as ``kept``).
- Per-sample update. One loss row per action a, a copy of theta per row, advantages A(a) and
  ``global_token_count=1``, so the loss is the sum of the rows' losses L(a) and the gradient of row a
  is that of L(a) alone: g(a) = -dL(a)/dtheta ``[K]``, the update direction of one sample a ~ mu.
  Expected update E_mu[g] = sum_a mu(a) g(a): exact, because the batch's token-mean loss is the
  sample mean of L(a) with a ~ mu.
- Bias: ||E_mu[g] - dJ/dtheta(theta_V)||, the same over ||dJ/dtheta||, and the cosine between the two.
- Variance: the per-sample variance E_mu||g||^2 - ||E_mu[g]||^2 (trace of the covariance); a batch of
  n independent samples divides it by n.
- Trust region: from theta_V, ascent on the expected surrogate -E_mu[L] with every reference held
  where the batch started (recompute and the proxies use pi_V's log-probs as ``recompute_logprobs``;
  pi_old and the EWMA do not move, although the learner folds each optimizer step into its EWMA: the
  ascent's steps are far smaller than the learner's). Each step is the natural gradient of the
  softmax (Kakade 2001) scaled so that no logit moves more than ``lr`` nats: the path of the
  natural-gradient flow, at a speed that does not let rare actions crawl, and no optimizer state. The
  clip makes the surrogate flat once an action's ratio r = pi/ref has left [1 - eps, 1 + eps] on its
  advantage's side, and the expected update is exactly zero once every action is there (or masked):
  the ascent has ``stopped``, and the reference's band is the trust region the method enforces.
  Reported: KL(pi_v || pi_new) and max_a |log pi_new/pi_v| (distance from the behaviour version),
  KL(pi_V || pi_new) (how far the update moved), the band [min_a, max_a] of the total ratio
  pi_new/mu, and the true gain J(pi_new) - J(pi_V). The clip is one-sided: an action already beyond
  its band in its advantage's direction is not pulled back, so a stale exact reference bounds the
  update, not the distance from pi_v. Where no point satisfies every band (when the actions with
  A > 0 hold more than 1 / (1 + eps_high) of a normalised reference's mass, for instance), nothing
  stops the ascent within ``steps``; the table marks such an entry "moving" (a lower bound).

Outputs: ``oracle.json`` (every number, with the arguments) and ``README.md`` (the tables, the
command that made them, a reading) in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainer.algorithm.ewma import EwmaProximal
from trainer.algorithm.loss_config import EwmaConfig, LossConfig, loss_config
from trainer.algorithm.losses import compute_policy_loss
from trainer.algorithm.proximal import proximal_reference

DTYPE = torch.float64
METHODS = ("ppo", "decoupled_ppo", "tis", "icepop", "loglinear_prox", "linear_prox", "ppo_ewma", "snapshot")
"""Methods of the table, each a preset of :func:`trainer.algorithm.loss_config.loss_config`."""
REWARDS = (1.0, 0.75, 0.5, 0.25, 0.0)
THETA0 = (-1.0, -0.5, 0.0, 0.5, 1.0)
DELTA = (0.2, -0.1, 0.0, -0.2, 0.1)
HISTORY_LR = 1.0
MAX_LAG = 8
TR_STEPS = 4000
TR_LR = 0.0025


def _t(x: Any) -> Tensor:
    return torch.as_tensor(x, dtype=DTYPE)


# ----------------------------------------------------------------------------------------------
# the bandit


def expected_return(theta: Tensor, rewards: Tensor) -> Tensor:
    """J(theta) = sum_a softmax(theta)_a r_a ``[...]`` for logits ``[..., K]`` and rewards ``[K]``."""
    return (torch.softmax(theta, -1) * rewards).sum(-1)


def true_gradient(theta: Tensor, rewards: Tensor) -> Tensor:
    """dJ/dtheta ``[..., K]``: pi_j (r_j - J) (policy-gradient theorem, Williams 1992, for a softmax policy)."""
    pi = torch.softmax(theta, -1)
    return pi * (rewards - (pi * rewards).sum(-1, keepdim=True))


def version_history(theta0: Tensor, rewards: Tensor, versions: int, lr: float) -> Tensor:
    """Logits of versions 0..``versions`` ``[versions + 1, K]``: theta_{i+1} = theta_i + lr dJ/dtheta(theta_i).

    Raises ValueError for a negative ``versions``.
    """
    if versions < 0:
        raise ValueError(f"versions must be >= 0, got versions={versions!r}")
    out = [_t(theta0)]
    for _ in range(versions):
        out.append(out[-1] + lr * true_gradient(out[-1], rewards))
    return torch.stack(out)


def ewma_logits(history: Tensor, window: float) -> Tensor:
    """Logits ``[K]`` of the PPO-EWMA proximal policy after the versions of ``history`` ``[V + 1, K]``.

    :class:`trainer.algorithm.ewma.EwmaProximal` (Hilton et al. 2022, section 4) created at
    ``history[0]`` and updated with each later version (one optimizer step per version), with the
    bias-corrected rule and beta = W / (W + 2), W = ``window``; its fp32 weights come back as fp64.
    """
    ewma = EwmaProximal({"theta": history[0]}, EwmaConfig(beta_source="window", window=window))
    for theta in history[1:]:
        ewma.update({"theta": theta})
    return ewma.params["theta"].to(DTYPE)


@dataclass(frozen=True)
class Problems:
    """A batch of P (lag, discrepancy) settings of one bandit; every tensor fp64, ``[P, K]`` unless noted.

    ``theta_current`` is theta_V, ``theta_behav`` theta_v (pi_old), ``behav_logprobs`` log mu,
    ``ewma_logprobs`` log pi_ewma, ``advantages`` r - E_mu[r]; ``lags`` ``[P]`` long; ``rewards`` ``[K]``.
    """

    lags: Tensor
    rewards: Tensor
    theta_current: Tensor
    theta_behav: Tensor
    behav_logprobs: Tensor
    ewma_logprobs: Tensor
    advantages: Tensor

    @property
    def mu(self) -> Tensor:
        """Behaviour probabilities ``[P, K]``."""
        return self.behav_logprobs.exp()


def make_problems(
    history: Tensor, lags: list[int], deltas: Tensor, rewards: Tensor, window: float | None = None
) -> Problems:
    """One problem per (lag, delta) pair: the learner at the last version of ``history`` ``[V + 1, K]``.

    ``lags`` (each in 0..V) and ``deltas`` ``[P, K]`` (nats) pair up; the EWMA window is the lag unless
    ``window`` is given. Raises ValueError on a lag outside 0..V or a length mismatch.
    """
    V = history.shape[0] - 1
    if len(lags) != deltas.shape[0]:
        raise ValueError(f"{len(lags)} lags for {deltas.shape[0]} deltas")
    if any(not 0 <= k <= V for k in lags):
        raise ValueError(f"lags must lie in 0..{V}, got {lags}")
    rewards = _t(rewards)
    behav = torch.stack([history[V - k] for k in lags])
    log_mu = torch.log_softmax(behav + _t(deltas), -1)
    ewma = torch.stack([ewma_logits(history, float(k if window is None else window)) for k in lags])
    adv = rewards - (log_mu.exp() * rewards).sum(-1, keepdim=True)
    return Problems(
        lags=torch.tensor(lags),
        rewards=rewards,
        theta_current=history[V].expand(len(lags), -1).clone(),
        theta_behav=behav,
        behav_logprobs=log_mu,
        ewma_logprobs=torch.log_softmax(ewma, -1),
        advantages=adv,
    )


# ----------------------------------------------------------------------------------------------
# the learner's loss, one row per action


def _rows(x: Tensor) -> Tensor:
    """``[P, K]`` -> ``[P * K, 1]``: one loss row (a one-token sequence) per (problem, action)."""
    return x.reshape(-1, 1)


def _loss_kwargs(cfg: LossConfig, problems: Problems) -> dict[str, Tensor]:
    """The inputs :func:`compute_policy_loss` takes for the references, as ``[P * K, 1]`` rows."""
    P, K = problems.behav_logprobs.shape
    kwargs = {
        "staleness": _rows(problems.lags[:, None].expand(P, K)),
        "ewma_logprobs": _rows(problems.ewma_logprobs),
        "recompute_logprobs": _rows(torch.log_softmax(problems.theta_current, -1)),
    }
    if cfg.oldlogit_route != "none":
        kwargs["old_logprobs"] = _rows(torch.log_softmax(problems.theta_behav, -1))
    return kwargs


def per_sample_updates(method: str, problems: Problems, theta: Tensor | None = None) -> Tensor:
    """g(a) = -dL(a)/dtheta ``[P, K, K]`` (problem, sampled action a, logit) of ``method``'s loss.

    L(a) is :func:`compute_policy_loss` on one row holding action a: logprobs log softmax(theta)_a,
    behav_logprobs log mu(a), advantage A(a). ``theta`` ``[P, K]`` (default theta_V) is where the
    gradient is taken; the references stay at the problem's versions. Raises ValueError for an
    unknown method (from :func:`loss_config`).
    """
    cfg = loss_config(method)
    theta = problems.theta_current if theta is None else theta
    P, K = theta.shape
    copies = theta.detach()[:, None, :].expand(P, K, K).reshape(P * K, K).clone().requires_grad_(True)
    actions = torch.arange(K).repeat(P)[:, None]  # [P * K, 1]
    logprobs = torch.log_softmax(copies, -1).gather(1, actions)  # [P * K, 1]
    mask = torch.ones_like(logprobs)
    loss, _ = compute_policy_loss(
        logprobs, _rows(problems.behav_logprobs), problems.advantages.reshape(-1), mask, cfg,
        global_token_count=1, **_loss_kwargs(cfg, problems),
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, copies)
    return -grad.reshape(P, K, K)


def expected_update(method: str, problems: Problems, theta: Tensor | None = None) -> Tensor:
    """E_{a ~ mu}[g(a)] = sum_a mu(a) g(a) ``[P, K]`` (see :func:`per_sample_updates`)."""
    return torch.einsum("pa,pak->pk", problems.mu, per_sample_updates(method, problems, theta))


def reference_stats(method: str, problems: Problems) -> dict[str, Tensor]:
    """Where ``method``'s reference sits, each ``[P]``.

    ``ref_err``: max_a |ref(a) - log pi_old(a)| (nats), the reference's distance from the exact old
    log-prob; ``kept``: sum_a mu(a) 1[mask_low <= exp(ref - log mu) <= mask_high], the behaviour mass
    the discrepancy mask keeps (1 for methods without the mask). The reference is the product's
    :func:`trainer.algorithm.proximal.proximal_reference` at theta_V.
    """
    cfg = loss_config(method)
    kwargs = _loss_kwargs(cfg, problems)
    logprobs = _rows(torch.log_softmax(problems.theta_current, -1))
    mu_rows = _rows(problems.behav_logprobs)
    ref = proximal_reference(cfg.proxy, logprobs, mu_rows, loss_mask=torch.ones_like(logprobs), **kwargs)
    ref = ref.reshape(problems.behav_logprobs.shape)
    old = torch.log_softmax(problems.theta_behav, -1)
    d = (ref - problems.behav_logprobs).exp()
    keep = ((d >= cfg.mask_low) & (d <= cfg.mask_high)).to(DTYPE) if cfg.discrepancy_mask else torch.ones_like(d)
    return {"ref_err": (ref - old).abs().amax(-1), "kept": (problems.mu * keep).sum(-1)}


def gradient_stats(method: str, problems: Problems) -> dict[str, Tensor]:
    """Bias and variance of ``method``'s per-sample update at theta_V, each ``[P]``.

    ``bias`` ||E_mu[g] - dJ/dtheta||, ``rel_bias`` the same over ||dJ/dtheta||, ``cosine`` between
    E_mu[g] and dJ/dtheta (0 where either is zero), ``variance`` E_mu||g||^2 - ||E_mu[g]||^2,
    ``norm`` ||E_mu[g]||, ``true_norm`` ||dJ/dtheta||.
    """
    g = per_sample_updates(method, problems)  # [P, K, K]
    mean = torch.einsum("pa,pak->pk", problems.mu, g)
    true = true_gradient(problems.theta_current, problems.rewards)
    second = torch.einsum("pa,pa->p", problems.mu, (g * g).sum(-1))
    norms = mean.norm(dim=-1) * true.norm(dim=-1)
    return {
        "bias": (mean - true).norm(dim=-1),
        "rel_bias": (mean - true).norm(dim=-1) / true.norm(dim=-1),
        "cosine": torch.where(norms > 0, (mean * true).sum(-1) / norms.clamp(min=1e-300), 0.0),
        "variance": second - (mean * mean).sum(-1),
        "norm": mean.norm(dim=-1),
        "true_norm": true.norm(dim=-1),
    }


def kl(p_logits: Tensor, q_logits: Tensor) -> Tensor:
    """KL(softmax(p) || softmax(q)) in nats ``[...]`` for logits ``[..., K]``."""
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def natural_step(update: Tensor, theta: Tensor, lr: float) -> Tensor:
    """Logit step ``[P, K]``: the natural gradient of a softmax scaled so that its largest entry is ``lr`` nats.

    The Fisher of softmax(theta) is diag(pi) - pi pi^T, and u = update / pi solves F u = update for a
    softmax gradient (whose entries sum to 0; Kakade 2001, "A natural policy gradient"). Dividing u by
    max_a |u_a| changes the speed along the natural-gradient flow, not its path; a zero update gives a
    zero step.
    """
    u = update / torch.softmax(theta, -1)
    scale = u.abs().amax(-1, keepdim=True)
    return torch.where(scale > 0, lr * u / scale.clamp(min=1e-300), 0.0)


def trust_region(method: str, problems: Problems, steps: int = TR_STEPS, lr: float = TR_LR) -> dict[str, Tensor]:
    """Where optimising ``method``'s expected surrogate from theta_V stops, each ``[P]``.

    At most ``steps`` ascent steps theta <- theta + :func:`natural_step` of E_mu[g]
    (:func:`expected_update`), the references held. A problem has ``stopped`` when its expected
    update is exactly zero: every action's clipped surrogate is flat (its ratio has left the clip band
    on its advantage's side) or masked; the steps then change nothing, and the loop ends early once
    every problem has stopped. Returns ``theta`` ``[P, K]`` (the end point), ``steps_taken``,
    ``stopped`` (bool), ``kl_behav`` KL(pi_v || pi_new) and ``max_logratio_behav`` max_a |log
    pi_new/pi_v| (nats), ``kl_current`` KL(pi_V || pi_new), ``total_ratio_min`` / ``total_ratio_max``
    the band of pi_new/mu over actions, ``gain`` J(pi_new) - J(pi_V). Each crossing of a band edge
    overshoots it by at most ``lr`` nats. Raises ValueError for ``steps`` < 1 or ``lr`` <= 0.
    """
    if steps < 1 or not lr > 0:
        raise ValueError(f"need steps >= 1 and lr > 0, got steps={steps!r}, lr={lr!r}")
    theta = problems.theta_current.clone()
    taken = torch.zeros(theta.shape[0], dtype=torch.long)
    stopped = torch.zeros(theta.shape[0], dtype=torch.bool)
    for _ in range(steps + 1):
        update = expected_update(method, problems, theta)
        stopped = (update == 0).all(-1)
        if bool((stopped | (taken == steps)).all()):
            break
        theta = theta + natural_step(update, theta, lr)
        taken += (~stopped).long()
    log_new = torch.log_softmax(theta, -1)
    ratio = (log_new - problems.behav_logprobs).exp()
    return {
        "theta": theta,
        "steps_taken": taken,
        "stopped": stopped,
        "kl_behav": kl(problems.theta_behav, theta),
        "max_logratio_behav": (log_new - torch.log_softmax(problems.theta_behav, -1)).abs().amax(-1),
        "kl_current": kl(problems.theta_current, theta),
        "total_ratio_min": ratio.amin(-1),
        "total_ratio_max": ratio.amax(-1),
        "gain": expected_return(theta, problems.rewards) - expected_return(problems.theta_current, problems.rewards),
    }


# ----------------------------------------------------------------------------------------------
# the table


def run_oracle(
    *,
    rewards: tuple[float, ...] = REWARDS,
    theta0: tuple[float, ...] = THETA0,
    delta: tuple[float, ...] = DELTA,
    delta_scales: tuple[float, ...] = (0.0, 1.0),
    max_lag: int = MAX_LAG,
    history_lr: float = HISTORY_LR,
    window: float | None = None,
    methods: tuple[str, ...] = METHODS,
    steps: int = TR_STEPS,
    lr: float = TR_LR,
) -> dict[str, list[dict[str, Any]]]:
    """Every quantity of the module docstring for each delta scale, lag 0..``max_lag`` and method.

    Returns ``{"rows": [...], "drift": [...]}``: a row per (delta scale, lag, method), and per (delta
    scale, lag) the drift before any update (KL(pi_v || pi_V), max_a |log pi_V/pi_v|, the discrepancy
    KL(pi_old || mu), J(pi_V), ||dJ/dtheta||). Raises ValueError when ``rewards``, ``theta0`` and
    ``delta`` differ in length.
    """
    if not len(rewards) == len(theta0) == len(delta):
        raise ValueError(
            f"rewards, theta0 and delta need one entry per action: {len(rewards)}, {len(theta0)}, {len(delta)}"
        )
    r = _t(rewards)
    history = version_history(_t(theta0), r, max_lag, history_lr)
    lags = [k for _ in delta_scales for k in range(max_lag + 1)]
    scales = [s for s in delta_scales for _ in range(max_lag + 1)]
    problems = make_problems(history, lags, _t(scales)[:, None] * _t(delta), r, window)
    true = true_gradient(problems.theta_current, r)
    old = torch.log_softmax(problems.theta_behav, -1)
    drift = [
        {
            "delta_scale": scales[p],
            "lag": lags[p],
            "kl_behav_current": float(kl(problems.theta_behav[p], problems.theta_current[p])),
            "max_logratio_behav_current": float(
                (torch.log_softmax(problems.theta_current[p], -1) - old[p]).abs().max()
            ),
            "kl_old_mu": float((old[p].exp() * (old[p] - problems.behav_logprobs[p])).sum()),
            "return_current": float(expected_return(problems.theta_current[p], r)),
            "true_norm": float(true[p].norm()),
        }
        for p in range(len(lags))
    ]
    rows = []
    for method in methods:
        stats = {**gradient_stats(method, problems), **reference_stats(method, problems)}
        mean = expected_update(method, problems)
        tr = trust_region(method, problems, steps, lr)
        for p in range(len(lags)):
            row: dict[str, Any] = {"delta_scale": scales[p], "lag": lags[p], "method": method}
            row.update({k: float(v[p]) for k, v in stats.items()})
            row.update({k: float(v[p]) for k, v in tr.items() if k not in ("theta", "steps_taken", "stopped")})
            row["steps_taken"] = int(tr["steps_taken"][p])
            row["stopped"] = bool(tr["stopped"][p])
            row["expected_update"] = mean[p].tolist()
            row["true_gradient"] = true[p].tolist()
            rows.append(row)
    return {"rows": rows, "drift": drift}


def _g(x: float) -> str:
    """Three significant digits, exponent form below 1e-3 (0 stays 0)."""
    return f"{x:.3g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.1e}"


def _method_order(method: str) -> int:
    return METHODS.index(method) if method in METHODS else len(METHODS)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The full README table of ``rows`` (one delta scale): one line per (lag, method)."""
    head = (
        "| lag | method | bias | rel bias | cos | variance | ref err | kept | KL(π_v‖π_new) | max\\|log π_new/π_v\\| "
        "| KL(π_V‖π_new) | π_new/μ band | ΔJ |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|\n"
    )
    lines = []
    for r in sorted(rows, key=lambda r: (r["lag"], _method_order(r["method"]))):
        moving = "" if r["stopped"] else " (moving)"
        lines.append(
            f"| {r['lag']} | {r['method']} | {_g(r['bias'])} | {_g(r['rel_bias'])} | {r['cosine']:.3f} "
            f"| {_g(r['variance'])} | {_g(r['ref_err'])} | {r['kept']:.2f} | {_g(r['kl_behav'])}{moving} "
            f"| {_g(r['max_logratio_behav'])} | {_g(r['kl_current'])} "
            f"| [{r['total_ratio_min']:.2f}, {r['total_ratio_max']:.2f}] | {_g(r['gain'])} |"
        )
    return head + "\n".join(lines) + "\n"


def pivot_table(rows: list[dict[str, Any]], key: str, lags: list[int]) -> str:
    """Methods x ``lags`` table of one quantity ``key`` of ``rows`` (one delta scale)."""
    by = {(r["method"], r["lag"]): r for r in rows}
    methods = sorted({r["method"] for r in rows}, key=_method_order)
    head = "| method | " + " | ".join(f"lag {k}" for k in lags) + " |\n|---|" + "---:|" * len(lags) + "\n"
    body = "".join(f"| {m} | " + " | ".join(_g(by[m, k][key]) for k in lags) + " |\n" for m in methods)
    return head + body


def drift_table(drift: list[dict[str, Any]]) -> str:
    """Per lag: how far pi_V already is from pi_v, and the discrepancy pi_old vs mu."""
    head = (
        "| lag | KL(π_v‖π_V) | max\\|log π_V/π_v\\| | KL(π_old‖μ) | J(π_V) | ‖∇J‖ |\n|---:|---:|---:|---:|---:|---:|\n"
    )
    return head + "".join(
        f"| {d['lag']} | {_g(d['kl_behav_current'])} | {_g(d['max_logratio_behav_current'])} "
        f"| {_g(d['kl_old_mu'])} | {d['return_current']:.4f} | {_g(d['true_norm'])} |\n"
        for d in drift
    )


# ----------------------------------------------------------------------------------------------
# the reading and the files


def _pick(rows: list[dict[str, Any]], method: str, lag: int) -> dict[str, Any]:
    return next(r for r in rows if r["method"] == method and r["lag"] == lag)


def reading(result: dict[str, list[dict[str, Any]]]) -> str:
    """A few sentences on what the numbers show, each number taken from ``result`` (see :func:`run_oracle`)."""
    rows = result["rows"]
    scales = sorted({r["delta_scale"] for r in rows})
    exact0 = [r for r in rows if r["delta_scale"] == 0 and r["lag"] == 0]
    wd = [r for r in rows if r["delta_scale"] == scales[-1]]
    top = max(r["lag"] for r in rows)
    methods = {r["method"] for r in rows}
    out = []
    if exact0:
        out.append(
            f"- **Sanity.** At lag 0 without discrepancy every method's expected update equals the true gradient "
            f"(largest relative bias {max(r['rel_bias'] for r in exact0):.1e})."
        )
    if {"decoupled_ppo", "snapshot"} <= methods:
        dec = [_pick(wd, "decoupled_ppo", k) for k in range(top + 1)]
        snap = [_pick(wd, "snapshot", k) for k in range(top + 1)]
        first = next((k for k in range(top + 1) if snap[k]["rel_bias"] > 0.01), None)
        out.append(
            "- **Bias at the current weights.** A reference recomputed at version V gives ratio 1, so decoupled "
            f"PPO's clip never acts on the first step and its expected update is the true gradient at every lag "
            f"(largest relative bias {max(r['rel_bias'] for r in dec):.1e}) with a per-sample variance growing "
            f"from {_g(dec[0]['variance'])} (lag 0) to {_g(dec[-1]['variance'])} (lag {top}) as the weights "
            "pi_V/mu spread. The exact reference (snapshot) clips pi_V/pi_v: "
            + (
                f"first at lag {first}, the actions whose ratio already left the band in their advantage's "
                f"direction drop out, and at lag {top} its relative bias is {snap[-1]['rel_bias']:.2f} (the "
                f"expected update shrinks to {snap[-1]['norm'] / snap[-1]['true_norm']:.2f} of the true "
                f"gradient's norm, cosine {snap[-1]['cosine']:.2f}). That is the clip working as a trust region, "
                "not an estimation error: the policy has already moved further than the band allows."
                if first is not None
                else "its clip never binds here."
            )
        )
    if "icepop" in methods:
        ice = [_pick(wd, "icepop", k) for k in range(top + 1)]
        out.append(
            "- **IcePop** masks the discrepancy but applies no weight, so mu's sampling bias stays in its "
            f"expected update: relative bias {ice[0]['rel_bias']:.2f} at lag 0 with the discrepancy, "
            f"{ice[-1]['rel_bias']:.2f} at lag {top}, where its mask on pi_V/mu keeps {ice[-1]['kept']:.2f} "
            "of the behaviour mass."
        )
    if {"decoupled_ppo", "snapshot"} <= methods:
        out.append(
            "- **Trust region.** Optimising the surrogate until it stops, decoupled PPO ends within its band of "
            f"pi_V at every lag (KL(pi_V||pi_new) {_g(min(r['kl_current'] for r in dec))}-"
            f"{_g(max(r['kl_current'] for r in dec))}), so its distance from the behaviour version grows with the "
            f"lag: KL(pi_v||pi_new) {_g(dec[0]['kl_behav'])} at lag 0, {_g(dec[-1]['kl_behav'])} at lag {top}. "
            f"The exact reference's update {'shrinks' if snap[-1]['kl_current'] < snap[0]['kl_current'] else 'moves'}"
            f": KL(pi_V||pi_new) {_g(snap[0]['kl_current'])} at lag 0, {_g(snap[-1]['kl_current'])} at lag {top}, "
            "leaving KL(pi_v||pi_new) "
            f"{_g(snap[-1]['kl_behav'])} against the drift KL(pi_v||pi_V) "
            f"{_g(_drift(result, scales[-1], top)['kl_behav_current'])} that happened before the update. The clip "
            "is one-sided: it cannot pull back an action that is already beyond its band, it only stops pushing it "
            "further, so the exact reference bounds the update, not the distance from pi_v."
        )
    others = [m for m in ("ppo_ewma", "loglinear_prox", "linear_prox", "ppo") if m in methods]
    if others:
        out.append(
            "- **Where the reference sits.** A reference whose weight is the uncapped, unmasked exp(ref - mu) "
            "(ppo's is 1 with ref = mu) gives w r = pi_theta/mu, the full importance ratio, so at theta_V its "
            "expected update is the true gradient until the clip on pi_V/ref drops actions: the reference "
            f"decides where the clip acts. At lag {top} (KL(pi_v||pi_new) / relative bias): "
            + ", ".join(
                f"{m} {_g(_pick(wd, m, top)['kl_behav'])} / {_pick(wd, m, top)['rel_bias']:.2f}" for m in others
            )
            + "."
        )
    if "ppo" in methods and len(scales) > 1:
        first = {
            scale: next((r["lag"] for r in sorted(rows, key=lambda r: r["lag"]) if r["method"] == "ppo"
                         and r["delta_scale"] == scale and r["rel_bias"] > 0.01), None)
            for scale in (scales[0], scales[-1])
        }  # fmt: skip
        out.append(
            "- **PPO on pi_theta/mu** clips the total ratio, so discrepancy and staleness share one band: its "
            f"expected update is first biased at lag {first[scales[-1]]} with delta scale {scales[-1]:g}, "
            f"at lag {first[scales[0]]} with {scales[0]:g}."
        )
    moving = [r for r in rows if not r["stopped"]]
    out.append(
        "- **Convergence.** "
        + (
            "Every ascent stopped (zero expected update) within the step budget."
            if not moving
            else f"{len(moving)} ascents did not stop within the budget (marked 'moving'): their distances are "
            "lower bounds."
        )
    )
    return "\n".join(out) + "\n"


def _drift(result: dict[str, list[dict[str, Any]]], scale: float, lag: int) -> dict[str, Any]:
    return next(d for d in result["drift"] if d["delta_scale"] == scale and d["lag"] == lag)


def write_results(result: dict[str, Any], out: Path, command: str) -> None:
    """``oracle.json`` (every number and the arguments) and ``README.md`` (tables and reading) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "oracle.json").write_text(json.dumps(result, indent=1) + "\n")
    rows, args = result["rows"], result["args"]
    top = max(r["lag"] for r in rows)
    key_lags = list(range(top + 1))
    parts = [
        "# Exact oracle of the policy-gradient corrections\n",
        f"Made by `{command}` in {result['elapsed_s']:.1f} s (CPU, float64); the numbers are in `oracle.json`.\n",
        "A softmax bandit where every expectation is an exact sum over the actions (no sampling), with the "
        "learner's own loss for each method; definitions in the docstring of `benchmarks/oracle.py`. "
        f"K = {len(args['rewards'])} actions, rewards {list(args['rewards'])}, theta_0 {list(args['theta0'])}, "
        f"versions by exact on-policy gradient ascent with step {args['history_lr']}, learner at version "
        f"V = {top}, behaviour version v = V - lag, mu = softmax(theta_v + delta) with delta = "
        f"{list(args['delta'])} x scale, EWMA window W = "
        + ("the lag" if args["window"] is None else str(args["window"]))
        + f", trust-region ascent steps of {args['lr']} nats (at most {args['steps']}).\n",
        "Columns: **bias** ||E_mu[g] - ∇J|| and **rel bias** over ||∇J|| at theta_V; **cos** between E_mu[g] and "
        "∇J; **variance** E_mu||g||^2 - ||E_mu[g]||^2 per sample; **ref err** max_a |ref - log pi_old| (nats); "
        "**kept** the behaviour mass the discrepancy mask keeps; then where optimising the expected surrogate "
        "from theta_V stops: **KL(π_v‖π_new)**, **max|log π_new/π_v|**, **KL(π_V‖π_new)** (nats), the band of "
        "the total ratio **π_new/μ** over actions, and the true gain **ΔJ** = J(π_new) - J(π_V).\n",
        "## Reading\n",
        reading(result),
    ]
    for scale in sorted({r["delta_scale"] for r in rows}, reverse=True):
        sel = [r for r in rows if r["delta_scale"] == scale]
        title = f"delta scale {scale:g}" + (" (no train-inference discrepancy)" if scale == 0 else "")
        parts += [
            f"## {title}: relative bias at theta_V\n",
            pivot_table(sel, "rel_bias", key_lags),
            f"## {title}: KL(π_v‖π_new) after the update (nats)\n",
            pivot_table(sel, "kl_behav", key_lags),
            f"## {title}: drift before the update\n",
            drift_table([d for d in result["drift"] if d["delta_scale"] == scale]),
            f"## {title}: every lag and method\n",
            markdown_table(sel),
        ]
    (out / "README.md").write_text("\n".join(parts))


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line: run the oracle and write ``oracle.json`` and ``README.md`` to ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results/oracle"), help="results folder")
    ap.add_argument("--max-lag", type=int, default=MAX_LAG, help="lags 0..max-lag; the learner is at version max-lag")
    ap.add_argument("--delta-scale", type=float, default=1.0, help="scale of delta for the discrepancy table")
    ap.add_argument("--rewards", type=_floats, default=REWARDS, help="comma-separated r(a)")
    ap.add_argument("--theta0", type=_floats, default=THETA0, help="comma-separated logits of version 0")
    ap.add_argument("--delta", type=_floats, default=DELTA, help="comma-separated train-inference logit offset (nats)")
    ap.add_argument("--history-lr", type=float, default=HISTORY_LR, help="step of the version history's ascent")
    ap.add_argument("--window", type=float, default=None, help="EWMA window W (default: the lag)")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated loss methods")
    ap.add_argument("--steps", type=int, default=TR_STEPS, help="most trust-region ascent steps")
    ap.add_argument("--lr", type=float, default=TR_LR, help="trust-region step: largest logit change (nats)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    args = {
        "rewards": a.rewards, "theta0": a.theta0, "delta": a.delta, "delta_scales": (0.0, a.delta_scale),
        "max_lag": a.max_lag, "history_lr": a.history_lr, "window": a.window,
        "methods": tuple(a.methods.split(",")), "steps": a.steps, "lr": a.lr,
    }  # fmt: skip
    t0 = time.perf_counter()
    result: dict[str, Any] = run_oracle(**args)
    result = {"args": args, "elapsed_s": time.perf_counter() - t0, **result}
    command = "python -m benchmarks.oracle" + "".join(
        " " + shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv)
    )
    write_results(result, a.out, command)
    print(f"wrote {a.out / 'oracle.json'} and {a.out / 'README.md'} ({result['elapsed_s']:.1f} s)")
    return result


if __name__ == "__main__":
    main()
