"""Versioned weight packing: the one format the learner publishes and every consumer applies.

A publication is ``(WeightManifest, {hf_name: cpu tensor})``. Invariants:

* a tensor that shares storage with an earlier one (tied embeddings) is sent once and listed in
  ``manifest.tied``; :func:`unpack_weights` restores the alias, so tied weights stay tied;
* tensors are cast to the consumer's dtype before packing, and the checksum covers the bytes sent;
* a consumer verifies the whole payload before touching its model, so a version is applied whole
  or not at all (a failed check raises and the old version keeps serving); a payload holding a
  non-finite value is refused like a corrupt one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from protocol import ProtocolError, TensorSpec, WeightManifest, payload_checksum, verify_weight_payload

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; raises ValueError naming the dtype if unsupported."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype: {name!r} is not one of {sorted(_DTYPES)}") from None


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes (C order) without a copy when already contiguous; works for bf16."""
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def pack_weights(
    named: Iterable[tuple[str, torch.Tensor]], version: int, dtype: str = "float32"
) -> tuple[WeightManifest, dict[str, torch.Tensor]]:
    """Pack ``(hf_name, tensor)`` pairs (e.g. ``model.state_dict().items()``) for publication.

    Tensors are detached, moved to CPU and cast to ``dtype``; storage-sharing duplicates become
    ``tied`` aliases. Returns the manifest (with checksum) and the payload ``{name: tensor}``.
    """
    target = torch_dtype(dtype)
    seen: dict[tuple[int, tuple[int, ...]], str] = {}
    tied: dict[str, str] = {}
    payload: dict[str, torch.Tensor] = {}
    for name, t in named:
        # a true alias shares storage, offset, shape and strides; equal-shape slices of one flat
        # buffer (ZeRO flat groups, fused qkv splits) are distinct tensors and are all sent
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        if key in seen and key[0] != 0:
            tied[name] = seen[key]
            continue
        seen[key] = name
        # always a private copy: the learner may step before the payload is serialised
        payload[name] = t.detach().to("cpu", target, copy=True).contiguous()
    specs = [
        TensorSpec(name=n, shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch.")) for n, t in payload.items()
    ]
    checksum = payload_checksum([(n, raw_bytes(t)) for n, t in payload.items()])
    return WeightManifest(version=version, tensors=specs, checksum=checksum, tied=tied), payload


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when every element of every floating tensor is finite.

    One fp32-accumulated sum per tensor (a NaN or an infinity makes the sum non-finite); a tensor
    whose sum is not finite is then checked element-wise, so a sum that merely overflows on finite
    values is not mistaken for a non-finite weight. Integer tensors are skipped.
    """
    floats = [t.detach() for t in tensors if torch.is_tensor(t) and t.is_floating_point()]
    if not floats:
        return True
    sums = torch.stack([torch.sum(t, dtype=torch.float32) for t in floats])
    if bool(torch.isfinite(sums).all()):
        return True
    return all(
        bool(torch.isfinite(t).all()) for t, ok in zip(floats, torch.isfinite(sums).tolist(), strict=True) if not ok
    )


def unpack_weights(
    manifest: WeightManifest, payload: Mapping[str, torch.Tensor], verify: bool = True
) -> dict[str, torch.Tensor]:
    """Verify a payload against its manifest and return ``{name: tensor}`` with tied aliases restored.

    Raises:
        protocol.ProtocolError: a tensor is missing, extra, mis-shaped, holds a NaN or an infinity,
            or the checksum differs.
    """
    if verify:
        verify_weight_payload(manifest, {n: (list(t.shape), raw_bytes(t)) for n, t in payload.items()})
        bad = [n for n, t in payload.items() if not all_finite([t])]
        if bad:
            raise ProtocolError(f"payload[{bad[0]!r}]: holds a non-finite value ({len(bad)} tensor(s) affected)")
    out = dict(payload)
    for alias, src in manifest.tied.items():
        out[alias] = out[src]
    return out
