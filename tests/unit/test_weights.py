"""Weight packing: non-finite payloads are refused by every consumer, naming the tensor."""

from __future__ import annotations

import pytest
import torch

from modelkit.weights import all_finite, pack_weights, unpack_weights
from protocol import ProtocolError


def test_all_finite_by_hand():
    assert all_finite([torch.tensor([1.0, -2.0]), torch.tensor([3], dtype=torch.int64)])
    assert not all_finite([torch.tensor([1.0, float("nan")])])
    assert not all_finite([torch.ones(2), torch.tensor([float("-inf")], dtype=torch.bfloat16)])
    # 3e38 + 3e38 overflows the fp32 sum, yet every value is finite: not refused
    assert all_finite([torch.tensor([3e38, 3e38])])
    assert all_finite([])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_consumer_refuses_a_nan_payload_naming_the_tensor(dtype):
    named = {"a.weight": torch.ones(2, 3), "b.bias": torch.tensor([0.5, float("nan")])}
    manifest, payload = pack_weights(named.items(), version=3, dtype=dtype)
    with pytest.raises(ProtocolError, match=r"payload\['b.bias'\]: holds a non-finite value \(1 tensor"):
        unpack_weights(manifest, payload)
    good_manifest, good = pack_weights({"a.weight": torch.ones(2, 3)}.items(), version=3, dtype=dtype)
    assert torch.equal(unpack_weights(good_manifest, good)["a.weight"].float(), torch.ones(2, 3))
