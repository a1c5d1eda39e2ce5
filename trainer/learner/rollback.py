"""The optimizer's rollback copy: a step that leaves a non-finite weight or state is undone exactly."""

from __future__ import annotations

import copy
from typing import Any

import torch

from modelkit.weights import all_finite


class OptimizerRollback:
    """A copy of a torch optimizer's parameters and per-parameter state, taken before its step.

    Only the parameters the step can change are copied: those with a gradient (torch optimizers
    skip a parameter whose ``grad`` is None, so frozen weights cost nothing). :meth:`save` copies
    into buffers kept between steps (no allocation after the first); the cost is one copy of those
    parameters plus their state (AdamW: 3x the parameter bytes) per step. Measured on this project's
    2-core CPU for a 148M-parameter fp32 AdamW: 0.22 s to save and 0.10 s for
    :meth:`optimizer_finite`, against 0.12 s for the fused AdamW step itself. :meth:`restore` puts
    parameters and state back exactly, including the absence of state before the first step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._params: dict[torch.Tensor, torch.Tensor] = {}
        self._state: dict[torch.Tensor, dict[str, Any] | None] = {}
        self._saved: list[torch.Tensor] = []

    def _all_params(self) -> list[torch.Tensor]:
        """The parameters the next step updates: those holding a gradient."""
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    def save(self) -> None:
        """Copy every parameter the next step can change, and its state, now."""
        self._saved = self._all_params()
        for p in self._saved:
            buf = self._params.get(p)
            if buf is None or buf.shape != p.shape or buf.dtype != p.dtype:
                self._params[p] = p.detach().clone()
            else:
                buf.copy_(p.detach())
            state = self.optimizer.state.get(p)
            if not state:
                self._state[p] = None
                continue
            kept = self._state.get(p) or {}
            for k, v in state.items():
                if torch.is_tensor(v) and k in kept and torch.is_tensor(kept[k]) and kept[k].shape == v.shape:
                    kept[k].copy_(v)
                else:
                    kept[k] = v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v)
            self._state[p] = kept

    def optimizer_finite(self) -> bool:
        """True when every parameter the step could change (those holding a gradient) and its state
        are finite after the step."""
        params = self._all_params()
        state = [v for p in params for v in self.optimizer.state.get(p, {}).values()]
        return all_finite(params) and all_finite(state)

    def restore(self) -> None:
        """Put back the parameters and state copied by the last :meth:`save`."""
        with torch.no_grad():
            for p in self._saved:
                p.copy_(self._params[p])
                saved = self._state.get(p)
                if saved is None:
                    self.optimizer.state.pop(p, None)
                    continue
                state = self.optimizer.state[p]
                for k, v in saved.items():
                    if torch.is_tensor(v) and torch.is_tensor(state.get(k)):
                        state[k].copy_(v)
                    else:
                        state[k] = copy.deepcopy(v)
