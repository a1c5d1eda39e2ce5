"""The learner guard's gradient helpers: the fused gradient norm and the zero gradients DeepSpeed's
reduction would give parameters that got none."""

from __future__ import annotations

import math

import torch

from trainer.learner.guard import stage0_grad_norm, zero_missing_grads


def _module(*grads: list[float] | None) -> torch.nn.Module:
    m = torch.nn.Module()
    for i, g in enumerate(grads):
        p = torch.nn.Parameter(torch.ones(len(g) if g is not None else 2))
        p.grad = torch.tensor(g) if g is not None else None
        m.register_parameter(f"p{i}", p)
    return m


def test_the_norm_is_over_every_gradient_as_one_vector_and_skips_missing_ones():
    # [3, 4] and [12]: sqrt(9 + 16 + 144) = 13; the parameter without a gradient adds nothing
    assert stage0_grad_norm(_module([3.0, 4.0], [12.0], None)) == 13.0
    assert stage0_grad_norm(_module(None)) == 0.0


def test_a_nonfinite_gradient_makes_the_norm_nonfinite():
    assert math.isnan(stage0_grad_norm(_module([3.0, math.nan], [1.0])))
    assert math.isinf(stage0_grad_norm(_module([math.inf], [1.0])))
    assert math.isinf(stage0_grad_norm(_module([math.inf, -math.inf])))  # both square to +inf


def test_missing_gradients_become_zeros_and_present_or_frozen_ones_stay():
    m = _module([1.0, 2.0], None)
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    m.register_parameter("frozen", frozen)
    kept = m.p0.grad
    zero_missing_grads(m.parameters())
    assert m.p0.grad is kept and m.p0.grad.tolist() == [1.0, 2.0]
    assert m.p1.grad.tolist() == [0.0, 0.0] and frozen.grad is None


def test_adamw_decays_a_weight_with_a_zero_gradient_and_skips_one_without():
    # AdamW with weight decay 0.1 and lr 0.5: a zero gradient still decays the weight,
    # w = 1 * (1 - 0.5 * 0.1) = 0.95 in fp32 (the Adam term is 0 / (0 + eps) = 0); no gradient, no step
    with_zero, without = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.AdamW([with_zero, without], lr=0.5, weight_decay=0.1)
    zero_missing_grads([with_zero])
    opt.step()
    assert with_zero.item() == torch.tensor(0.95).item() and without.item() == 1.0
