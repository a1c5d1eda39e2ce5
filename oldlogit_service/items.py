"""Old-logit items and answers as arrays: padding a request, items from trajectories, merging
attached old log-probs, per-token status of an attached answer (numpy / torch, no model)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from protocol import OldLogitItem, TokenStatus, Trajectory


def right_padded(items: Sequence[OldLogitItem]) -> tuple[Tensor, Tensor]:
    """``(token_ids, attention_mask)``, both ``[len(items), longest]`` int64, right-padded with 0."""
    seq = max(len(it.token_ids) for it in items)
    ids = torch.zeros(len(items), seq, dtype=torch.long)
    mask = torch.zeros(len(items), seq, dtype=torch.long)
    for r, it in enumerate(items):
        ids[r, : len(it.token_ids)] = torch.from_numpy(it.token_ids.astype(np.int64))
        mask[r, : len(it.token_ids)] = 1
    return ids, mask


def as_item(x: OldLogitItem | Trajectory | Mapping[str, Any], i: int) -> OldLogitItem:
    """``x`` as an :class:`protocol.OldLogitItem` (``i``: its index, named in errors).

    Raises:
        pydantic.ValidationError: a bad mapping. TypeError: any other type.
    """
    if isinstance(x, OldLogitItem):
        return x
    if isinstance(x, Trajectory):
        return OldLogitItem(
            trajectory_id=x.trajectory_id, token_ids=x.token_ids, loss_mask=x.loss_mask, versions=x.versions
        )
    if isinstance(x, Mapping):
        return OldLogitItem.from_wire(x, f"items[{i}]")
    raise TypeError(f"items[{i}]: expected OldLogitItem, Trajectory or a mapping, got {type(x).__name__}")


def nan_extended(known: np.ndarray | None, n: int, i: int) -> np.ndarray:
    """``known`` ``[k]`` (nats) padded with NaN to ``[n]`` float32 (all NaN for None).

    Raises:
        ValueError: ``k > n`` (names ``old_logprobs[i]``).
    """
    out = np.full(n, np.nan, np.float32)
    if known is not None:
        k = np.asarray(known, np.float32).reshape(-1)
        if len(k) > n:
            raise ValueError(f"old_logprobs[{i}]: length {len(k)} > item length {n}")
        out[: len(k)] = k
    return out


def merge_old_logprobs(base: np.ndarray | None, new: np.ndarray) -> np.ndarray:
    """Fill the NaN positions of ``base`` (``[seq]``, nats) with ``new``; ``base=None`` takes ``new``.

    Raises:
        ValueError: the lengths differ.
    """
    new = np.asarray(new, np.float32)
    if base is None:
        return new.copy()
    base = np.asarray(base, np.float32)
    if base.shape != new.shape:
        raise ValueError(f"old_logprobs: length {base.shape} != new {new.shape}")
    return np.where(np.isnan(base), new, base).astype(np.float32)


def items_from_trajectories(trajectories: Sequence[Trajectory]) -> list[OldLogitItem]:
    """The :class:`protocol.OldLogitItem` of each trajectory (token ids, loss mask, versions)."""
    return [as_item(t, i) for i, t in enumerate(trajectories)]


def items_before(trajectories: Sequence[Trajectory], version: int) -> list[OldLogitItem]:
    """The items of ``trajectories`` scoring only tokens of versions below ``version`` (the tokens of
    ``version`` itself stay context: the learner consuming at ``version`` gives their pi_old)."""
    out = []
    for it in items_from_trajectories(trajectories):
        keep = it.loss_mask.astype(bool) & (it.versions < version)
        out.append(it.model_copy(update={"loss_mask": keep.astype(np.int8)}))
    return out


def status_from_old_logprobs(old_logprobs: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """Per-token status of an attached ``old_logprobs`` ``[seq]``: EXACT where finite on a sampled
    token, CONTEXT where ``loss_mask`` is 0, MISSING_EVICTED elsewhere (it was not scored in time)."""
    m = np.asarray(loss_mask).astype(bool)
    fin = np.isfinite(np.asarray(old_logprobs))
    st = np.full(m.shape, TokenStatus.MISSING_EVICTED, np.int8)
    st[m & fin] = TokenStatus.EXACT
    st[~m] = TokenStatus.CONTEXT
    return st
