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
    from benchmarks.oracle_report import write_results

    write_results(result, a.out, command)
    print(f"wrote {a.out / 'oracle.json'} and {a.out / 'README.md'} ({result['elapsed_s']:.1f} s)")
    return result


if __name__ == "__main__":
    main()
