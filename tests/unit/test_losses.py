"""Loss library: hand-worked values and gradients."""

import math

import pytest
import torch

from trainer.algorithm.loss_config import METHODS, LossConfig, loss_config
from trainer.algorithm.losses import (
    aggregate,
    compute_policy_loss,
    discrepancy_ratio,
    discrepancy_weights,
    gspo_loss,
    icepop_mask,
    local_counts,
    ppo_clip_loss,
    safe_log_ratio,
    staleness_ratio,
    tis_weight,
)

LOG = math.log


def t(values, dtype=torch.float32, grad=False):
    return torch.tensor(values, dtype=dtype, requires_grad=grad)


def close(x, expected, tol=1e-5):
    return torch.allclose(x.detach().double(), torch.tensor(expected, dtype=torch.float64), atol=tol, rtol=0)


def decoupled(logp, prox, mu, adv, mask, **fields):
    """The learner's loss (:func:`compute_policy_loss`) of ``decoupled_ppo`` (weight cap 5, eps 0.2,
    no mask unless ``fields`` say otherwise) with ``prox`` as its reference: the consuming version's
    log-probs taken before the step (``recompute_logprobs``)."""
    cfg = loss_config("decoupled_ppo", **fields)
    return compute_policy_loss(logp, mu, adv, mask, cfg, recompute_logprobs=prox)


# ---- non-finite values never reach the loss -------------------------------------------------


def test_case2a_nan_mu_gives_neutral_ratio_and_finite_loss():
    mu = t([[-0.1, -0.2, float("nan"), -0.3]])
    prox = t([[-0.1, -0.25, -2.0, -0.3]])
    mask = torch.ones(1, 4)
    d = discrepancy_ratio(prox, mu, mask)
    assert d[0, 2].item() == 1.0  # not exp(-2.0 - 0.0) = 0.135
    logp = prox.clone().requires_grad_(True)
    loss, metrics = decoupled(logp, prox, mu, t([1.0]), mask)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()
    assert metrics["nonfinite_behav_frac"] == pytest.approx(0.25)
    for method in ("ppo", "loglinear_prox", "decoupled_ppo"):
        lp = prox.clone().requires_grad_(True)
        loss, _ = compute_policy_loss(lp, mu, t([1.0]), mask, loss_config(method), staleness=torch.full((1, 4), 2))
        loss.backward()
        assert math.isfinite(loss.item()) and torch.isfinite(lp.grad).all(), method


def test_case2b_masked_overflow_has_zero_gradient_and_no_nan():
    logp = t([[-2.0, -1.0]], grad=True)
    mu = t([[-91.0, -1.0]])
    mask = t([[0.0, 1.0]])
    assert torch.isinf(torch.exp(logp.detach() - mu))[0, 0]  # the trap: 0 * inf
    loss, _ = ppo_clip_loss(logp, mu, t([1.0]), mask)
    loss.backward()
    assert loss.item() == pytest.approx(-1.0)  # token B alone: -r A = -1
    assert logp.grad[0, 0].item() == 0.0
    assert torch.isfinite(logp.grad).all()
    logp.grad = None
    loss, metrics = decoupled(logp, logp.detach(), mu, t([1.0]), mask)
    loss.backward()
    assert loss.item() == pytest.approx(-1.0) and logp.grad[0, 0].item() == 0.0
    assert all(math.isfinite(v) for v in metrics.values())


def test_case2c_nan_in_masked_prox_slot():
    prox = t([[0.0, float("nan")]])
    mask = t([[1.0, 0.0]])
    logp = t([[0.0, 0.0]], grad=True)
    loss, metrics = ppo_clip_loss(logp, prox, t([1.0]), mask)
    loss.backward()
    assert math.isfinite(loss.item()) and math.isfinite(metrics["approx_kl"])
    assert torch.isfinite(logp.grad).all()


def test_safe_log_ratio_clamps_and_zeroes():
    mask = t([[1.0, 1.0, 0.0, 1.0]])
    out = safe_log_ratio(t([[50.0, -50.0, float("nan"), float("inf")]]), t([[0.0, 0.0, 0.0, 0.0]]), mask)
    assert out.tolist() == [[20.0, -20.0, 0.0, 0.0]]


# ---- clip anchored to the proximal policy, behaviour weight from mu ---------------------------


@pytest.mark.parametrize(("pi_theta", "loss_value", "grad"), [(0.6, -2.4, 0.0), (0.44, -2.2, -2.2)])
def test_case3_decoupled_loss_values(pi_theta, loss_value, grad):
    logp = t([[LOG(pi_theta)]], grad=True)
    loss, metrics = decoupled(
        logp, t([[LOG(0.4)]]), t([[LOG(0.2)]]), t([1.0]), torch.ones(1, 1), eps_low=0.2, eps_high=0.2,
        behav_weight_cap=5.0,
    )  # fmt: skip
    loss.backward()
    assert loss.item() == pytest.approx(loss_value, abs=1e-5)
    assert logp.grad.item() == pytest.approx(grad, abs=1e-5)
    assert metrics["weight_mean"] == pytest.approx(2.0)
    assert metrics["clip_frac_high"] == (1.0 if pi_theta == 0.6 else 0.0)


@pytest.mark.parametrize(
    ("pi_theta", "snapshot", "recompute"),
    [
        # inside the band (r = 0.27 / 0.25 = 1.08): w r = (0.25 / 0.2)(0.27 / 0.25) = pi_theta / mu = 1.35
        (0.27, (-1.35, -1.35), (-1.35, -1.35)),
        # outside (r = 1.4 > 1.2): exact pi_old clips (loss -1.25 x 1.2, no gradient), recompute does not
        (0.35, (-1.5, 0.0), (-1.75, -1.75)),
    ],
)
def test_exact_old_logits_differ_from_recompute_only_on_clipped_tokens(pi_theta, snapshot, recompute):
    """mu = 0.2, exact pi_old = 0.25, A = 1 (results/methods/README.md, reading 2): the same value and
    gradient while r stays inside [1 - eps, 1 + eps]; only a clipped token loses its gradient."""
    for cfg, (value, grad) in ((loss_config("snapshot"), snapshot), (loss_config("decoupled_ppo"), recompute)):
        logp = t([[LOG(pi_theta)]], grad=True)
        loss, _ = compute_policy_loss(
            logp, t([[LOG(0.2)]]), t([1.0]), torch.ones(1, 1), cfg,
            old_logprobs=t([[LOG(0.25)]]), exact_mask=torch.ones(1, 1, dtype=torch.bool),
            ewma_logprobs=t([[LOG(0.25)]]),
        )  # fmt: skip
        loss.backward()
        assert (loss.item(), logp.grad.item()) == (pytest.approx(value, abs=1e-5), pytest.approx(grad, abs=1e-5))


def test_case3_failure_signatures_differ():
    logp, mu = t([[LOG(0.6)]], grad=True), t([[LOG(0.2)]])
    # (ii) clipping the behaviour ratio pi_theta/mu = 3.0 instead of r
    wrong, _ = ppo_clip_loss(logp, mu, t([1.0]), torch.ones(1, 1))
    assert wrong.item() == pytest.approx(-1.2, abs=1e-5)
    # (i) recomputing pi_prox at the current weights: r = 1, the clip never engages
    loss, metrics = compute_policy_loss(logp, mu, t([1.0]), torch.ones(1, 1), loss_config("decoupled_ppo"))
    assert metrics["clip_frac_high"] == 0.0 and metrics["ratio_mean"] == pytest.approx(1.0)
    assert loss.item() == pytest.approx(-3.0, abs=1e-5)


def test_behaviour_weight_cap_binds():
    logp = t([[LOG(0.9)]], grad=True)
    loss, metrics = decoupled(logp, logp.detach(), t([[LOG(0.1)]]), t([1.0]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(-5.0, abs=1e-5)  # min(9, 5) * r = 1
    assert metrics["weight_capped_frac"] == 1.0


# ---- PPO clip: asymmetric and dual clip, by hand and by gradcheck ------------------------------


def _grad_of(fn, logp):
    logp = logp.clone().requires_grad_(True)
    loss, metrics = fn(logp)
    loss.backward()
    return loss.item(), logp.grad, metrics


def test_asymmetric_clip_by_hand():
    ratios = [1.25, 1.3, 0.81, 0.79]
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    logp = t([[LOG(r) for r in ratios]])
    loss, grad, metrics = _grad_of(
        lambda lp: ppo_clip_loss(lp, torch.zeros(1, 4), adv, torch.ones(1, 4), eps_low=0.2, eps_high=0.28), logp
    )
    # unclipped: d/dlogp of -r A / N = -r A / 4; clipped: 0
    assert close(grad, [[-1.25 / 4, 0.0, 0.81 / 4, 0.0]], 1e-6)
    assert loss == pytest.approx((-1.25 - 1.28 + 0.81 + 0.8) / 4, abs=1e-6)
    assert metrics["clip_frac_high"] == 0.25 and metrics["clip_frac_low"] == 0.25
    assert metrics["ratio_max"] == pytest.approx(1.3) and metrics["ratio_min"] == pytest.approx(0.79)


def test_dual_clip_caps_negative_advantage():
    logp = t([[LOG(5.0)]])
    fn = lambda lp, c: ppo_clip_loss(lp, torch.zeros(1, 1), t([-1.0]), torch.ones(1, 1), dual_clip=c)  # noqa: E731
    loss, grad, metrics = _grad_of(lambda lp: fn(lp, 3.0), logp)
    assert loss == pytest.approx(3.0) and grad.item() == 0.0 and metrics["dual_clip_frac"] == 1.0
    loss, grad, _ = _grad_of(lambda lp: fn(lp, None), logp)
    assert loss == pytest.approx(5.0) and grad.item() == pytest.approx(5.0)
    with pytest.raises(ValueError, match="dual_clip"):
        fn(logp, 1.1)


def _points(dtype=torch.float64):
    # log-ratios away from every clip boundary, mixed advantage signs, one masked slot
    logp = torch.tensor([[0.3, -0.4, 0.05, 1.6], [-0.1, 0.15, -1.7, 0.0]], dtype=dtype, requires_grad=True)
    prox = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.3]], dtype=dtype)
    mu = torch.tensor([[0.2, -0.3, 0.4, 0.1], [-0.9, 0.1, 0.05, 0.0]], dtype=dtype)
    adv = torch.tensor([[1.0, -1.0, 0.5, -2.0], [2.0, -0.5, 1.0, 1.0]], dtype=dtype)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    return logp, prox, mu, adv, mask


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_gradcheck_policy_losses(aggregation):
    logp, prox, mu, adv, mask = _points()
    kw = {"aggregation": aggregation}
    fns = [
        lambda lp: ppo_clip_loss(lp, prox, adv, mask, eps_high=0.28, dual_clip=3.0, **kw)[0],
        lambda lp: decoupled(lp, prox, mu, adv, mask, behav_weight_cap=1.2, discrepancy_mask=True, **kw)[0],
        lambda lp: decoupled(lp, prox, mu, adv, mask, level="seq_geomean", **kw)[0],
        # GSPO-token's gradient is the sequence objective's only with one advantage per sequence
        lambda lp: gspo_loss(lp, prox, adv[:, 0], mask, eps_low=0.5, eps_high=0.5, **kw)[0],
    ]
    for fn in fns:
        assert torch.autograd.gradcheck(fn, (logp,))


def test_ppo_gradient_by_hand_matches_formula():
    logp, prox, mu, adv, mask = _points()
    # a cap of 100 never binds: the largest weight is exp(prox - mu) = exp(0.9) = 2.46
    loss, _ = decoupled(logp, prox, mu, adv, mask, behav_weight_cap=100.0, eps_low=0.2, eps_high=0.2)
    loss.backward()
    r, w = (logp - prox).exp().detach(), (prox - mu).exp()
    clipped = ((r > 1.2) & (adv > 0)) | ((r < 0.8) & (adv < 0))
    expected = torch.where(clipped | (mask == 0), 0.0, -w * r * adv) / mask.sum()
    assert torch.allclose(logp.grad, expected, atol=1e-12)


# ---- discrepancy corrections ------------------------------------------------------------------


def test_tis_and_icepop_token_level():
    d = t([[0.3, 0.5, 1.0, 2.0, 2.5, 9.0]])
    assert close(tis_weight(d, 2.0), [[0.3, 0.5, 1.0, 2.0, 2.0, 2.0]])
    assert icepop_mask(d, 0.5, 2.0).tolist() == [[0.0, 1.0, 1.0, 1.0, 0.0, 0.0]]
    with pytest.raises(ValueError):
        icepop_mask(d, 2.0, 0.5)
    with pytest.raises(ValueError):
        tis_weight(d, 0.0)


def test_sequence_level_discrepancy_product_and_geomean():
    ref = t([[LOG(2.0), LOG(2.0), float("nan")], [LOG(0.5), 0.0, 0.0]])
    mu = torch.zeros(2, 3)
    mask = t([[1, 1, 0], [1, 1, 1]])
    assert close(discrepancy_ratio(ref, mu, mask, "seq_product"), [[4.0] * 3, [0.5] * 3])
    geo = discrepancy_ratio(ref, mu, mask, "seq_geomean")
    assert close(geo, [[2.0] * 3, [0.5 ** (1 / 3)] * 3])
    with pytest.raises(ValueError, match="level"):
        discrepancy_ratio(ref, mu, mask, "sequence")
    # a sequence-level mask rejects the whole sequence
    w, m = discrepancy_weights(ref, mu, mask, level="seq_product", weight_cap=None, apply_mask=True)
    assert w.tolist() == [[0.0] * 3, [1.0] * 3]
    assert m["mask_kept_fraction"].item() == pytest.approx(3 / 5)


def test_case10_identity_at_equal_logprobs():
    x = t([[-0.7, -1.3, -2.0]])
    mask = torch.ones(1, 3)
    assert discrepancy_ratio(x, x, mask).tolist() == [[1.0] * 3]
    assert staleness_ratio(x, x, mask).tolist() == [[1.0] * 3]
    assert icepop_mask(discrepancy_ratio(x, x, mask), 0.5, 2.0).tolist() == [[1.0] * 3]


def test_case10_exact_old_logits_first_minibatch_only_discrepancy_acts():
    logp = t([[-0.5, -1.0]], grad=True)
    mu = t([[-0.6, -0.8]])
    cfg = loss_config("snapshot", discrepancy_mask=False)
    loss, metrics = compute_policy_loss(logp, mu, t([1.0]), torch.ones(1, 2), cfg, old_logprobs=logp.detach().clone())
    loss.backward()
    assert metrics["ratio_mean"] == pytest.approx(1.0) and metrics["exact_token_fraction"] == 1.0
    d = (logp.detach() - mu).exp()
    assert loss.item() == pytest.approx(-(d.sum() / 2).item(), abs=1e-6)


# ---- aggregation -----------------------------------------------------------------------------


def _case6():
    loss1, mask1 = t([[1.0, 1.0]], grad=True), torch.ones(1, 2)
    loss2, mask2 = t([[0.0] * 8], grad=True), torch.ones(1, 8)
    return (loss1, mask1), (loss2, mask2)


def test_case6_token_mean_independent_of_split():
    (l1, m1), (l2, m2) = _case6()
    n = local_counts(m1)["tokens"] + local_counts(m2)["tokens"]
    split = aggregate(l1, m1, "token_mean", n) + aggregate(l2, m2, "token_mean", n)
    split.backward()
    assert split.item() == pytest.approx(0.2)
    whole_values = torch.cat([torch.nn.functional.pad(l1, (0, 6)), l2]).detach().requires_grad_(True)
    whole_mask = torch.cat([torch.nn.functional.pad(m1, (0, 6)), m2])
    whole = aggregate(whole_values, whole_mask, "token_mean")
    whole.backward()
    assert whole.item() == pytest.approx(0.2)
    assert torch.allclose(torch.cat([l1.grad[0], l2.grad[0]]), whole_values.grad[whole_mask.bool()])
    # two data-parallel ranks, one micro-batch each: the all-reduced count gives the same sum
    counts = torch.tensor([local_counts(m1)["tokens"], local_counts(m2)["tokens"]]).sum()
    assert (aggregate(l1, m1, global_token_count=counts) + aggregate(l2, m2, global_token_count=counts)).item() == (
        pytest.approx(0.2)
    )
    # the failure signature: per-micro-batch means averaged
    naive = (aggregate(l1, m1) + aggregate(l2, m2)) / 2
    assert naive.item() == pytest.approx(0.5)


def test_case6_each_mode_has_its_own_value():
    values = torch.tensor([[1.0, 1.0] + [0.0] * 6, [0.0] * 8])
    mask = torch.tensor([[1, 1] + [0] * 6, [1] * 8])
    assert aggregate(values, mask, "token_mean").item() == pytest.approx(0.2)
    assert aggregate(values, mask, "seq_mean_token_mean").item() == pytest.approx(0.5)
    assert aggregate(values, mask, "seq_mean_token_sum").item() == pytest.approx(1.0)
    assert aggregate(values[:1], mask[:1], "seq_mean_token_mean", global_seq_count=2).item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="token_sum"):
        aggregate(values, mask, "token_sum")


def test_aggregate_ignores_nan_in_masked_slots_and_empty_mask_is_zero():
    values = t([[1.0, float("nan")]])
    assert aggregate(values, t([[1, 0]])).item() == 1.0
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        assert aggregate(values, torch.zeros(1, 2), mode).item() == 0.0


def test_kept_fraction_of_an_empty_batch_is_one():
    _, metrics = discrepancy_weights(torch.zeros(1, 2), torch.full((1, 2), 5.0), torch.zeros(1, 2))
    assert metrics["mask_kept_fraction"].item() == 1.0


def test_mask_rejected_tokens_stay_in_denominator():
    logp = torch.zeros(1, 4, requires_grad=True)
    mu = t([[0.0, 0.0, 0.0, 3.0]])  # d = exp(0 - 3) = 0.05: rejected by [0.5, 2]
    loss, metrics = decoupled(logp, logp.detach(), mu, t([1.0]), torch.ones(1, 4), discrepancy_mask=True)
    assert loss.item() == pytest.approx(-3 / 4)  # 3 kept tokens of loss -1, denominator 4
    assert metrics["mask_kept_fraction"] == 0.75


# ---- GSPO ---------------------------------------------------------------------------------------


def test_gspo_sequence_ratio_value_and_gradient():
    logp = t([[0.1, -0.1, 0.3, 7.0]], dtype=torch.float64, grad=True)
    mask = t([[1, 1, 1, 0]])
    loss, metrics = gspo_loss(logp, torch.zeros(1, 4, dtype=torch.float64), t([1.0]), mask, eps_low=0.5, eps_high=0.5)
    loss.backward()
    s = math.exp(0.1)
    assert loss.item() == pytest.approx(-s)
    assert close(logp.grad, [[-s / 3] * 3 + [0.0]])
    assert metrics["ratio_mean"] == pytest.approx(s)
    logp.grad = None
    loss, metrics = gspo_loss(logp, torch.zeros(1, 4, dtype=torch.float64), t([1.0]), mask)  # paper's eps: clipped
    loss.backward()
    assert loss.item() == pytest.approx(-(1 + 4e-4)) and metrics["clip_frac_high"] == 1.0
    assert logp.grad.abs().max().item() == 0.0


# ---- the method registry and the entry point ----------------------------------------------------


def _method_inputs(dtype=torch.float32):
    torch.manual_seed(0)
    logp = (torch.randn(3, 5, dtype=dtype) * 0.3 - 1.0).requires_grad_(True)
    mu = logp.detach() + torch.randn(3, 5, dtype=dtype) * 0.8  # off-policy enough for caps and clips to bind
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 0, 1, 1, 0], [1, 1, 1, 1, 1]])
    extras = {
        "old_logprobs": torch.where(torch.rand(3, 5) < 0.5, mu + 0.05, float("nan")),
        "ewma_logprobs": mu + 0.1,
        "staleness": torch.randint(0, 6, (3, 5)),
    }
    return logp, mu, torch.tensor([1.0, -0.5, 0.3]), mask, extras


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_runs_with_finite_loss_gradient_and_metrics(method):
    logp, mu, adv, mask, extras = _method_inputs()
    cfg = loss_config(method)
    assert isinstance(cfg, LossConfig) and cfg.method == method
    loss, metrics = compute_policy_loss(logp, mu, adv, mask, cfg, **extras)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()
    assert logp.grad[mask == 0].abs().max().item() == 0.0
    for key in (
        "clip_frac_low",
        "clip_frac_high",
        "mask_kept_fraction",
        "ratio_mean",
        "approx_kl",
        "exact_token_fraction",
    ):
        assert math.isfinite(metrics[key]), key
    assert all(isinstance(v, float) for v in metrics.values())
    routed = cfg.oldlogit_route != "none"
    assert (metrics["exact_token_fraction"] > 0) == routed


def test_methods_differ_from_each_other():
    logp, mu, adv, mask, extras = _method_inputs()
    values = {
        m: round(compute_policy_loss(logp, mu, adv, mask, loss_config(m), **extras)[0].item(), 6) for m in METHODS
    }
    distinct_losses = {"ppo", "decoupled_ppo", "tis", "icepop", "linear_prox", "loglinear_prox", "ppo_ewma", "gspo"}
    assert len({values[m] for m in distinct_losses}) == len(distinct_losses)


def test_loss_config_validation_names_fields():
    with pytest.raises(ValueError, match="unknown loss method='ppo2'"):
        loss_config("ppo2")
    with pytest.raises(ValueError, match="eps_low"):
        LossConfig(eps_low=1.5)
    with pytest.raises(ValueError, match="mask_low"):
        LossConfig(mask_low=3.0, mask_high=2.0)
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(dual_clip=1.1)
    with pytest.raises(ValueError, match="nonsense"):
        LossConfig(nonsense=1)
    assert loss_config("tis", behav_weight_cap=3.0).behav_weight_cap == 3.0


def test_route_without_old_logprobs_is_refused():
    logp, mu, adv, mask, extras = _method_inputs()
    extras.pop("old_logprobs")
    with pytest.raises(ValueError, match="old_logprobs"):
        compute_policy_loss(logp, mu, adv, mask, loss_config("snapshot"), **extras)


def test_clipped_tokens_are_the_constant_branches():
    from trainer.algorithm.losses import clipped_tokens

    r = t([[1.3, 0.7, 3.5, 1.3, 0.7]])
    adv = t([[1.0, -1.0, -1.0, -1.0, 1.0]])
    assert clipped_tokens(r, adv, 0.2, 0.2, 3.0).tolist() == [[True, True, True, False, False]]
    assert clipped_tokens(r, adv, 0.2, 0.2, None).tolist() == [[True, True, False, False, False]]


def test_share_of_gradient_weight_on_clipped_tokens():
    """Token a: r = 1.5, A = +1 (clipped, |w r A| = 1.5); token b: r = 1, A = -1 (|w r A| = 1).
    pg_weight = (1.5 + 1) / 2 = 1.25, pg_weight_clipped = 1.5 / 2 = 0.75: the clip removed 60%."""
    logp = t([[LOG(0.6), LOG(0.5)]], grad=True)
    prox = t([[LOG(0.4), LOG(0.5)]])
    loss, m = ppo_clip_loss(logp, prox, t([[1.0, -1.0]]), torch.ones(1, 2))
    loss.backward()
    assert m["pg_weight"] == pytest.approx(1.25) and m["pg_weight_clipped"] == pytest.approx(0.75)
    assert close(logp.grad, [[0.0, 0.5]])  # d(-r A / 2)/d logp = 0 (clipped), +1/2 for b
