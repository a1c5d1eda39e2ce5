"""Advantages, returns and length helpers: pure functions over tensors.

Conventions (tested in ``tests/unit/test_losses_advantages.py``):

- Groups: ``rewards`` is either ``[G, n]`` (one row per prompt group) or ``[N]`` with ``group_ids``
  ``[N]`` (any integers; groups may differ in size). Outputs have the shape of ``rewards``.
- GRPO std is the *population* std (divide by n): it is defined for every group size (a group of
  one gets advantage 0), and bounds |A| by sqrt(n - 1). The denominator is
  ``max(std, std_floor)`` with an absolute floor in reward units (default 1e-3), so a group whose
  rewards differ only by float noise gets tiny advantages instead of +-1.
- A zero-variance group (every reward equal, e.g. eight rewards of 0.35) gets advantages of exactly
  0 from every estimator: the fp32 group mean of a value that binary cannot represent exactly is
  not the value itself, and that residue divided by the std floor would otherwise give every sample
  the same small non-zero advantage.
- Lengths count model tokens only: generated length = sum of ``loss_mask`` (tool output and prompt
  tokens are not the model's: a turn of 9 model tokens around 3 tool-output tokens has length 9).
- Truncation is read from the engine's finish reason, never guessed from an EOS id.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

GRPO_STD_FLOOR = 1e-3
"""Absolute floor (reward units) on the GRPO std denominator."""
COMPLETE_REASONS = frozenset({"stop"})
TRUNCATED_REASONS = frozenset({"length", "abort"})
"""Finish reasons that mean the response did not end on its own; "abort" (a cancelled request)
counts as truncated because its ending was not chosen by the model."""


def _groups(rewards: Tensor, group_ids: Tensor | None) -> tuple[Tensor, Tensor, int]:
    """Flat fp32 rewards [N], dense group index [N] and number of groups."""
    if group_ids is None:
        if rewards.dim() != 2:
            raise ValueError(f"rewards must be [G, n] when group_ids is None, got shape {tuple(rewards.shape)}")
        g, n = rewards.shape
        return rewards.float().reshape(-1), torch.arange(g, device=rewards.device).repeat_interleave(n), g
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [N], got {tuple(rewards.shape)}, {tuple(group_ids.shape)}"
        )
    _, inverse = torch.unique(group_ids, return_inverse=True)
    return rewards.float(), inverse, int(inverse.max()) + 1 if inverse.numel() else 0


def _group_sum(values: Tensor, index: Tensor, n_groups: int) -> Tensor:
    return torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, index, values)


def _constant(flat: Tensor, index: Tensor, n_groups: int) -> Tensor:
    """``[n_groups]`` bool: True where every reward of the group is the same value."""
    hi = torch.full((n_groups,), -torch.inf, dtype=flat.dtype, device=flat.device)
    lo = torch.full((n_groups,), torch.inf, dtype=flat.dtype, device=flat.device)
    hi = hi.scatter_reduce(0, index, flat, reduce="amax")
    lo = lo.scatter_reduce(0, index, flat, reduce="amin")
    return hi == lo


def zero_variance_groups(rewards: Tensor, group_ids: Tensor | None = None) -> int:
    """Number of groups whose rewards are all equal (they carry no learning signal; their
    advantages are exactly 0). Shapes as :func:`grpo_advantages`."""
    flat, index, n_groups = _groups(rewards.detach(), group_ids)
    return int(_constant(flat, index, n_groups).sum())


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor | None = None,
    *,
    scale: bool = True,
    std_floor: float = GRPO_STD_FLOOR,
) -> Tensor:
    """GRPO group-normalised advantages (Shao et al. 2024, DeepSeekMath, section 4.1.2, outcome
    supervision): A_i = (r_i - mean_g) / max(std_g, std_floor), population std over the group.

    ``scale=False`` gives the mean-centred A_i = r_i - mean_g (Dr. GRPO, Liu et al. 2025). Shapes:
    ``[G, n]`` or ``[N]`` with ``group_ids``; fp32 output of the same shape, detached.
    """
    if not std_floor > 0:
        raise ValueError(f"std_floor must be > 0, got std_floor={std_floor!r}")
    flat, index, n_groups = _groups(rewards.detach(), group_ids)
    count = _group_sum(torch.ones_like(flat), index, n_groups)
    mean = _group_sum(flat, index, n_groups) / count
    centred = flat - mean[index]
    if scale:
        std = (_group_sum(centred.square(), index, n_groups) / count).sqrt()
        centred = centred / std.clamp(min=std_floor)[index]
    centred = torch.where(_constant(flat, index, n_groups)[index], 0.0, centred)
    return centred.reshape(rewards.shape)


def rloo_advantages(rewards: Tensor, group_ids: Tensor | None = None) -> Tensor:
    """Leave-one-out baseline (Ahmadian et al. 2024, "Back to basics", RLOO):
    A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean_g); a group of one, or of equal
    rewards, gets exactly 0.

    Shapes as :func:`grpo_advantages`.
    """
    flat, index, n_groups = _groups(rewards.detach(), group_ids)
    count = _group_sum(torch.ones_like(flat), index, n_groups)[index]
    total = _group_sum(flat, index, n_groups)[index]
    others = (total - flat) / (count - 1).clamp(min=1)
    varies = (count > 1) & ~_constant(flat, index, n_groups)[index]
    return torch.where(varies, flat - others, 0.0).reshape(rewards.shape)


def reinforce_returns(rewards: Tensor, loss_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Discounted returns G_t = r_t + g_t G_{t+1} per token ``[B, T]`` (Williams 1992), 0 off the mask.

    ``rewards`` ``[B, T]`` holds each position's reward (usually only the last model token of a
    turn is non-zero). Time is counted in model tokens: g_t = gamma on model tokens
    (``loss_mask`` = 1) and 1 on prompt and tool tokens, so tool output does not add discount.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got gamma={gamma!r}")
    mask = loss_mask != 0
    rewards = rewards.detach().float()
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        discount = torch.where(mask[:, t], gamma, 1.0)
        running = rewards[:, t] + discount * running
        returns[:, t] = running
    return torch.where(mask, returns, 0.0)


def generated_lengths(loss_mask: Tensor) -> Tensor:
    """Model-generated length per sequence ``[B]`` (long) = sum of the loss mask (9 for a turn of
    9 model tokens around 3 tool-output tokens, not the 12-token span)."""
    return (loss_mask != 0).sum(-1)


def overlong_penalty(lengths: Tensor, max_length: int, buffer_length: int, factor: float = 1.0) -> Tensor:
    """Soft overlong punishment (DAPO, Yu et al. 2025): ``[B]`` reward to add, <= 0.

    0 while length <= max_length - buffer_length; then linear down to -factor at max_length;
    -factor beyond. ``lengths`` should come from :func:`generated_lengths`.
    """
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"need 0 < buffer_length <= max_length, got {buffer_length=}, {max_length=}")
    start = max_length - buffer_length
    over = (lengths.float() - start).clamp(min=0) / buffer_length
    return -factor * over.clamp(max=1.0)


def truncation_mask(
    loss_mask: Tensor,
    finish_reasons: Sequence[str | None],
    truncated: Sequence[bool] | None = None,
) -> Tensor:
    """``loss_mask`` ``[B, T]`` with whole rows zeroed for truncated responses (overlong filtering).

    A row is truncated when its engine ``finish_reason`` is in :data:`TRUNCATED_REASONS`, or when
    ``truncated[b]`` is set (a multi-turn trajectory cut by the context budget). "stop" is kept even
    when the last token is not the tokenizer's eos id. A missing or unknown finish reason raises:
    it must never default to "not truncated".
    """
    if len(finish_reasons) != loss_mask.shape[0]:
        raise ValueError(f"finish_reasons has {len(finish_reasons)} entries for {loss_mask.shape[0]} rows")
    cut = []
    for b, reason in enumerate(finish_reasons):
        if reason not in COMPLETE_REASONS | TRUNCATED_REASONS:
            raise ValueError(
                f"finish_reasons[{b}]={reason!r}: expected one of {sorted(COMPLETE_REASONS | TRUNCATED_REASONS)}"
            )
        cut.append(reason in TRUNCATED_REASONS or bool(truncated is not None and truncated[b]))
    keep = ~torch.tensor(cut, dtype=torch.bool, device=loss_mask.device)
    return loss_mask * keep.unsqueeze(-1).to(loss_mask.dtype)
