"""What a learner's data-parallel ranks combine: floats summed or maximised over the ranks, and
``[batch, seq]`` rows each rank filled for its own share (:func:`score_rows` runs the forwards of
a rank's share, the same number on every rank). Identity with one rank (no collective)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainer.algorithm.batch import Batch, first_loss_position


def all_reduce_floats(values: list[float], world_size: int, op: str = "sum") -> list[float]:
    """``values`` summed (``op`` "sum") or maximised ("max") element-wise over the ``world_size``
    ranks of the default process group, in float64; ``values`` itself with one rank or none given.
    Every rank must call it with as many values."""
    if world_size == 1 or not values:
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t.tolist()


def gather_rows(values: torch.Tensor, world_size: int) -> torch.Tensor:
    """``[batch, seq]`` with every rank's rows filled in, each rank holding finite values on its own
    rows and NaN elsewhere (so a later pass may give any row to any rank); ``values`` itself with one
    rank. A position no rank filled stays NaN."""
    if world_size == 1:
        return values
    import torch.distributed as dist

    filled = torch.isfinite(values)
    total = torch.where(filled, values, 0.0).double()
    count = filled.double()
    dist.all_reduce(total)
    dist.all_reduce(count)
    return torch.where(count > 0, total, float("nan")).to(values.dtype)


def micro_batch_count(rows: int, world_size: int, micro_batch_size: int) -> int:
    """Micro-batches every rank runs for a batch of ``rows`` rows: the largest rank's share of rows
    (``ceil(rows / world_size)``) in micro-batches of ``micro_batch_size``, at least one (ZeRO-3
    gathers parameters in each forward, so every rank runs as many). Example: 10 rows, 2 ranks,
    micro-batch 4 -> 2."""
    rows_per_rank = -(-rows // world_size)
    return max(1, -(-rows_per_rank // micro_batch_size))


def score_rows(
    batch: Batch,
    score: Callable[[Batch, int], torch.Tensor],
    rank: int,
    world_size: int,
    micro_batch_size: int,
    device: torch.device,
) -> torch.Tensor:
    """``[B, T]`` fp32 of ``score(micro_batch, first)`` for every row of ``batch`` (``first``: the
    first loss position of this rank's rows): this rank scores rows ``rank::world_size`` micro-batch
    by micro-batch on ``device``, and the ranks' rows are gathered (:func:`gather_rows`).

    Every rank runs the same number of forwards (:func:`micro_batch_count`; ZeRO-3 gathers
    parameters in each), the ones past its own rows on padding."""
    local_rows = torch.arange(rank, batch.size, world_size)
    local = batch.select(local_rows)
    n_micro = micro_batch_count(batch.size, world_size, micro_batch_size)
    first = first_loss_position(local)
    out = torch.full_like(batch.behav_logprobs, float("nan"))
    # the first ceil(rows / mbs) micro-batches are this rank's rows in order, the rest padding
    for k, mb in enumerate(local.micro_batches(micro_batch_size, n_micro)):
        lp = score(mb.to(device), first)
        start = k * micro_batch_size
        rows = local_rows[start : start + mb.size] if start < local.size else local_rows[:0]
        out[rows, : lp.shape[1]] = lp[: len(rows)].to(out.device)
    return gather_rows(out, world_size)
