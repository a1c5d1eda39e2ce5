"""The learner's non-finite guard around one optimizer step (plain torch; no DeepSpeed import).

A step is refused when any rank's loss or gradient is not finite: the flag is all-reduced (max)
and the inner torch optimizer's ``step`` is suppressed, so DeepSpeed's own bookkeeping still runs
(it clears its gradient buffers) while weights and optimizer state stay untouched. A step that runs
and leaves a non-finite weight or optimizer state on any rank is rolled back on every rank
(:class:`trainer.learner.rollback.OptimizerRollback`); without the rollback copy
(``learner.rollback_copy``) such a step raises :class:`NonFiniteStep` instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from trainer.learner.rollback import OptimizerRollback

AllReduce = Callable[[list[float], str], list[float]]
"""``(values, op)`` -> the values reduced over the data-parallel ranks (``op`` "sum" or "max")."""


def stage0_grad_norm(module: torch.nn.Module) -> float:
    """The global L2 norm of ``module``'s fp32 gradients before clipping (0 without any): the norm
    of the per-tensor norms (``torch.nn.utils.get_total_norm``), equal to the norm of all of them
    as one vector to fp32 rounding. For ZeRO stage 0 in fp32, where
    DeepSpeed does not keep it; it is not finite exactly when some gradient is not (or the sum of
    squares overflows fp32), so it doubles as the guard's gradient check there."""
    grads = [p.grad.detach() for p in module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads, 2.0)) if grads else 0.0


def zero_missing_grads(params: Iterable[torch.nn.Parameter]) -> None:
    """Give every trainable, non-empty parameter of ``params`` without a gradient a zero one, in place, as
    DeepSpeed's gradient reduction does, so the optimizer's step (its weight decay and moments) is
    the same whether or not the reduction ran."""
    for p in params:
        if p.requires_grad and p.grad is None and p.numel() > 0:
            p.grad = torch.zeros_like(p)


class NonFiniteStep(RuntimeError):
    """An optimizer step left a non-finite weight or optimizer state and no copy was kept to undo it."""


class StepGuard:
    """Wraps ``optimizer.step`` and watches the gradients of ``params``.

    Args:
        optimizer: the torch optimizer DeepSpeed drives (its ``step`` is replaced on the instance).
        all_reduce: the ranks' reduction (identity with one rank).
        keep_copy: keep the rollback copy before each step (``LearnerSettings.keeps_rollback_copy``).

    Attributes:
        grad_bad: 0-d bool tensor, set by a gradient hook when a local gradient is not finite;
            :meth:`clear` resets it before a step's micro-batches.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, all_reduce: AllReduce, keep_copy: bool = True) -> None:
        self._all_reduce = all_reduce
        self.grad_bad = torch.zeros((), dtype=torch.bool)
        self._suppress = False
        self._inner_steps = 0
        self._rolled_back = False
        self._hooks: list[Any] = []
        inner, rollback = optimizer.step, OptimizerRollback(optimizer)

        def step(*args: Any, **kwargs: Any) -> Any:
            self._inner_steps += 1
            if self._suppress:
                return None
            if keep_copy:
                rollback.save()
            out = inner(*args, **kwargs)
            if self._all_reduce([float(not rollback.optimizer_finite())], "max")[0] > 0:
                if not keep_copy:
                    raise NonFiniteStep(
                        "learner: an optimizer step left a non-finite weight or optimizer state and no copy "
                        "was kept to undo it (learner.rollback_copy = 'on' keeps one)"
                    )
                rollback.restore()
                self._rolled_back = True
            return out

        optimizer.step = step  # instance attribute shadows the class method

    def watch(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Flag :attr:`grad_bad` whenever a gradient of one of the trainable ``params`` is not finite."""
        self._hooks += [p.register_hook(self._hook) for p in params if p.requires_grad]

    def _hook(self, grad: torch.Tensor) -> None:
        if not bool(torch.isfinite(grad).all()):
            self.grad_bad.fill_(True)

    def clear(self) -> None:
        """Forget the gradient flag (call before a step's first micro-batch)."""
        self.grad_bad.fill_(False)

    def step(self, engine: Any, local_bad: bool) -> tuple[bool, bool, float]:
        """``engine.step()`` under the guard: ``local_bad`` (this rank's loss or gradient is not
        finite) is all-reduced; a flagged step runs with the inner optimizer suppressed, a step
        leaving non-finite weights is rolled back.

        Returns:
            (applied, rolled_back, seconds): applied only when no rank flagged it, nothing was rolled
            back, the inner optimizer ran and DeepSpeed reports the step applied (its own overflow
            check passed).
        """
        bad = self._all_reduce([float(local_bad)], "max")[0] > 0
        before, tc = self._inner_steps, time.perf_counter()
        self._suppress, self._rolled_back = bad, False
        try:
            engine.step()
        finally:
            self._suppress = False
        applied = not bad and not self._rolled_back and self._inner_steps > before and engine.was_step_applied()
        return applied, self._rolled_back, time.perf_counter() - tc
