"""GPU weight publication through CUDA IPC: consumers on the learner's GPU read its copy in place.

Selected by :func:`modelkit.weights.pack_weights` when every tensor is on a CUDA device and
``transport`` is ``auto`` or ``cuda_ipc``. The producer casts the weights once into one private
flat buffer on its own GPU; what travels (through Ray's object store like any payload) is one CUDA
IPC handle of that buffer plus the tensor index, a few kilobytes. A consumer opens the handle on
the device with the producer's GPU UUID and copies from it straight into its model
(``load_weights`` in place for vLLM on CUDA), so the weights never leave device memory.

Rules:

* the consumer must see the producer's physical GPU (same host, the GPU in its
  ``CUDA_VISIBLE_DEVICES``: colocated actors with fractional ``num_gpus``); otherwise opening
  raises :class:`protocol.ProtocolError` naming the GPU - publish with ``transport="host"`` then;
* the producer must keep its :class:`CudaIpcWeights` alive until every consumer has applied it
  (CUDA IPC memory is owned by the exporting process); :class:`trainer.learner.LearnerCore` keeps
  its last two publications;
* no bytes travel, so there is nothing to damage in transit: the manifest's checksum is
  :func:`protocol.weights_digest` over the names followed by the packing's metadata (packing
  token, GPU UUID, and each tensor's dtype, shape and byte offset), which ties a manifest to the
  one packing it describes; the finite check runs on the device (one sum per tensor).

Handles are made with torch's own CUDA reductions (``torch.multiprocessing.reductions``), as vLLM's
IPC weight-transfer engine does.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping

import torch

from protocol import ProtocolError, TensorSpec, WeightManifest, weights_digest

Entry = tuple[str, str, tuple[int, ...], int, int]
"""``(name, dtype, shape, byte offset, byte count)`` of one tensor in the flat buffer."""


def gpu_uuid(device: torch.device | int) -> str:
    """The physical UUID of a visible CUDA device (stable across ``CUDA_VISIBLE_DEVICES`` renumbering)."""
    return str(torch.cuda.get_device_properties(device).uuid)


class CudaIpcWeights(Mapping[str, torch.Tensor]):
    """A device payload: ``{hf_name: cuda tensor}`` as views of one flat buffer on one GPU.

    On the producer it holds the buffer; unpickled on a consumer it holds the IPC handle and
    opens it at the first tensor access (:meth:`open`).
    """

    def __init__(
        self, flat: torch.Tensor | None, index: list[Entry], gpu: str, token: str, handle: tuple | None = None
    ):
        self._flat, self.index, self.gpu, self.token, self._handle = flat, index, gpu, token, handle
        self._views: dict[str, torch.Tensor] | None = None

    # -- Mapping --------------------------------------------------------------------------------

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.open()[name]

    def __iter__(self) -> Iterator[str]:
        return (e[0] for e in self.index)

    def __len__(self) -> int:
        return len(self.index)

    # -- transport ------------------------------------------------------------------------------

    def __reduce__(self):
        from torch.multiprocessing.reductions import reduce_tensor

        handle = self._handle if self._flat is None else reduce_tensor(self._flat)[1]
        return (CudaIpcWeights, (None, self.index, self.gpu, self.token, handle))

    def open(self) -> dict[str, torch.Tensor]:
        """The tensors as views of the producer's buffer, opened on the local device with its UUID.

        Raises:
            protocol.ProtocolError: no visible CUDA device has the producer's GPU UUID.
        """
        if self._views is None:
            if self._flat is None:
                self._flat = self._import()
            self._views = {
                name: self._flat[off : off + size].view(getattr(torch, dtype)).view(shape)
                for name, dtype, shape, off, size in self.index
            }
        return self._views

    def _import(self) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        visible = [gpu_uuid(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
        if self.gpu not in visible:
            raise ProtocolError(
                f"payload: CUDA IPC buffer lives on GPU {self.gpu}, which this process cannot see "
                f"(visible: {visible}); publish with transport='host' to consumers off the learner's GPU"
            )
        args = list(self._handle)
        args[6] = visible.index(self.gpu)  # the storage device, renumbered for this process
        return rebuild_cuda_tensor(*args)

    # -- verification ---------------------------------------------------------------------------

    def digest(self) -> str:
        """:func:`protocol.weights_digest` of the names and this packing's metadata (see the module rules)."""
        meta = json.dumps([self.token, self.gpu, [list(e[1:]) for e in self.index]]).encode()
        return weights_digest([e[0] for e in self.index], [meta])

    def check(self, manifest: WeightManifest) -> None:
        """Names, shapes, dtypes and digest against ``manifest``; opens the handle (finiteness is the caller's).

        Raises:
            protocol.ProtocolError: naming the tensor or field that differs, or the GPU that is not visible.
        """
        got = {e[0]: e for e in self.index}
        want = {t.name: t for t in manifest.tensors}
        if set(got) != set(want):
            missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
            raise ProtocolError(f"payload: missing tensors {missing}, unexpected tensors {extra}")
        for name, spec in want.items():
            _, dtype, shape, _, size = got[name]
            if list(shape) != spec.shape or dtype != spec.dtype or size != spec.nbytes:
                raise ProtocolError(f"payload[{name!r}]: {dtype} {list(shape)} != manifest {spec.dtype} {spec.shape}")
        if [e[0] for e in self.index] != [t.name for t in manifest.tensors] or self.digest() != manifest.checksum:
            raise ProtocolError(f"checksum: payload digest {self.digest()} != manifest {manifest.checksum}")
        self.open()


def pack_cuda_ipc(
    items: list[tuple[str, torch.Tensor]], tied: dict[str, str], version: int, target: torch.dtype
) -> tuple[WeightManifest, CudaIpcWeights]:
    """Cast ``items`` once into one new flat buffer on their CUDA device; the manifest and payload.

    Raises:
        ValueError: a tensor is not on a CUDA device, or the tensors span several devices.
    """
    devices = {t.device for _, t in items}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"transport: cuda_ipc needs every tensor on one CUDA device, got {sorted(map(str, devices))}")
    device = next(iter(devices))
    index: list[Entry] = []
    off = 0
    for name, t in items:
        size = t.numel() * target.itemsize
        index.append((name, str(target).removeprefix("torch."), tuple(t.shape), off, size))
        off += -(-size // 256) * 256  # 256-byte aligned views, as the CUDA allocator aligns blocks
    flat = torch.empty(off, dtype=torch.uint8, device=device)
    payload = CudaIpcWeights(flat, index, gpu_uuid(device), uuid.uuid4().hex)
    views = payload.open()
    for name, t in items:
        views[name].copy_(t)  # the one copy, cast on the way, on the device
    from modelkit.fingerprint import weights_fingerprint

    specs = [TensorSpec(name=e[0], shape=list(e[2]), dtype=e[1]) for e in index]
    fp = weights_fingerprint(views)
    return WeightManifest(version=version, tensors=specs, checksum=payload.digest(), tied=tied, fingerprint=fp), payload
