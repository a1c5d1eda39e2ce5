"""How good is the proxy? Mean |exact - proxy| (nats) on tokens that have both.

When a token has an exact old log-prob (``pi_old`` from an exact route) and the learner also has a
proxy for it (PPO-EWMA, log-linear, ...), the difference measures the approximation live. The
learner calls :func:`proxy_error` per batch, or keeps a :class:`ProxyErrorMeter` across steps.
Torch-free: accepts numpy arrays, torch tensors (moved to CPU) or nested lists.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


def _as_np(x: Any, name: str) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor, without importing torch
        return x.detach().double().cpu().numpy()
    if isinstance(x, (list, tuple)) and any(hasattr(r, "__len__") for r in x):
        # a list of per-sequence arrays of different lengths ([batch][seq]): flatten in order
        return np.concatenate([_as_np(r, name).reshape(-1) for r in x])
    try:
        return np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: not a numeric array ({e})") from None


@dataclass(frozen=True)
class ProxyError:
    """Proxy error over the tokens that have both an exact value and a finite proxy.

    ``mean_abs_nats`` / ``max_abs_nats`` are NaN when ``tokens == 0``; ``mean_signed_nats`` is the
    mean of ``proxy - exact`` (a bias: > 0 means the proxy is more confident than pi_old).
    """

    mean_abs_nats: float
    max_abs_nats: float
    mean_signed_nats: float
    tokens: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def proxy_error(exact: Any, proxy: Any, mask: Any | None = None) -> ProxyError:
    """Mean |exact - proxy| in nats over tokens where both are finite (and ``mask`` is 1).

    Args:
        exact: exact old log-probs ``[batch, seq]`` (or ``[tokens]``, or a list of per-sequence
            ``[seq]`` arrays), nats, NaN where the route had no exact value.
        proxy: the proxy log-probs for the same tokens (same layout), nats.
        mask: optional ``loss_mask`` (same layout); only tokens with mask 1 count.

    Returns:
        :class:`ProxyError` (means over the counted tokens; NaN and ``tokens == 0`` if none).

    Raises:
        ValueError: the shapes differ (the message names ``proxy`` or ``mask``).
    """
    e, p = _as_np(exact, "exact"), _as_np(proxy, "proxy")
    if e.shape != p.shape:
        raise ValueError(f"proxy: shape {p.shape} != exact shape {e.shape}")
    use = np.isfinite(e) & np.isfinite(p)
    if mask is not None:
        m = _as_np(mask, "mask")
        if m.shape != e.shape:
            raise ValueError(f"mask: shape {m.shape} != exact shape {e.shape}")
        use &= m > 0
    n = int(use.sum())
    if n == 0:
        return ProxyError(math.nan, math.nan, math.nan, 0)
    d = p[use] - e[use]
    return ProxyError(float(np.abs(d).mean()), float(np.abs(d).max()), float(d.mean()), n)


class ProxyErrorMeter:
    """Running proxy error across batches (token-weighted), plus the last batch's value."""

    def __init__(self) -> None:
        self.tokens = 0
        self.sum_abs = 0.0
        self.sum_signed = 0.0
        self.max_abs = 0.0
        self.last: ProxyError | None = None

    def update(self, exact: Any, proxy: Any, mask: Any | None = None) -> ProxyError:
        """Add one batch (see :func:`proxy_error` for the arguments); returns that batch's error."""
        err = proxy_error(exact, proxy, mask)
        self.last = err
        if err.tokens:
            self.tokens += err.tokens
            self.sum_abs += err.mean_abs_nats * err.tokens
            self.sum_signed += err.mean_signed_nats * err.tokens
            self.max_abs = max(self.max_abs, err.max_abs_nats)
        return err

    def summary(self) -> dict[str, float | int]:
        """``{"mean_abs_nats", "max_abs_nats", "mean_signed_nats", "tokens", "last_mean_abs_nats"}``."""
        n = self.tokens
        return {
            "mean_abs_nats": self.sum_abs / n if n else math.nan,
            "max_abs_nats": self.max_abs if n else math.nan,
            "mean_signed_nats": self.sum_signed / n if n else math.nan,
            "tokens": n,
            "last_mean_abs_nats": self.last.mean_abs_nats if self.last else math.nan,
        }
