"""PPO-EWMA proximal policy: an exponentially weighted average of the learner's weights.

PPO-EWMA (Hilton et al. 2022, "Batch size-invariance for policy optimization", section 4) uses as
proximal policy an EWMA of past policy weights instead of the weights of one past version. vintage
uses it where the exact old logits of a token's version are missing.

Update, after every optimizer step, with the bias-corrected rule::

    total'      = beta * total + 1
    theta_ewma' = theta_ewma * (beta * total / total') + theta / total'

so theta_ewma is the weighted mean of the initial weights and every later step's weights, with
weights beta^age normalised to sum to 1 (e.g. from theta 0, total 1, beta 0.5, steps to 1 then 2
give 0.666667 (total 1.5) then 1.428571 (total 1.75)). A reset sets theta_ewma <- theta and
total <- 1; it happens when the discrepancy mask on pi_ewma/mu keeps less than ``reset_tau`` of the
valid tokens, and is counted.

With ``trainable_only`` (LoRA) the EWMA holds only the parameters that train (``requires_grad``):
the frozen base is the same in every version, so the average of the full weights equals base +
the average of the adapter parameters, and only those are kept (``bytes_held`` = adapter bytes).
A model passed later is read by the EWMA's own names (its other parameters are left alone).

Invariants: the EWMA holds exactly the names and shapes of the parameters it was created from
(any mismatch raises); it is fp32 on ``config.device`` (CPU by default) whatever the model's dtype;
a forward with EWMA weights never changes the model's own parameters. Parameters must be full
tensors (under ZeRO-3, gather them first). This is a plain class; a Ray actor may wrap it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from trainer.algorithm.loss_config import EwmaConfig

ParamSource = nn.Module | Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]


def beta_from_window(window: float) -> float:
    """beta = W / (W + 2) for a staleness window W >= 0 (mean lag W / 2). W = 1, 2, 4, 8 ->
    1/3, 1/2, 2/3, 4/5."""
    if not window >= 0:
        raise ValueError(f"window must be >= 0, got window={window!r}")
    return window / (window + 2.0)


def beta_from_lag(lag: float) -> float:
    """beta = s / (1 + s) for a measured mean version lag s >= 0 (mean lag of the EWMA = s)."""
    if not lag >= 0:
        raise ValueError(f"lag must be >= 0, got lag={lag!r}")
    return lag / (1.0 + lag)


def step_beta(mean_lag: float, steps_per_version: int = 1) -> float:
    """Decay per optimizer step for an EWMA whose mean lag is ``mean_lag`` versions, with
    ``steps_per_version`` = S optimizer steps per version (``ppo_epochs * ppo_mini_batches``).

    The EWMA folds the weights in after every optimizer step, and beta = L / (1 + L) gives a mean lag
    of L folds. A token of version lag s that is trained at the j-th of the S steps of its batch
    (j = 0 .. S - 1) lies s * S + j steps behind, so a mean lag of s versions is
    L = s * S + (S - 1) / 2 optimizer steps (the in-batch term is the mean of 0 .. S - 1). With S = 1
    this is beta = s / (1 + s) (:func:`beta_from_lag`); W = 0 with S = 2 gives L = 0.5, beta = 1/3,
    so the reference of a batch's second step is not its current weights. Example: s = 1, S = 2 ->
    L = 2.5, beta = 5/7.

    Raises:
        ValueError: ``mean_lag`` is negative or not finite, or ``steps_per_version`` < 1.
    """
    if not (math.isfinite(mean_lag) and mean_lag >= 0):
        raise ValueError(f"mean_lag must be finite and >= 0, got mean_lag={mean_lag!r}")
    if steps_per_version < 1:
        raise ValueError(f"steps_per_version must be >= 1, got steps_per_version={steps_per_version!r}")
    return beta_from_lag(mean_lag * steps_per_version + (steps_per_version - 1) / 2.0)


def _named(params: ParamSource) -> dict[str, Tensor]:
    if isinstance(params, nn.Module):
        return dict(params.named_parameters())
    if isinstance(params, Mapping):
        return dict(params)
    return dict(params)


class EwmaProximal:
    """fp32 EWMA copy of a model's named parameters, with bias-corrected updates and resets.

    Args:
        params: a module, or ``{name: tensor}`` / ``(name, tensor)`` pairs.
        config: decay source and reset threshold.
        trainable_only: keep only the parameters of ``params`` with ``requires_grad`` (a module's
            LoRA adapter); modules passed later are read by the EWMA's names.
        steps_per_version: optimizer steps per version S; every source's decay is per version and
            is turned into a decay per optimizer step by :func:`step_beta`.

    Raises:
        ValueError: ``trainable_only`` and no parameter requires a gradient, or
            ``steps_per_version`` < 1.
    """

    def __init__(
        self,
        params: ParamSource,
        config: EwmaConfig | None = None,
        trainable_only: bool = False,
        steps_per_version: int = 1,
    ) -> None:
        if steps_per_version < 1:
            raise ValueError(f"steps_per_version must be >= 1, got steps_per_version={steps_per_version!r}")
        self.config = config or EwmaConfig()
        self.trainable_only = trainable_only
        self.steps_per_version = steps_per_version
        named = _named(params)
        if trainable_only:
            named = {name: t for name, t in named.items() if t.requires_grad}
            if not named:
                raise ValueError("trainable_only: no parameter requires a gradient")
        self.params: dict[str, Tensor] = {
            name: t.detach().to(device=self.config.device, dtype=torch.float32, copy=True) for name, t in named.items()
        }
        self.total = 1.0
        self.updates = 0
        self.resets = 0
        self.lag = self.config.initial_lag

    # -- decay ----------------------------------------------------------------------------------

    @property
    def mean_lag(self) -> float:
        """The EWMA's mean lag in versions, from the configured source: W / 2 ("window"), the
        measured mean version lag ("lag"), beta / (1 - beta) ("fixed")."""
        if self.config.beta_source == "window":
            return self.config.window / 2.0
        if self.config.beta_source == "lag":
            return self.lag
        return self.config.beta / (1.0 - self.config.beta)

    @property
    def beta(self) -> float:
        """Current decay per optimizer step: :func:`step_beta` of :attr:`mean_lag`. With one step per
        version it is :func:`beta_from_window`, :func:`beta_from_lag` or the fixed beta itself."""
        return step_beta(self.mean_lag, self.steps_per_version)

    def observe_lag(self, mean_lag: float) -> None:
        """Record the measured mean version lag of consumed tokens, in versions (the "lag" source)."""
        if not (math.isfinite(mean_lag) and mean_lag >= 0):
            raise ValueError(f"mean_lag must be finite and >= 0, got mean_lag={mean_lag!r}")
        self.lag = float(mean_lag)

    # -- updates --------------------------------------------------------------------------------

    def _checked(self, params: ParamSource) -> dict[str, Tensor]:
        named = _named(params)
        if self.trainable_only and isinstance(params, nn.Module):
            named = {name: t for name, t in named.items() if name in self.params}
        if named.keys() != self.params.keys():
            missing, extra = self.params.keys() - named.keys(), named.keys() - self.params.keys()
            raise ValueError(
                f"parameter names differ from the EWMA's: missing {sorted(missing)}, extra {sorted(extra)}"
            )
        for name, t in named.items():
            if t.shape != self.params[name].shape:
                raise ValueError(f"parameter {name!r}: shape {tuple(t.shape)} != EWMA {tuple(self.params[name].shape)}")
        return named

    @torch.no_grad()
    def update(self, params: ParamSource) -> None:
        """Fold the current weights in (call after every optimizer step): the bias-corrected rule."""
        named = self._checked(params)
        beta = self.beta
        new_total = beta * self.total + 1.0
        keep = beta * self.total / new_total
        for name, t in named.items():
            ewma = self.params[name]
            ewma.mul_(keep).add_(t.detach().to(device=ewma.device, dtype=torch.float32), alpha=1.0 / new_total)
        self.total = new_total
        self.updates += 1

    @torch.no_grad()
    def reset(self, params: ParamSource) -> None:
        """theta_ewma <- theta, total <- 1; counted in ``resets``."""
        for name, t in self._checked(params).items():
            self.params[name].copy_(t.detach())
        self.total = 1.0
        self.resets += 1

    def maybe_reset(self, kept_fraction: float, params: ParamSource, tau: float | None = None) -> bool:
        """Reset when the discrepancy-mask kept fraction on pi_ewma/mu is below ``tau``
        (default ``config.reset_tau``). A NaN fraction (no valid tokens) never resets. Returns
        whether it reset."""
        tau = self.config.reset_tau if tau is None else tau
        if math.isnan(kept_fraction) or kept_fraction >= tau:
            return False
        self.reset(params)
        return True

    # -- forward with EWMA weights --------------------------------------------------------------

    @contextmanager
    def swapped_into(self, model: nn.Module) -> Iterator[nn.Module]:
        """Temporarily put the EWMA weights (cast to each parameter's dtype and device) into
        ``model``; on exit the original parameter tensors are put back, bit for bit. Do not step an
        optimizer inside: run forwards under ``torch.no_grad()``."""
        named = self._checked(model)
        saved: dict[str, Tensor] = {}
        try:
            for name, p in named.items():
                saved[name] = p.data
                p.data = self.params[name].to(device=p.device, dtype=p.dtype)
            yield model
        finally:
            for name, data in saved.items():
                named[name].data = data

    @torch.no_grad()
    def forward(self, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """``model(*args, **kwargs)`` with the EWMA weights, without touching the model (functional call)."""
        named = self._checked(model)
        weights = {name: self.params[name].to(device=p.device, dtype=p.dtype) for name, p in named.items()}
        return torch.func.functional_call(model, weights, args, kwargs)

    # -- accounting and checkpoints -------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Memory held by the EWMA copy, in bytes."""
        return sum(t.numel() * t.element_size() for t in self.params.values())

    def status(self) -> dict[str, float | int]:
        """Fields of ``protocol.EwmaStatus`` plus the update count."""
        return {
            "beta": self.beta,
            "total_weight": self.total,
            "resets": self.resets,
            "bytes_held": self.nbytes,
            "updates": self.updates,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: weights (copies), total, counters, measured lag."""
        return {
            "params": {name: t.clone() for name, t in self.params.items()},
            "total": self.total,
            "updates": self.updates,
            "resets": self.resets,
            "lag": self.lag,
        }

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`; names and shapes must match this EWMA's."""
        named = self._checked(state["params"])
        for name, t in named.items():
            self.params[name].copy_(t)
        self.total = float(state["total"])
        self.updates = int(state["updates"])
        self.resets = int(state["resets"])
        self.lag = float(state["lag"])
