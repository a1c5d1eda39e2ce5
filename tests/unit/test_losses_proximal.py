"""Proximal references: staleness, the linear / log-linear proxies, mixed exact batches."""

import math

import pytest
import torch

from trainer.algorithm.loss_config import loss_config
from trainer.algorithm.losses import compute_policy_loss, ppo_clip_loss
from trainer.algorithm.proximal import (
    mix_reference,
    prox_exact,
    prox_linear,
    prox_loglinear,
    prox_recompute,
    proximal_reference,
    resolve_exact_mask,
    staleness_alpha,
    token_staleness,
)

NAN = float("nan")


def test_case5_per_token_staleness_counts_queue_time():
    versions = torch.tensor([[-1, -1, 3, 3, 3, 4, 4, 5]])  # two prompt tokens without a version
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    assert token_staleness(versions, 6, mask).tolist() == [[0, 0, 3, 3, 3, 2, 2, 1]]
    with pytest.raises(ValueError, match="policy_version=4"):
        token_staleness(versions, 4, mask)


def test_staleness_alpha_convention():
    k = torch.tensor([0, 1, 2, 3, 4, 10])
    assert staleness_alpha(k).tolist() == pytest.approx([0.0, 0.0, 0.5, 2 / 3, 0.75, 0.9])


def test_proxy_values_by_hand():
    mu, lp, k = torch.tensor([[math.log(0.2)]]), torch.tensor([[math.log(0.8)]]), torch.tensor([[2]])
    assert prox_loglinear(mu, lp, k).exp().item() == pytest.approx(0.4)  # geometric mean
    assert prox_linear(mu, lp, k).exp().item() == pytest.approx(0.5)  # arithmetic mean
    for fn in (prox_loglinear, prox_linear):  # k = 0 and k = 1 give mu
        assert fn(mu, lp, torch.tensor([[1]])).item() == pytest.approx(mu.item())
        assert fn(mu, lp, torch.tensor([[0]])).item() == pytest.approx(mu.item())
    x = torch.tensor([[-1.0]], requires_grad=True)
    for ref in (prox_recompute(x), prox_exact(x), prox_loglinear(x, x, k), prox_linear(x, x, k)):
        assert not ref.requires_grad


def _sweep_total_ratios(method, k, eps, adv):
    """Per-token gradient of the learner's loss for ``method`` (a proxy method, the reference from
    the current log-probs at staleness ``k``) over a sweep of total ratios R. The method's weight
    cap 5 never binds here: at k = 2 the weight is sqrt(R) <= 1.74 (log-linear) or (1 + R) / 2 <= 2
    (linear)."""
    total = torch.linspace(0.3, 3.0, 2701, dtype=torch.float64)[None, :]  # [1, T]
    mu = torch.full_like(total, math.log(0.1))
    logp = (mu + total.log()).requires_grad_(True)
    staleness = torch.full(total.shape, k)
    mask = torch.ones_like(total)
    advantages = torch.full_like(total, adv)
    cfg = loss_config(method, eps_low=eps, eps_high=eps, aggregation="seq_mean_token_sum")
    loss, metrics = compute_policy_loss(logp, mu, advantages, mask, cfg, staleness=staleness)
    assert metrics["weight_capped_frac"] == 0.0
    loss.backward()
    return total[0], logp.grad[0].clone(), logp


def _ppo_on_total(logp, mu_value, low, high, adv):
    lp = logp.detach().clone().requires_grad_(True)
    mu = torch.full_like(lp, mu_value)
    loss, _ = ppo_clip_loss(
        lp, mu, torch.full_like(lp, adv), torch.ones_like(lp), eps_low=1 - low, eps_high=high - 1,
        aggregation="seq_mean_token_sum",
    )  # fmt: skip
    loss.backward()
    return lp.grad[0]


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_case12_loglinear_proxy_clips_exactly_the_total_band(adv):
    total, grad, logp = _sweep_total_ratios("loglinear_prox", k=2, eps=0.2, adv=adv)
    low, high = 0.64, 1.44
    away = ((total - low).abs() > 1e-6) & ((total - high).abs() > 1e-6)
    clipped = grad == 0
    expected = (total > high) if adv > 0 else (total < low)
    assert torch.equal(clipped[away], expected[away])
    # weight x ratio is the total ratio, so the unclipped gradient is that of -R A
    assert torch.allclose(grad[~clipped], -total[~clipped] * adv, atol=1e-12)
    # and the whole gradient equals PPO on the total ratio pi_theta/mu with the band [0.64, 1.44]
    assert torch.allclose(grad[away], _ppo_on_total(logp, math.log(0.1), low, high, adv)[away], atol=1e-12)


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_linear_proxy_is_ppo_on_total_ratio_with_a_moved_band(adv):
    total, grad, logp = _sweep_total_ratios("linear_prox", k=2, eps=0.2, adv=adv)
    # r = R / (1 - a + a R) with a = 1/2: r = 1.2 <=> R = 1.5, r = 0.8 <=> R = 2/3
    low, high = 2 / 3, 1.5
    away = ((total - low).abs() > 1e-6) & ((total - high).abs() > 1e-6)
    expected = (total > high) if adv > 0 else (total < low)
    assert torch.equal((grad == 0)[away], expected[away])
    assert torch.allclose(grad[away], _ppo_on_total(logp, math.log(0.1), low, high, adv)[away], atol=1e-12)


def test_case13_mixed_batch_exact_where_available():
    old = torch.tensor([[NAN, NAN, -1.1, -1.2, -1.3]])  # version 3 evicted: tokens 0-1 missing
    exact_mask = torch.tensor([[0, 0, 1, 1, 1]])
    proxy = torch.tensor([[-2.0, -2.1, -2.2, -2.3, -2.4]])
    assert mix_reference(old, exact_mask, proxy)[0].tolist() == pytest.approx([-2.0, -2.1, -1.1, -1.2, -1.3], abs=1e-6)
    assert torch.equal(resolve_exact_mask(old, None), exact_mask.bool())
    # flagged exact but NaN: not usable, the proxy is used
    assert resolve_exact_mask(old, torch.ones(1, 5)).tolist() == [[False, False, True, True, True]]
    logp = torch.full((1, 5), -1.0, requires_grad=True)
    mu = torch.full((1, 5), -1.05)
    loss, metrics = compute_policy_loss(
        logp, mu, torch.tensor([1.0]), torch.ones(1, 5), loss_config("snapshot"), old_logprobs=old,
        exact_mask=exact_mask, ewma_logprobs=proxy,
    )  # fmt: skip
    assert metrics["exact_token_fraction"] == pytest.approx(0.6)
    assert math.isfinite(loss.item())


def test_proximal_reference_dispatch_and_errors():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mu = torch.tensor([[-1.5, NAN]])
    k = torch.tensor([[2, 2]])
    assert proximal_reference("behav", logp, mu).tolist() == [[-1.5, -2.0]]  # NaN mu -> current logp
    assert proximal_reference("recompute", logp, mu).tolist() == [[-1.0, -2.0]]
    assert proximal_reference("loglinear_prox", logp, mu, staleness=k)[0, 0].item() == pytest.approx(-1.25)
    assert proximal_reference("ewma", logp, mu, ewma_logprobs=torch.tensor([[-3.0, -4.0]])).tolist() == [[-3.0, -4.0]]
    with pytest.raises(ValueError, match="staleness"):
        proximal_reference("linear_prox", logp, mu)
    with pytest.raises(ValueError, match="ewma_logprobs"):
        proximal_reference("ewma", logp, mu)
    with pytest.raises(ValueError, match="'median'"):
        proximal_reference("median", logp, mu)
    # every masked-in token exact: the proxy's inputs are not needed
    ref = proximal_reference(
        "ewma", logp, mu, old_logprobs=torch.tensor([[-0.5, NAN]]), loss_mask=torch.tensor([[1, 0]])
    )
    assert ref[0, 0].item() == -0.5


def test_recompute_reference_taken_before_the_first_step_replaces_the_current_logprobs():
    """From the second optimizer step on one batch, "recompute" and the linear proxies read the
    consuming version's log-probs (taken before the first step), not the current ones."""
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)  # after one optimizer step
    before = torch.tensor([[-1.5, -2.5]])  # the consuming version's, before any step
    mu = torch.tensor([[-2.0, -3.0]])
    k = torch.tensor([[2, 2]])  # alpha = 1/2
    assert proximal_reference("recompute", logp, mu, recompute_logprobs=before).tolist() == [[-1.5, -2.5]]
    # log-linear: mu + 1/2 (before - mu) = [-1.75, -2.75] (with the current logp it would be [-1.5, -2.5])
    ref = proximal_reference("loglinear_prox", logp, mu, staleness=k, recompute_logprobs=before)
    assert ref.tolist() == [[-1.75, -2.75]]
    # the references that do not come from the current log-probs ignore it
    assert proximal_reference("behav", logp, mu, recompute_logprobs=before).tolist() == [[-2.0, -3.0]]
    ewma = torch.tensor([[-3.0, -4.0]])
    assert proximal_reference("ewma", logp, mu, ewma_logprobs=ewma, recompute_logprobs=before).tolist() == [
        [-3.0, -4.0]
    ]


def test_recompute_ratio_departs_from_one_and_clips_from_the_second_step():
    """pi_theta 0.6, reference before the step 0.4 (= mu), A = 1, eps 0.2: r = 1.5 is clipped at 1.2,
    loss -1.2 and no gradient. With the current log-prob as reference (one step per batch) r = 1,
    the weight min(0.6 / 0.4, 5) = 1.5 and the loss -1.5 with gradient -1.5 (never clipped)."""
    cfg = loss_config("decoupled_ppo")
    mu, adv, mask = torch.tensor([[math.log(0.4)]]), torch.tensor([1.0]), torch.ones(1, 1)
    logp = torch.tensor([[math.log(0.6)]], requires_grad=True)
    loss, m = compute_policy_loss(logp, mu, adv, mask, cfg, recompute_logprobs=torch.tensor([[math.log(0.4)]]))
    loss.backward()
    assert loss.item() == pytest.approx(-1.2) and logp.grad.item() == 0.0
    assert m["clip_frac_high"] == 1.0 and m["ratio_max"] == pytest.approx(1.5)
    assert m["pg_weight"] == pytest.approx(1.5) and m["pg_weight_clipped"] == pytest.approx(1.5)
    logp = torch.tensor([[math.log(0.6)]], requires_grad=True)
    loss, m = compute_policy_loss(logp, mu, adv, mask, cfg)
    loss.backward()
    assert loss.item() == pytest.approx(-1.5) and logp.grad.item() == pytest.approx(-1.5)
    assert m["clip_frac_high"] == 0.0 and m["ratio_max"] == 1.0 and m["pg_weight_clipped"] == 0.0
