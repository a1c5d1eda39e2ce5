"""Weight packing: the digest by hand, one private copy, zero-copy object-store reads verified once
per host, and non-finite payloads refused by every consumer, naming the tensor."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest
import torch
import xxhash

from modelkit import weights
from modelkit.weights import PackedWeights, all_finite, nonfinite_names, pack_weights, unpack_weights
from protocol import ProtocolError, payload_checksum, weights_digest


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


# ------------------------------------------------------------------------------------------------
# digest, copies, zero-copy reads, per-host verification
# ------------------------------------------------------------------------------------------------


def object_store_copy(payload):
    """What a Ray reader gets: the payload pickled with out-of-band buffers, rebuilt on read-only views."""
    bufs = []
    data = pickle.dumps(payload, protocol=5, buffer_callback=bufs.append)
    views = [b.raw().toreadonly() for b in bufs]
    return pickle.loads(data, buffers=views), views


def test_weights_digest_by_hand():
    # XXH3-128 (seed 0) of the empty input, as published by xxHash
    assert weights_digest([], []) == "99aa06d3014798d86001c324468d497f"
    # names first (NUL-terminated), then the bytes laid end to end: however the bytes are split
    stream = b"a\0b\0\x01\x02"
    assert weights_digest(["a", "b"], [b"\x01\x02", b""]) == xxhash.xxh3_128_hexdigest(stream)
    assert weights_digest(["a", "b"], [b"\x01", b"\x02"]) == "6ab27b06b9eb00d6cafe43b77d142df1"
    assert payload_checksum([("a", b"\x01"), ("b", b"\x02")]) == "6ab27b06b9eb00d6cafe43b77d142df1"
    # a packed tensor: its name, then its float32 bytes, little-endian
    manifest, _ = pack_weights([("w", torch.tensor([1.0, 2.0]))], version=1)
    assert manifest.checksum == xxhash.xxh3_128_hexdigest(b"w\0" + struct.pack("<2f", 1.0, 2.0))


def test_pack_copies_once_or_leaves_the_copy_to_the_object_store():
    src = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(4)}
    _, private = pack_weights(src.items(), version=1)
    _, shared = pack_weights(src.items(), version=1, copy=False)
    _, cast = pack_weights(src.items(), version=1, dtype="bfloat16", copy=False)
    assert shared["a"].data_ptr() == src["a"].data_ptr()  # sent as it is: ray.put makes the copy
    assert cast["a"].dtype == torch.bfloat16 and cast["a"].data_ptr() != src["a"].data_ptr()
    assert private["a"].data_ptr() != src["a"].data_ptr() and private["a"].is_contiguous()
    src["a"].add_(100.0)  # the learner steps after packing
    assert private["a"][1, 2].item() == 5.0 and shared["a"][1, 2].item() == 105.0


def test_object_store_read_is_zero_copy_and_round_trips():
    named = {"a": torch.tensor([[1.0, -2.0], [3.0, 4.5]]), "b": torch.tensor([0.25, 8.0])}
    for dtype in ("float32", "bfloat16"):
        manifest, payload = pack_weights(named.items(), version=2, dtype=dtype)
        got, views = object_store_copy(payload)
        assert got.readonly and got.token == payload.token
        starts = [np.frombuffer(v, np.uint8).ctypes.data for v in views]
        assert [got[n].data_ptr() for n in ("a", "b")] == starts  # views of the buffers, no copy
        out = unpack_weights(manifest, got)
        for n, t in named.items():
            assert torch.equal(out[n].float(), t)
    plain = pickle.loads(pickle.dumps(payload))  # an ordinary pickle: private, writable tensors
    assert not plain.readonly and torch.equal(plain["b"].float(), named["b"])


def test_object_store_payload_verified_once_per_host(monkeypatch):
    calls = []
    real = weights.check_payload
    monkeypatch.setattr(weights, "check_payload", lambda m, p: (calls.append(p.token), real(m, p)))
    manifest, payload = pack_weights([("w", torch.tensor([1.0, 2.0]))], version=5)
    first, _ = object_store_copy(payload)
    second, _ = object_store_copy(payload)  # another consumer on the host, same object
    assert weights.verify_payload(manifest, first) is True
    assert weights.verify_payload(manifest, second) is False
    assert unpack_weights(manifest, second)["w"].tolist() == [1.0, 2.0]
    assert calls == [payload.token]
    # a writable payload (not shared memory) is checked on every call
    assert weights.verify_payload(manifest, payload) and weights.verify_payload(manifest, payload)
    assert len(calls) == 3


def test_object_store_payload_that_fails_is_refused_by_every_consumer():
    manifest, payload = pack_weights([("w", torch.tensor([1.0, 2.0]))], version=6)
    bad = PackedWeights({"w": torch.tensor([1.0, 2.5])}, token=payload.token)
    bad_ro, _ = object_store_copy(bad)
    for _ in range(2):  # a failed check leaves no record: the second consumer refuses too
        with pytest.raises(ProtocolError, match="checksum"):
            unpack_weights(manifest, bad_ro)
    nan_manifest, nan_payload = pack_weights([("w", torch.tensor([1.0, float("inf")]))], version=7)
    nan_ro, _ = object_store_copy(nan_payload)
    for _ in range(2):
        with pytest.raises(ProtocolError, match=r"payload\['w'\]: holds a non-finite value"):
            unpack_weights(nan_manifest, nan_ro)


def test_nonfinite_names_lists_each_bad_tensor():
    t = {"a": torch.ones(3), "b": torch.tensor([float("nan")]), "c": torch.tensor([3e38, 3e38]), "d": torch.tensor([1])}
    assert nonfinite_names(t) == ["b"]
    t["e"] = torch.tensor([-float("inf")], dtype=torch.bfloat16)
    assert nonfinite_names(t) == ["b", "e"]


def test_cuda_ipc_transport_refuses_host_tensors():
    with pytest.raises(ValueError, match=r"transport: cuda_ipc needs every tensor on one CUDA device"):
        pack_weights([("w", torch.ones(2))], version=1, transport="cuda_ipc")
    with pytest.raises(ValueError, match=r"transport: 'rdma' is not one of"):
        pack_weights([("w", torch.ones(2))], version=1, transport="rdma")
    _, payload = pack_weights([("w", torch.ones(2))], version=1)  # auto on the CPU: the host path
    assert isinstance(payload, PackedWeights)


def test_perturbed_weights_multiply_by_one_plus_std_times_a_seeded_normal_and_keep_ties():
    from modelkit.weights import perturbed_weights

    w = torch.tensor([[1.0, 2.0], [4.0, -8.0]])
    b = torch.tensor([0.5, 0.25])
    manifest, payload = pack_weights([("w", w), ("b", b), ("alias", w)], version=3, dtype="float32")
    m2, p2 = perturbed_weights(manifest, payload, 0.1, seed=7)
    got = unpack_weights(m2, p2)
    g = torch.Generator().manual_seed(7)
    z = {k: torch.randn(v.shape, generator=g) for k, v in unpack_weights(manifest, payload).items() if k != "alias"}
    assert torch.equal(got["w"], w * (1 + 0.1 * z["w"])) and torch.equal(got["b"], b * (1 + 0.1 * z["b"]))
    assert got["alias"] is got["w"] and m2.tied == {"alias": "w"} and m2.version == 3
    assert m2.checksum != manifest.checksum
    m0, p0 = perturbed_weights(manifest, payload, 0.0, seed=7)  # std 0: the same tensors again
    assert all(torch.equal(v, unpack_weights(manifest, payload)[k]) for k, v in unpack_weights(m0, p0).items())
