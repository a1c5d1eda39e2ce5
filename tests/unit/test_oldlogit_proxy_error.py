"""Proxy error (mean |exact - proxy| in nats) on hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from oldlogit_service import ProxyErrorMeter, proxy_error


def test_hand_computed_with_nan_and_mask():
    exact = np.array([[-1.0, -2.0, np.nan, -0.5], [-0.1, -3.0, -1.0, np.nan]], np.float32)  # [batch, seq]
    proxy = np.array([[-1.5, -2.0, -0.7, -0.25], [-0.1, -2.0, np.inf * -1, -9.0]], np.float32)
    mask = np.array([[1, 1, 1, 1], [0, 1, 1, 1]])
    e = proxy_error(exact, proxy, mask)
    # counted: (0,0) 0.5, (0,1) 0.0, (0,3) 0.25, (1,1) 1.0  -> NaN exact, -inf proxy and mask 0 excluded
    assert e.tokens == 4
    assert e.mean_abs_nats == pytest.approx((0.5 + 0.0 + 0.25 + 1.0) / 4)
    assert e.max_abs_nats == pytest.approx(1.0)
    assert e.mean_signed_nats == pytest.approx((-0.5 + 0.0 + 0.25 + 1.0) / 4)
    # torch tensors and ragged per-sequence lists give the same answer
    assert proxy_error(torch.tensor(exact), torch.tensor(proxy), torch.tensor(mask)) == e
    ragged = proxy_error([exact[0], exact[1][:3]], [proxy[0], proxy[1][:3]], [mask[0], mask[1][:3]])
    assert ragged == e


def test_no_tokens_and_shape_errors():
    e = proxy_error([np.nan, -1.0], [-1.0, np.nan])
    assert e.tokens == 0 and math.isnan(e.mean_abs_nats)
    with pytest.raises(ValueError, match="proxy: shape"):
        proxy_error(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="mask: shape"):
        proxy_error(np.zeros(3), np.zeros(3), np.ones(2))


def test_meter_is_token_weighted():
    m = ProxyErrorMeter()
    m.update([-1.0], [-2.0])  # 1 token, error 1.0
    m.update([-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0])  # 3 tokens, error 0
    m.update([np.nan], [-1.0])  # nothing counted
    s = m.summary()
    assert s["tokens"] == 4 and s["mean_abs_nats"] == pytest.approx(0.25) and s["max_abs_nats"] == 1.0
    assert math.isnan(s["last_mean_abs_nats"])
