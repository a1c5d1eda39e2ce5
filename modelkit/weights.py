"""Versioned weight packing: the one format the learner publishes and every consumer applies.

A publication is ``(WeightManifest, payload)``; the payload maps each HF name to a tensor
(:class:`PackedWeights` on the host, :class:`modelkit.cuda_ipc.CudaIpcWeights` for consumers that
share the learner's GPU). Invariants:

* a tensor that shares storage with an earlier one (tied embeddings) is sent once and listed in
  ``manifest.tied``; :func:`unpack_weights` restores the alias, so tied weights stay tied;
* tensors are cast to the consumer's dtype before packing, once per dtype, and the digest
  (:func:`protocol.weights_digest`) covers the bytes sent; the producer computes it once, and the
  served-weights fingerprint of the same tensors (:mod:`modelkit.fingerprint`,
  ``manifest.fingerprint``), what a consumer serving them reads back;
* the payload is private to the publication: the learner may step as soon as it is packed.
  :func:`pack_weights` makes that private copy itself, or - with ``copy=False``, for a caller that
  hands the payload straight to Ray's object store - leaves it to ``ray.put``'s copy, so the bytes
  are copied once, not twice;
* a consumer verifies the whole payload before touching its model, so a version is applied whole
  or not at all (a failed check raises and the old version keeps serving); a payload holding a
  non-finite value is refused like a corrupt one. A payload read from the object store is shared
  memory that nobody writes, so it is verified once per host, not once per consumer
  (:func:`verify_payload`); consumers read it in place, without copying it first.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from modelkit.fingerprint import weights_fingerprint
from protocol import ProtocolError, TensorSpec, WeightManifest, verify_weight_payload, weights_digest

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

Transport = Literal["auto", "host", "cuda_ipc"]
"""How a payload reaches its consumers: ``host`` through the object store (any host); ``cuda_ipc``
as CUDA IPC handles (consumers on the learner's host that see its GPU); ``auto``: ``cuda_ipc`` when
every tensor is on a CUDA device, else ``host``."""

VERIFIED_MARKER_TTL_S = 3600.0
"""Per-host verification records older than this (seconds) are deleted when a new one is written."""


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


# ---------------------------------------------------------------------------------------------
# the host payload
# ---------------------------------------------------------------------------------------------


class PackedWeights(Mapping[str, torch.Tensor]):
    """A host payload: ``{hf_name: contiguous cpu tensor}`` in manifest order, plus a packing token.

    Pickling sends each tensor as a NumPy byte array. Ray's serializer moves such arrays out of
    band: ``ray.put`` copies the bytes into the object store once, and every reader on the same
    host gets read-only views of that shared memory (no copy). ``readonly`` is True for such views
    (and for any payload rebuilt from read-only buffers); a consumer must never write them.

    Args:
        tensors: contiguous CPU tensors, in manifest order.
        token: names this packing (a fresh random hex string when None); with the manifest's
            checksum it keys the per-host verification record.
        readonly: the tensors are views of read-only shared memory.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], token: str | None = None, readonly: bool = False):
        self._tensors = tensors
        self.token = token or uuid.uuid4().hex
        self.readonly = readonly

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def __reduce__(self):
        entries = [
            (n, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy())
            for n, t in self._tensors.items()
        ]
        return (_rebuild_packed, (entries, self.token))


def _rebuild_packed(entries: list[tuple[str, str, tuple[int, ...], np.ndarray]], token: str) -> PackedWeights:
    tensors, readonly = {}, False
    for name, dtype, shape, arr in entries:
        dt = getattr(torch, dtype)
        if arr.ctypes.data % dt.itemsize:  # an in-band pickle may leave the bytes misaligned for the dtype
            arr = arr.copy()
        readonly = readonly or not arr.flags.writeable
        with warnings.catch_warnings():  # read-only shared memory: consumers only read it
            warnings.simplefilter("ignore", UserWarning)
            tensors[name] = torch.from_numpy(arr).view(dt).view(shape)
    return PackedWeights(tensors, token=token, readonly=readonly)


# ---------------------------------------------------------------------------------------------
# producer
# ---------------------------------------------------------------------------------------------


def _dedupe_tied(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], str] = {}
    tied: dict[str, str] = {}
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in named:
        # a true alias shares storage, offset, shape and strides; equal-shape slices of one flat
        # buffer (ZeRO flat groups, fused qkv splits) are distinct tensors and are all sent
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        if key in seen and key[0] != 0:
            tied[name] = seen[key]
            continue
        seen[key] = name
        out.append((name, t.detach()))
    return out, tied


def pack_weights(
    named: Iterable[tuple[str, torch.Tensor]],
    version: int,
    dtype: str = "float32",
    copy: bool = True,
    transport: Transport = "auto",
) -> tuple[WeightManifest, Mapping[str, torch.Tensor]]:
    """Pack ``(hf_name, tensor)`` pairs (e.g. ``model.state_dict().items()``) for publication.

    Storage-sharing duplicates become ``tied`` aliases; every other tensor is cast to ``dtype``
    exactly once. Host transport: each tensor is copied (and cast) into new CPU memory, then the
    digest is computed over those copies. With ``copy=False`` a tensor already on the CPU, contiguous
    and in ``dtype`` is sent as it is (a view of the caller's tensor): only for a caller that puts
    the payload into Ray's object store before the source can change (an actor method returning
    it), so ``ray.put``'s copy is the one private copy. CUDA IPC transport: see
    :func:`modelkit.cuda_ipc.pack_cuda_ipc` (always a private device copy).

    Args:
        named: ``(hf_name, tensor)`` pairs, any device.
        version: the manifest's version.
        dtype: ``float32``, ``bfloat16`` or ``float16``: the consumers' dtype.
        copy: make the private copy here (default); False: see above.
        transport: see :data:`Transport`.

    Returns:
        The manifest (with checksum) and the payload (:class:`PackedWeights` on the host path).

    Raises:
        ValueError: an unknown ``dtype`` or ``transport``, ``transport="cuda_ipc"`` with a tensor
            that is not on a CUDA device, or nothing to pack.
    """
    target = torch_dtype(dtype)
    items, tied = _dedupe_tied(named)
    if not items:
        raise ValueError("named: no tensors to pack")
    if transport not in ("auto", "host", "cuda_ipc"):
        raise ValueError(f"transport: {transport!r} is not one of auto, host, cuda_ipc")
    on_cuda = all(t.is_cuda for _, t in items)
    if transport == "cuda_ipc" or (transport == "auto" and on_cuda):
        from modelkit.cuda_ipc import pack_cuda_ipc

        return pack_cuda_ipc(items, tied, version, target)
    payload = PackedWeights(private_copy(items, target, copy))
    return _manifest(payload, version, tied), payload


def private_copy(
    items: list[tuple[str, torch.Tensor]], target: torch.dtype, copy: bool = True
) -> dict[str, torch.Tensor]:
    """``{name: contiguous cpu tensor in target}``: each tensor cast and copied once, into new memory.

    With ``copy=False`` a tensor already on the CPU, contiguous and in ``target`` is returned as it
    is (see :func:`pack_weights` for when that is safe). One allocation per tensor: the allocator
    reuses the memory of an earlier publication, where one large buffer would be mapped (and
    page-faulted) afresh every time.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in items:
        if not copy and t.device.type == "cpu" and t.dtype == target and t.is_contiguous():
            out[name] = t
        else:
            out[name] = torch.empty(t.shape, dtype=target).copy_(t)  # the one copy, cast on the way
    return out


def _manifest(payload: Mapping[str, torch.Tensor], version: int, tied: dict[str, str]) -> WeightManifest:
    specs = [
        TensorSpec(name=n, shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch.")) for n, t in payload.items()
    ]
    checksum = weights_digest(list(payload), (raw_bytes(t) for t in payload.values()))
    fp = weights_fingerprint(payload)
    return WeightManifest(version=version, tensors=specs, checksum=checksum, tied=tied, fingerprint=fp)


# ---------------------------------------------------------------------------------------------
# consumer
# ---------------------------------------------------------------------------------------------


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when every element of every floating tensor is finite (see :func:`nonfinite_names`)."""
    return not nonfinite_names({str(i): t for i, t in enumerate(tensors) if torch.is_tensor(t)})


def nonfinite_names(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the floating tensors holding a NaN or an infinity, in order; integer tensors are skipped.

    One fp32-accumulated sum per tensor, read back with a single synchronisation: IEEE arithmetic
    keeps a NaN or an infinity in every partial sum it enters, so a finite sum means every element
    is finite. Only a tensor whose sum is not finite is checked element-wise, so a sum that merely
    overflows on finite values is not mistaken for a non-finite weight.
    """
    floats = [(n, t.detach()) for n, t in tensors.items() if t.is_floating_point()]
    if not floats:
        return []
    dev = floats[0][1].device
    ok = torch.isfinite(torch.stack([torch.sum(t, dtype=torch.float32).to(dev) for _, t in floats])).tolist()
    return [n for (n, t), k in zip(floats, ok, strict=True) if not k and not bool(torch.isfinite(t).all())]


def check_payload(manifest: WeightManifest, payload: Mapping[str, torch.Tensor]) -> None:
    """Names, shapes, byte counts, digest, then finiteness of ``payload`` against ``manifest``.

    Raises:
        protocol.ProtocolError: a tensor is missing, extra or mis-shaped, the digest differs, or a
            tensor holds a NaN or an infinity (the message names the first such tensor).
    """
    check = getattr(payload, "check", None)  # a CUDA IPC payload checks itself on its device
    if check is not None:
        check(manifest)
    else:
        verify_weight_payload(manifest, {n: (list(t.shape), raw_bytes(t)) for n, t in payload.items()})
    bad = nonfinite_names(payload)
    if bad:
        raise ProtocolError(f"payload[{bad[0]!r}]: holds a non-finite value ({len(bad)} tensor(s) affected)")


def verify_payload(manifest: WeightManifest, payload: Mapping[str, torch.Tensor]) -> bool:
    """:func:`check_payload`, once per host for a payload read from Ray's object store.

    Rule: a :class:`PackedWeights` whose tensors are read-only views (``readonly``: the object
    store's shared memory, which every consumer on the host reads and nobody writes; payloads
    under Ray's inline limit, 100 KiB, arrive inside the call instead) is checked by the first
    consumer on the host that receives it; the others wait for that check (a file lock) and find
    its record (a file named by version, checksum and packing token under the temp dir).
    Any other payload (writable, or not a :class:`PackedWeights`) is checked every time. A failed
    check leaves no record, so every consumer checks, and refuses, on its own.

    Returns:
        True if this call ran the check, False if a record said it had passed on this host.

    Raises:
        protocol.ProtocolError: see :func:`check_payload`.
    """
    if not (isinstance(payload, PackedWeights) and payload.readonly):
        check_payload(manifest, payload)
        return True
    key = f"v{manifest.version}-{manifest.checksum}-{payload.token}"
    return _once_per_host(key, lambda: check_payload(manifest, payload))


def _record_dir() -> Path | None:
    d = Path(tempfile.gettempdir()) / f"vintage-verified-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        d.mkdir(mode=0o700)
    st = d.stat()
    return d if d.is_dir() and st.st_uid == os.getuid() and not st.st_mode & 0o077 else None


def _once_per_host(key: str, check: Callable[[], Any]) -> bool:
    d = _record_dir()
    if d is None:  # no private place for records: check every time
        check()
        return True
    with open(d / key, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        if fh.read(2) == b"ok":
            return False
        check()
        fh.write(b"ok")
        fh.flush()
    now = time.time()
    for p in d.iterdir():
        with contextlib.suppress(OSError):
            if now - p.stat().st_mtime > VERIFIED_MARKER_TTL_S:
                p.unlink()
    return True


def unpack_weights(
    manifest: WeightManifest, payload: Mapping[str, torch.Tensor], verify: bool = True
) -> dict[str, torch.Tensor]:
    """Verify a payload against its manifest and return ``{name: tensor}`` with tied aliases restored.

    The tensors are the payload's own (no copy): views of the object store's read-only shared
    memory for a payload received through Ray; the caller copies them into its model in place.
    Verification: :func:`verify_payload` (once per host for object-store payloads).

    Raises:
        protocol.ProtocolError: a tensor is missing, extra, mis-shaped, holds a NaN or an infinity,
            or the checksum differs.
    """
    if verify:
        verify_payload(manifest, payload)
    out = dict(payload)
    for alias, src in manifest.tied.items():
        out[alias] = out[src]
    return out


def perturbed_weights(manifest: WeightManifest, payload: PackedWeights, std: float, seed: int):
    """``payload`` with every floating tensor ``w`` replaced by ``w * (1 + std * z)``, ``z ~ N(0, 1)``
    drawn elementwise in fp32 from ``torch.Generator().manual_seed(seed)`` and cast to the tensor's
    dtype; tied aliases stay one tensor. Re-packed as the same version (new checksum and
    fingerprint): ``(manifest, payload)``. The injected train-inference mismatch of the methods
    benchmark (``rollout.inject_mismatch_std``).
    """
    g = torch.Generator().manual_seed(seed)
    named = unpack_weights(manifest, payload, verify=False)
    noisy = {
        k: v
        if k in manifest.tied
        else v * (1 + std * torch.randn(v.shape, generator=g, dtype=torch.float32).to(v.dtype))
        for k, v in named.items()
    }
    for alias, src in manifest.tied.items():  # keep ties: same tensor object under both names
        noisy[alias] = noisy[src]
    return pack_weights(noisy.items(), manifest.version, manifest.tensors[0].dtype)
