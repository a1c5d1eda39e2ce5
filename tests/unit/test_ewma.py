"""PPO-EWMA bookkeeping, resets, checkpoints, and forwards with EWMA weights."""

import math

import pytest
import torch
from torch import nn

from protocol import EwmaStatus
from trainer.algorithm.ewma import EwmaProximal, beta_from_lag, beta_from_window, step_beta
from trainer.algorithm.loss_config import EwmaConfig
from trainer.algorithm.losses import discrepancy_weights


class Scalar(nn.Module):
    def __init__(self, value: float = 0.0) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.tensor(value))


def _set(model: Scalar, value: float) -> None:
    with torch.no_grad():
        model.theta.fill_(value)


def test_case11_bias_corrected_update():
    model = Scalar(0.0)
    ewma = EwmaProximal(model, EwmaConfig(beta_source="window", window=2))
    assert ewma.beta == 0.5 and ewma.total == 1.0
    _set(model, 1.0)
    ewma.update(model)
    assert ewma.params["theta"].item() == pytest.approx(0.666667, abs=1e-6)
    assert ewma.total == pytest.approx(1.5)
    _set(model, 2.0)
    ewma.update(model)
    assert ewma.params["theta"].item() == pytest.approx(1.428571, abs=1e-6)
    assert ewma.total == pytest.approx(1.75)
    assert ewma.updates == 2


def test_case11_beta_from_window_and_lag():
    assert [beta_from_window(w) for w in (1, 2, 4, 8)] == pytest.approx([1 / 3, 1 / 2, 2 / 3, 4 / 5])
    assert beta_from_window(0) == 0.0
    assert beta_from_lag(1.0) == 0.5 and beta_from_lag(3.0) == 0.75
    for fn in (beta_from_window, beta_from_lag):
        with pytest.raises(ValueError):
            fn(-1)


def test_beta_sources():
    model = Scalar()
    lag = EwmaProximal(model, EwmaConfig(beta_source="lag", initial_lag=1.0))
    assert lag.beta == 0.5
    lag.observe_lag(3.0)
    assert lag.beta == 0.75
    with pytest.raises(ValueError, match="mean_lag"):
        lag.observe_lag(float("nan"))
    assert EwmaProximal(model, EwmaConfig(beta_source="fixed", beta=0.9)).beta == 0.9
    with pytest.raises(ValueError, match="beta"):
        EwmaConfig(beta=1.0)


def test_step_beta_counts_the_lag_inside_a_batch():
    # one step per version: the per-version rules themselves
    assert step_beta(1.0, 1) == 0.5 and step_beta(0.0, 1) == 0.0
    # s = 1 version, S = 2 steps: 1 * 2 + (2 - 1) / 2 = 2.5 steps -> 2.5 / 3.5 = 5/7
    assert step_beta(1.0, 2) == pytest.approx(5 / 7)
    # s = 0, S = 2: the second step's tokens are one step old, mean 0.5 -> 1/3 (not 0)
    assert step_beta(0.0, 2) == pytest.approx(1 / 3)
    # s = 1, S = 4: 4 + 1.5 = 5.5 steps -> 11/13
    assert step_beta(1.0, 4) == pytest.approx(11 / 13)
    for lag, steps in [(-1.0, 1), (math.nan, 1), (math.inf, 1), (1.0, 0)]:
        with pytest.raises(ValueError, match="mean_lag|steps_per_version"):
            step_beta(lag, steps)


def test_every_source_is_rescaled_by_the_steps_per_version():
    model = Scalar()
    # window W = 2 (mean lag 1 version), S = 2 -> 5/7; W = 0 with S = 2 -> 1/3, a trust region on step 2
    assert EwmaProximal(model, EwmaConfig(window=2), steps_per_version=2).beta == pytest.approx(5 / 7)
    assert EwmaProximal(model, EwmaConfig(window=0), steps_per_version=2).beta == pytest.approx(1 / 3)
    # measured lag of 1 version with S = 2 -> 5/7
    lag = EwmaProximal(model, EwmaConfig(beta_source="lag"), steps_per_version=2)
    lag.observe_lag(1.0)
    assert lag.beta == pytest.approx(5 / 7)
    # fixed beta 0.5 per version (mean lag 1) with S = 2 -> 5/7; with S = 1 it is 0.5 itself
    assert EwmaProximal(model, EwmaConfig(beta_source="fixed", beta=0.5), steps_per_version=2).beta == pytest.approx(
        5 / 7
    )
    assert EwmaProximal(model, EwmaConfig(beta_source="fixed", beta=0.5)).beta == 0.5
    with pytest.raises(ValueError, match="steps_per_version"):
        EwmaProximal(model, steps_per_version=0)


def test_ewma_equals_explicit_weighted_average():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ewma = EwmaProximal(model, EwmaConfig(beta_source="fixed", beta=0.7))
    history = [model.weight.detach().clone()]
    for _ in range(6):
        with torch.no_grad():
            model.weight.add_(torch.randn_like(model.weight))
        history.append(model.weight.detach().clone())
        ewma.update(model)
    weights = [0.7 ** (len(history) - 1 - i) for i in range(len(history))]
    expected = sum(w * h for w, h in zip(weights, history, strict=True)) / sum(weights)
    assert torch.allclose(ewma.params["weight"], expected, atol=1e-6)
    assert ewma.total == pytest.approx(sum(weights))


def test_reset_on_low_kept_fraction_is_counted():
    model = Scalar(0.0)
    ewma = EwmaProximal(model, EwmaConfig(window=2, reset_tau=0.5))
    _set(model, 1.0)
    ewma.update(model)
    _set(model, 3.0)
    assert not ewma.maybe_reset(0.6, model)
    assert not ewma.maybe_reset(float("nan"), model)
    assert ewma.resets == 0 and ewma.params["theta"].item() != 3.0
    assert ewma.maybe_reset(0.4, model)
    assert ewma.params["theta"].item() == 3.0 and ewma.total == 1.0 and ewma.resets == 1
    assert ewma.maybe_reset(0.7, model, tau=0.8) and ewma.resets == 2


def test_reset_driven_by_the_loss_metric():
    # the EWMA reference drifted: pi_ewma/mu = e^1.5 > 2 on 3 of 4 tokens, so the mask keeps 1/4
    ewma_logprobs = torch.tensor([[-1.0, -1.0, -1.0, -2.4]])
    mu = torch.tensor([[-2.5, -2.5, -2.5, -2.5]])
    _, metrics = discrepancy_weights(ewma_logprobs, mu, torch.ones(1, 4))
    kept = metrics["mask_kept_fraction"].item()
    assert kept == pytest.approx(0.25)
    model = Scalar(2.0)
    ewma = EwmaProximal(Scalar(0.0))
    assert ewma.maybe_reset(kept, model) and ewma.params["theta"].item() == 2.0


def test_fp32_cpu_copy_memory_and_no_aliasing():
    model = nn.Linear(4, 3).double()
    ewma = EwmaProximal(model)
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in ewma.params.values())
    assert ewma.nbytes == (4 * 3 + 3) * 4
    before = ewma.params["weight"].clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    assert torch.equal(ewma.params["weight"], before)
    status = ewma.status()
    assert EwmaStatus(**{k: status[k] for k in ("beta", "total_weight", "resets", "bytes_held")}).bytes_held == 60


def test_name_and_shape_mismatch_raise():
    ewma = EwmaProximal(nn.Linear(4, 3))
    with pytest.raises(ValueError, match="missing"):
        ewma.update({"weight": torch.zeros(3, 4)})
    with pytest.raises(ValueError, match="shape"):
        ewma.update({"weight": torch.zeros(4, 3), "bias": torch.zeros(3)})


def test_state_dict_round_trip():
    torch.manual_seed(1)
    model = nn.Linear(4, 3)
    ewma = EwmaProximal(model, EwmaConfig(beta_source="lag"))
    ewma.observe_lag(2.5)
    for _ in range(3):
        with torch.no_grad():
            model.weight.mul_(1.1)
        ewma.update(model)
    ewma.maybe_reset(0.1, model)
    ewma.update(model)
    state = ewma.state_dict()
    restored = EwmaProximal(nn.Linear(4, 3), EwmaConfig(beta_source="lag"))
    restored.load_state_dict(state)
    assert restored.status() == ewma.status()
    assert all(torch.equal(restored.params[k], ewma.params[k]) for k in ewma.params)
    state["params"]["weight"].add_(1.0)  # the state holds copies
    assert not torch.equal(ewma.params["weight"], state["params"]["weight"])
    with pytest.raises(ValueError):
        EwmaProximal(nn.Linear(5, 3)).load_state_dict(ewma.state_dict())


def test_forward_with_ewma_weights_and_exact_restore():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ewma = EwmaProximal(model, EwmaConfig(beta_source="fixed", beta=0.5))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    ewma.update(model)
    x = torch.randn(5, 4)
    reference = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    reference.load_state_dict(ewma.params)
    expected = reference(x)
    originals = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    with torch.no_grad(), ewma.swapped_into(model) as swapped:
        assert torch.allclose(swapped(x), expected, atol=1e-6)
    assert torch.allclose(ewma.forward(model, x), expected, atol=1e-6)
    with pytest.raises(RuntimeError), ewma.swapped_into(model):
        raise RuntimeError("inside")
    for name, p in model.named_parameters():
        obj, value = originals[name]
        assert p is obj and torch.equal(p, value)
    assert not torch.allclose(model(x), expected)


def test_window_default_is_documented_value():
    cfg = EwmaConfig()
    assert cfg.beta_source == "window" and cfg.window == 2.0 and cfg.reset_tau == 0.5 and cfg.device == "cpu"
    assert math.isclose(EwmaProximal(Scalar(), cfg).beta, 0.5)


def test_the_probe_runs_every_probe_every_th_version_from_0():
    """probe_every 4: versions 0, 4 and 8 probe, 1-3 and 5-7 do not; 0 never probes."""
    every4 = EwmaConfig(probe_every=4)
    assert [v for v in range(9) if every4.probes(v)] == [0, 4, 8]
    assert not any(EwmaConfig(probe_every=0).probes(v) for v in range(9))
