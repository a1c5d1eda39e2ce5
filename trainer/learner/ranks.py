"""What a learner's data-parallel ranks combine: floats summed or maximised over the ranks, and
``[batch, seq]`` rows each rank filled for its own share. Identity with one rank (no collective)."""

from __future__ import annotations

import torch


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
