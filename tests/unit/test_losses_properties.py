"""Property tests (hypothesis): the ratio decomposition d * r = pi_theta / mu and that masked tokens never matter."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.algorithm.loss_config import loss_config
from trainer.algorithm.losses import compute_policy_loss, discrepancy_ratio, staleness_ratio

# |logp - mu| <= 20 keeps every exponent inside MAX_LOG_RATIO, where the identity is exact
logprob = st.floats(min_value=-10.0, max_value=0.0, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(mu=logprob, ref=logprob, logp=logprob)
def test_case10_decomposition_identity(mu, ref, logp):
    as_t = lambda x: torch.tensor([[x]], dtype=torch.float64)  # noqa: E731
    mask = torch.ones(1, 1)
    product = discrepancy_ratio(as_t(ref), as_t(mu), mask) * staleness_ratio(as_t(logp), as_t(ref), mask)
    assert math.isclose(product.item(), math.exp(logp - mu), rel_tol=1e-6)


junk = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 0.0, -95.0, 40.0])
METHODS = ["ppo", "decoupled_ppo", "tis", "icepop", "linear_prox", "loglinear_prox", "ppo_ewma", "snapshot", "gspo"]


def _loss_and_grad(method, level, aggregation, logp, mu, adv, mask, extras):
    cfg = loss_config(method, level=level, aggregation=aggregation)
    lp = logp.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(lp, mu, adv, mask, cfg, **extras)
    loss.backward()
    return loss.item(), lp.grad, metrics


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    shape=st.tuples(st.integers(1, 3), st.integers(1, 6)),
    method=st.sampled_from(METHODS),
    level=st.sampled_from(["token", "seq_product", "seq_geomean"]),
    aggregation=st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]),
    fill=junk,
)
def test_masked_tokens_never_change_the_loss(seed, shape, method, level, aggregation, fill):
    g = torch.Generator().manual_seed(seed)
    logp = torch.randn(shape, generator=g, dtype=torch.float64) * 0.5 - 1.0
    mu = logp + torch.randn(shape, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    mask = torch.rand(shape, generator=g) < 0.6
    extras = {
        "old_logprobs": torch.where(torch.rand(shape, generator=g) < 0.5, mu + 0.1, float("nan")),
        "ewma_logprobs": mu - 0.2,
        "staleness": torch.randint(0, 5, shape, generator=g),
    }
    base_loss, base_grad, base_metrics = _loss_and_grad(method, level, aggregation, logp, mu, adv, mask, extras)

    # overwrite every masked-out slot of every input with junk
    def spoil(x):
        return torch.where(mask, x, torch.tensor(fill, dtype=x.dtype) if x.is_floating_point() else 0 * x + 99)

    spoiled = {k: spoil(v) for k, v in extras.items()}
    loss, grad, metrics = _loss_and_grad(method, level, aggregation, spoil(logp), spoil(mu), spoil(adv), mask, spoiled)
    assert math.isfinite(base_loss)
    assert loss == base_loss
    assert torch.equal(grad, base_grad)
    assert torch.all(grad[~mask] == 0)
    assert metrics == base_metrics
