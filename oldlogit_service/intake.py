"""Checks and copies of one weight publication as the old-logit service takes it
(:meth:`oldlogit_service.service.OldLogitService.update_weights`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from modelkit.weights import PackedWeights
from oldlogit_service.store import VersionStore
from protocol import AdapterSpec, ProtocolError, WeightManifest


def already_published(
    manifest: WeightManifest, latest: int | None, store: VersionStore, holds_weights: bool, adapter: AdapterSpec | None
) -> bool:
    """Whether ``manifest`` republishes the newest version ``latest`` (a no-op when its checksum
    matches the one ``store`` recorded; also when the service holds no weights, or evicted it).

    Raises:
        protocol.ProtocolError: full weights where the service holds adapters (``adapter``), or the reverse.
        ValueError: an older version than the newest published, or the newest with another checksum.
    """
    if holds_weights and manifest.adapter != adapter:
        have = "full weights" if adapter is None else f"adapters {adapter.model_dump()}"
        got = "full weights (None)" if manifest.adapter is None else f"{manifest.adapter.model_dump()}"
        raise ProtocolError(f"manifest.adapter: {got}, but this service holds {have}")
    v = manifest.version
    if latest is None:
        return False
    if v < latest:
        raise ValueError(
            f"manifest.version: {v} is older than the newest published version {latest}; versions only move forward"
        )
    checksums = store.checksums
    if v == latest and (v in checksums or not holds_weights or v in store.evicted):
        if checksums.get(v, manifest.checksum) != manifest.checksum:
            raise ValueError(
                f"manifest.version: {v} republished with a different checksum ({manifest.checksum} != {checksums[v]})"
            )
        return True
    return False


def check_shapes(full: Mapping[str, Tensor], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raise :class:`protocol.ProtocolError` unless ``full`` has exactly the tensor names and
    ``shapes`` of the model (or the adapter); the message names the tensor."""
    if set(full) != set(shapes):
        missing, extra = sorted(set(shapes) - set(full)), sorted(set(full) - set(shapes))
        raise ProtocolError(f"payload: tensors do not match the model: missing {missing}, unexpected {extra}")
    for name, t in full.items():
        if tuple(t.shape) != shapes[name]:
            raise ProtocolError(f"payload[{name!r}].shape: {list(t.shape)} != model {list(shapes[name])}")


def owned_copy(
    manifest: WeightManifest,
    payload: Mapping[str, Tensor],
    full: Mapping[str, Tensor],
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, Tensor]:
    """The tensors to hold on ``device`` in ``dtype``, tied aliases restored. The object store's
    read-only shared memory is immutable: it is held as it is when it already has that device and
    dtype; anything else is copied (the publisher may reuse it)."""
    shared = isinstance(payload, PackedWeights) and payload.readonly
    own: dict[str, Tensor] = {}
    for spec in manifest.tensors:
        t = full[spec.name].detach()
        keep = shared and t.device == device and t.dtype == dtype
        own[spec.name] = t if keep else t.to(device, dtype, copy=True)
    for alias, src in manifest.tied.items():
        own[alias] = own[src]
    return own
