"""OptimizerRollback: a step that leaves a non-finite weight is undone exactly; frozen weights are not copied."""

from __future__ import annotations

import math

import torch

from trainer.learner import OptimizerRollback


def test_rollback_restores_weights_and_state_and_skips_frozen_parameters():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    frozen = torch.nn.Parameter(torch.tensor([3.0]), requires_grad=False)
    opt = torch.optim.SGD([w, frozen], lr=0.5, momentum=0.9)
    rb = OptimizerRollback(opt)

    w.grad = torch.tensor([2.0, -4.0])
    rb.save()
    opt.step()  # first momentum buffer = grad: w = [1, 2] - 0.5 * [2, -4] = [0, 4]
    assert w.tolist() == [0.0, 4.0] and rb.optimizer_finite()
    assert list(rb._params) == [w]  # the frozen parameter (no grad) is never copied

    rb.save()
    opt.param_groups[0]["lr"] = math.inf
    opt.step()  # an infinite learning rate: w becomes non-finite, the momentum buffer [2, -4] -> [3.8, -7.6]
    assert not rb.optimizer_finite()
    rb.restore()
    assert w.tolist() == [0.0, 4.0] and frozen.tolist() == [3.0]
    assert opt.state[w]["momentum_buffer"].tolist() == [2.0, -4.0]


def test_rollback_before_the_first_step_leaves_no_state():
    w = torch.nn.Parameter(torch.tensor([1.0]))
    opt = torch.optim.AdamW([w], lr=math.inf)
    rb = OptimizerRollback(opt)
    w.grad = torch.tensor([1.0])
    rb.save()
    opt.step()
    assert not rb.optimizer_finite()
    rb.restore()
    assert w.tolist() == [1.0] and w not in opt.state
