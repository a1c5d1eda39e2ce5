"""Served-weights fingerprints: a cheap digest of the weights a consumer actually computes with.

The checksum of a publication (:func:`protocol.weights_digest`) proves that a payload arrived whole;
the fingerprint proves that the engine serves it afterwards. It is computed by each consumer from
its engine's own tensors, read back after loading, and by the producer from the payload; the driver
compares the two.

The rule (:func:`weights_fingerprint`), for a set of HF-named tensors:

1. **Positions.** For a tensor ``name`` of ``numel`` elements: all flat (C-order) indices when
   ``numel <= SAMPLES``, else ``SAMPLES`` = 64 flat indices drawn with replacement by
   ``numpy.random.default_rng([SEED, zlib.crc32(name)]).integers(0, numel, SAMPLES)``
   (:func:`sample_positions`). Fixed for a name and a size: the same in every process.
2. **Component.** The values at those positions, each rounded to the consumer's dtype (fp32, bf16
   or fp16, round-to-nearest-even as ``Tensor.to``), converted exactly to float64 and summed with
   ``math.fsum`` (the correctly rounded sum: exact up to one final rounding and independent of the
   order). A duplicate position counts as often as it is drawn. A tensor with a non-finite sampled
   value has the component NaN (such a payload is refused by every consumer anyway).
3. **Fingerprint.** BLAKE2b with an 8-byte digest over the lines ``"{name}={component.hex()}\\n"``
   in sorted name order, as 16 hex characters (:func:`fingerprint_of_samples`).

Coverage: every tensor of the given set (a full publication: every tensor of the manifest, tied
aliases left out; an adapter: its ``A`` / ``B`` factors; a rollout worker that merges adapters:
the merged full weights it hands to its engine). Cost: 64 elements per tensor, gathered where the
tensor lives; no pass over the whole tensor.

Tolerance: none - equal fingerprints mean equal rounded values at every sampled position. The
producer and the consumer must round to the same dtype: a learner holding fp32 weights and a
consumer serving bf16 agree exactly when the learner's side is computed with ``dtype=bfloat16``
(the publication is packed in the consumer's dtype, so its fingerprint is). A change that moves
no sampled element (e.g. a single weight outside the sample) is not seen: it is a check that the
served version is the published one, not a checksum of every byte.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from collections.abc import Iterable, Mapping

import numpy as np
import torch

SAMPLES = 64
"""Elements sampled per tensor (all of a tensor with at most this many)."""

SEED = 0x5EED_F1F1
"""First word of every position generator's seed; the second is ``zlib.crc32(name)``."""


def sample_positions(name: str, numel: int) -> np.ndarray:
    """Flat C-order indices sampled from tensor ``name`` of ``numel`` elements (see the module rule).

    Returns:
        int64 ``[min(numel, SAMPLES)]``: ``arange(numel)`` when ``numel <= SAMPLES``, else
        ``SAMPLES`` indices in ``[0, numel)`` drawn with replacement.

    Raises:
        ValueError: ``numel`` < 0.
    """
    if numel < 0:
        raise ValueError(f"numel: must be >= 0, got {numel} for {name!r}")
    if numel <= SAMPLES:
        return np.arange(numel, dtype=np.int64)
    rng = np.random.default_rng([SEED, zlib.crc32(name.encode())])
    return rng.integers(0, numel, SAMPLES, dtype=np.int64)


def sampled_values(name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> list[float]:
    """The values of ``tensor`` at :func:`sample_positions`, rounded to ``dtype`` (None: its own),
    as Python floats (exact float64). Only the sampled elements are gathered and moved to the CPU."""
    flat = tensor.detach().reshape(-1)
    idx = torch.from_numpy(sample_positions(name, flat.numel())).to(flat.device)
    picked = flat.index_select(0, idx)
    if dtype is not None:
        picked = picked.to(dtype)
    return picked.to(device="cpu", dtype=torch.float64).tolist()


def fingerprint_components(samples: Mapping[str, Iterable[float]]) -> dict[str, float]:
    """``{name: math.fsum(values)}``: the float64 component of each tensor from its sampled values
    (NaN when a value is not finite)."""
    out = {}
    for name, values in samples.items():
        vals = [float(x) for x in values]
        out[name] = math.fsum(vals) if all(math.isfinite(x) for x in vals) else math.nan
    return out


def fingerprint_of_components(components: Mapping[str, float]) -> str:
    """16 hex characters: BLAKE2b-64 of ``"{name}={float.hex(component)}\\n"`` in sorted name order.

    Raises:
        ValueError: no components.
    """
    if not components:
        raise ValueError("components: no tensors to fingerprint")
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(components):
        h.update(f"{name}={float(components[name]).hex()}\n".encode())
    return h.hexdigest()


def fingerprint_of_samples(samples: Mapping[str, Iterable[float]]) -> str:
    """:func:`fingerprint_of_components` of :func:`fingerprint_components` (values already rounded)."""
    return fingerprint_of_components(fingerprint_components(samples))


def weights_fingerprint(named: Mapping[str, torch.Tensor], dtype: torch.dtype | str | None = None) -> str:
    """The fingerprint of ``{name: tensor}`` (any device, any floating dtype) with its values rounded
    to ``dtype`` (a torch dtype or its name, ``"bfloat16"``; None: each tensor's own dtype).

    Raises:
        ValueError: ``named`` is empty, or ``dtype`` is unknown.
    """
    if isinstance(dtype, str):
        dt = getattr(torch, dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"dtype: {dtype!r} is not a torch dtype")
        dtype = dt
    return fingerprint_of_samples({n: sampled_values(n, t, dtype) for n, t in named.items()})
