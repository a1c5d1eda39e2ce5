"""Collate :class:`protocol.Trajectory` lists into padded ``[batch, seq]`` tensors for the learner.

One :class:`Batch` is what one optimizer step consumes. Conventions (``docs/architecture.md``):

* Rows are right-padded to the longest sequence; ``attention_mask`` is 1 on real tokens.
* ``sampled_mask`` is the trajectory's own ``loss_mask`` (1 on tokens the model sampled);
  ``loss_mask`` is what the loss trains on: ``sampled_mask`` minus tokens over
  ``max_token_staleness`` (they stay as context), minus whole rows whose engine finish
  reason says they were truncated when the overlong filter is on (decided by the finish reason, never an EOS id), minus position 0
  (no prefix to score it with). The token-mean denominator is ``loss_mask.sum()`` over the whole
  optimizer batch (all micro-batches and data-parallel ranks), so it never depends on the split,
  and tool/prompt tokens never count.
* ``behav_logprobs`` (mu, nats) holds the engine value recorded when each token was sampled, NaN on
  context/padding tokens (a placeholder that the loss never reads).
* ``versions`` is the sampling version per token, ``-1`` off sampled tokens; ``staleness`` is
  ``consuming_version - versions`` on sampled tokens and 0 elsewhere (queue time counts).
* ``old_logprobs`` is exact pi_old where a route supplied it (NaN elsewhere), ``exact_mask`` the
  tokens where it is usable (sampled, flagged exact, finite). ``current_mask``: trained tokens of
  the consuming version itself that no route scored (:func:`learner_gives_current`): their pi_old
  is the learner's own forward at that version, taken in the batch's only optimizer step, so they
  are exact too; disjoint from ``exact_mask``.
* ``advantages`` ``[batch, seq]``: one value per sequence from its group's rewards
  (GRPO/RLOO/REINFORCE, computed over the whole batch before any split), broadcast to the sampled
  tokens, 0 elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import Tensor

from protocol import NO_VERSION, ROUTE_TRAITS, OldLogitAnswer, TokenStatus, Trajectory
from trainer.algorithm.advantages import TRUNCATED_REASONS, grpo_advantages, rloo_advantages, zero_variance_groups

_ROW_TENSORS = (
    "token_ids", "attention_mask", "loss_mask", "sampled_mask", "behav_logprobs", "versions", "staleness",
    "old_logprobs", "exact_mask", "advantages", "rewards", "seq_advantages", "recompute_logprobs", "current_mask",
    "group_index", "baselines", "ref_logprobs",
)  # fmt: skip
_SEQUENCE_TENSORS = ("rewards", "seq_advantages", "group_index", "baselines")
"""The row tensors of shape ``[B]`` (one value per sequence); the others are ``[B, T]``."""


@dataclass
class Batch:
    """Padded tensors of one batch. Per-token fields are ``[batch, seq]``; per-sequence ``[batch]``.

    Can be built by :func:`collate` or directly from tensors (tests inject values that a
    ``Trajectory`` would refuse, e.g. a NaN mu on a sampled token).
    """

    token_ids: Tensor  # [B, T] int64
    attention_mask: Tensor  # [B, T] int64, 1 on real tokens
    loss_mask: Tensor  # [B, T] bool, tokens the loss trains on
    behav_logprobs: Tensor  # [B, T] fp32 nats, mu; NaN off sampled tokens
    advantages: Tensor  # [B, T] fp32, 0 off loss_mask
    consuming_version: int = 0
    """Learner version that consumes the batch (staleness is measured against it)."""
    temperature: float = 1.0
    """Sampling temperature the engine used; the learner applies the same one."""
    sampled_mask: Tensor | None = None  # [B, T] bool, the trajectories' own loss_mask
    versions: Tensor | None = None  # [B, T] int64, -1 off sampled tokens
    staleness: Tensor | None = None  # [B, T] int64, 0 off sampled tokens
    old_logprobs: Tensor | None = None  # [B, T] fp32 nats, NaN where not exact
    exact_mask: Tensor | None = None  # [B, T] bool
    rewards: Tensor | None = None  # [B] fp32
    seq_advantages: Tensor | None = None  # [B] fp32
    recompute_logprobs: Tensor | None = None  # [B, T] fp32 nats, NaN where not taken
    """Log-probs under the weights of ``consuming_version`` taken before the batch's first optimizer
    step (the recompute reference of its second and later mini-batches); NaN when not taken."""
    current_mask: Tensor | None = None  # [B, T] bool
    """Trained tokens sampled by ``consuming_version`` with no exact value from a route: the learner's
    own forward gives their pi_old (:func:`learner_gives_current`); all False by default."""
    group_index: Tensor | None = None  # [B] int64
    """Dense index of each sequence's GRPO group (order of first appearance); each row its own group by default."""
    baselines: Tensor | None = None  # [B] fp32
    """A baseline given by the sequence's sender (:attr:`protocol.Trajectory.baseline`), NaN where none."""
    ref_logprobs: Tensor | None = None  # [B, T] fp32 nats
    """Log-probs of the frozen reference policy (the KL penalties), NaN where not taken."""
    stats: dict[str, float] = field(default_factory=dict)
    """Counts from collation: ``stale_masked_tokens``, ``overlong_masked_seqs``, ``sampled_tokens``..."""

    def __post_init__(self) -> None:
        b, t = self.token_ids.shape
        self.loss_mask = self.loss_mask.bool()
        if self.sampled_mask is None:
            self.sampled_mask = self.loss_mask.clone()
        if self.versions is None:
            self.versions = torch.where(self.sampled_mask, self.consuming_version, NO_VERSION).long()
        if self.staleness is None:
            self.staleness = torch.where(self.sampled_mask, self.consuming_version - self.versions, 0).long()
        if self.old_logprobs is None:
            self.old_logprobs = torch.full((b, t), float("nan"))
        if self.exact_mask is None:
            self.exact_mask = self.loss_mask & torch.isfinite(self.old_logprobs)
        if self.rewards is None:
            self.rewards = torch.zeros(b)
        if self.seq_advantages is None:
            self.seq_advantages = torch.zeros(b)
        if self.recompute_logprobs is None:
            self.recompute_logprobs = torch.full((b, t), float("nan"))
        if self.current_mask is None:
            self.current_mask = torch.zeros((b, t), dtype=torch.bool)
        if self.group_index is None:
            self.group_index = torch.arange(b)
        if self.baselines is None:
            self.baselines = torch.full((b,), float("nan"))
        if self.ref_logprobs is None:
            self.ref_logprobs = torch.full((b, t), float("nan"))
        for name in _ROW_TENSORS:
            v = getattr(self, name)
            want = (b,) if name in _SEQUENCE_TENSORS else (b, t)
            if tuple(v.shape) != want:
                raise ValueError(f"Batch.{name}: shape {tuple(v.shape)} != {want}")

    @property
    def size(self) -> int:
        """Number of sequences (rows)."""
        return int(self.token_ids.shape[0])

    @property
    def n_tokens(self) -> int:
        """Tokens the loss trains on (this batch's share of the token-mean denominator)."""
        return int(self.loss_mask.sum())

    def select(self, rows: Sequence[int] | Tensor) -> Batch:
        """The given rows, with trailing all-padding columns trimmed (at least 2 columns kept)."""
        idx = torch.as_tensor(list(rows) if not isinstance(rows, Tensor) else rows, dtype=torch.long)
        picked = {n: getattr(self, n).index_select(0, idx) for n in _ROW_TENSORS}
        width = int(picked["attention_mask"].sum(-1).max()) if idx.numel() else 2
        width = max(width, 2)
        for n, v in picked.items():
            if v.dim() == 2:
                picked[n] = v[:, :width].contiguous()
        return replace(self, **picked, stats={})

    def with_rewards(self, rewards: Tensor, estimator: str = "grpo") -> Batch:
        """The same batch trained toward other rewards ``[B]``: ``rewards``, ``seq_advantages`` and
        ``advantages`` (on ``loss_mask``) recomputed by :func:`sequence_advantages` over the batch's
        groups and baselines.

        Raises:
            ValueError: ``rewards`` is not ``[B]``, or an unknown estimator."""
        rewards = rewards.float()
        if tuple(rewards.shape) != (self.size,):
            raise ValueError(f"rewards: shape {tuple(rewards.shape)} != ({self.size},)")
        seq_adv = sequence_advantages(rewards, self.group_index.tolist(), estimator, self.baselines)
        return replace(
            self, rewards=rewards, seq_advantages=seq_adv, advantages=torch.where(self.loss_mask, seq_adv[:, None], 0.0)
        )

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with every row tensor on ``device`` (no copy for those already there);
        ``stats`` and the scalars are kept. The learner moves each micro-batch to its engine's device."""
        device = torch.device(device)
        moved = {n: getattr(self, n).to(device) for n in _ROW_TENSORS}
        return replace(self, **moved)

    def shard(self, rank: int, world_size: int) -> Batch:
        """Rows ``rank, rank + world_size, ...`` (data-parallel share; may be empty)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        return self.select(range(rank, self.size, world_size))

    def mini_batches(self, count: int) -> list[Batch]:
        """Split the rows into ``count`` contiguous mini-batches of near-equal size, one optimizer
        step each (row order kept; the first ``size % count`` get one row more; none is empty).
        Example: 10 rows, 3 mini-batches -> rows 0-3, 4-6, 7-9.

        Raises:
            ValueError: ``count`` < 1 or more than the rows."""
        if not 1 <= count <= self.size:
            raise ValueError(f"learner.ppo_mini_batches: {count} mini-batches for a batch of {self.size} sequences")
        if count == 1:
            return [self]
        base, extra = divmod(self.size, count)
        bounds = [0]
        for j in range(count):
            bounds.append(bounds[-1] + base + (j < extra))
        return [self.select(range(lo, hi)) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]

    def micro_batches(self, micro_batch_size: int, count: int | None = None) -> list[Batch]:
        """Split into chunks of ``micro_batch_size`` rows, padded with empty (all-masked) chunks up to
        ``count`` so that every data-parallel rank runs the same number of forward/backward passes."""
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        out = [
            self.select(range(s, min(s + micro_batch_size, self.size))) for s in range(0, self.size, micro_batch_size)
        ]
        need = len(out) if count is None else count
        if need < len(out):
            raise ValueError(f"count={count} < {len(out)} micro-batches needed")
        while len(out) < need:
            out.append(empty_batch(self.consuming_version, self.temperature))
        return out


def first_loss_position(mb: Batch) -> int:
    """The first sequence position any row of ``mb`` trains on (``loss_mask`` column), at least 1.

    The learner's forwards compute vocabulary logits only from there on (every position before it
    is prompt or context in every row, never read by the loss); 1 when nothing is trained on.
    Example: rows with prompts of 5 and 7 tokens, completions after them: 5.
    """
    cols = torch.nonzero(mb.loss_mask.any(0)).flatten()
    return max(1, int(cols[0])) if cols.numel() else 1


def shuffled_rows(size: int, seed: int, version: int, epoch: int) -> list[int]:
    """The row order ``[size]`` of one pass over a rollout batch: a permutation from a torch
    generator seeded with ``seed * 1_000_003 + version * 1_009 + epoch`` (the same on every rank and
    on a resumed run). Example: ``shuffled_rows(4, 0, 0, 0)`` is ``[0, 1, 3, 2]``."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + version * 1_009 + epoch)
    return torch.randperm(size, generator=gen).tolist()


def pass_order(batch: Batch, epoch: int, seed: int, mini_batches: int, shuffle: bool) -> Batch:
    """``batch`` in the row order of pass ``epoch``: the rows in :func:`shuffled_rows` order (seed,
    consuming version, epoch) when ``shuffle`` and the pass has more than one mini-batch
    (``min(mini_batches, batch.size) >= 2``); otherwise ``batch`` itself."""
    if not shuffle or min(mini_batches, batch.size) < 2:
        return batch
    return batch.select(shuffled_rows(batch.size, seed, batch.consuming_version, epoch))


def empty_batch(consuming_version: int = 0, temperature: float = 1.0, pad_token_id: int = 0) -> Batch:
    """One padding row of 2 tokens with nothing to train on (keeps collectives aligned across ranks)."""
    ids = torch.full((1, 2), pad_token_id, dtype=torch.long)
    return Batch(
        token_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.zeros(1, 2, dtype=torch.bool),
        behav_logprobs=torch.full((1, 2), float("nan")), advantages=torch.zeros(1, 2),
        consuming_version=consuming_version, temperature=temperature,
    )  # fmt: skip


def _group_index(group_ids: Sequence[Hashable]) -> Tensor:
    """Dense long index ``[B]`` of each sequence's group, in order of first appearance."""
    codes = {g: i for i, g in enumerate(dict.fromkeys(group_ids))}
    return torch.tensor([codes[g] for g in group_ids], dtype=torch.long)


def sequence_advantages(
    rewards: Tensor, group_ids: Sequence[Hashable], estimator: str = "grpo", baselines: Tensor | None = None
) -> Tensor:
    """Per-sequence advantages ``[B]`` from outcome rewards ``[B]`` grouped by ``group_ids`` (names or indices).

    "grpo": (r - mean_g) / max(std_g, 1e-3), population std (``trainer.algorithm.advantages``); "rloo":
    leave-one-out baseline; "reinforce": the raw reward (gamma = 1, no baseline). ``baselines``
    ``[B]`` (NaN where none): a sequence with a baseline given by its sender (a group closed short
    of its size, :attr:`protocol.Trajectory.baseline`) gets ``r - baseline`` under "grpo" and
    "rloo" (the mean-centred, unscaled form; its group is left out of the others' statistics) and
    the raw reward under "reinforce". Raises ValueError on an unknown estimator.

    Example: rewards ``[1, 0, 0.8]``, groups ``["a", "a", "s"]``, baselines ``[nan, nan, 0.5]``,
    "grpo": ``[1, -1, 0.3]`` (group a: mean 0.5, std 0.5; the last: 0.8 - 0.5).
    """
    if estimator not in ("grpo", "rloo", "reinforce"):
        raise ValueError(f"unknown advantage estimator={estimator!r}; expected grpo, rloo or reinforce")
    if estimator == "reinforce":
        return rewards.float().clone()
    given = torch.zeros(len(group_ids), dtype=torch.bool) if baselines is None else ~torch.isnan(baselines)
    out = torch.zeros(len(group_ids), dtype=torch.float32)
    rest = (~given).nonzero().flatten().tolist()
    if rest:
        gid = _group_index([group_ids[i] for i in rest])
        fn = grpo_advantages if estimator == "grpo" else rloo_advantages
        out[rest] = fn(rewards[rest], gid).float()
    if given.any():
        out[given] = (rewards[given] - baselines[given]).float()
    return out


def _reference_rows(old_logits: object, trajectories: Sequence[Trajectory], width: int) -> Tensor | None:
    """``[B, T]`` fp32: an :class:`OldLogitAnswer`'s ``ref_logprobs`` right-padded (NaN off the
    sampled tokens and in padding); None when the answer brings none."""
    if not isinstance(old_logits, OldLogitAnswer) or old_logits.ref_logprobs is None:
        return None
    out = np.full((len(trajectories), width), np.nan, np.float32)
    for i, (tr, r) in enumerate(zip(trajectories, old_logits.ref_logprobs, strict=True)):
        if len(r) != len(tr.token_ids):
            raise ValueError(
                f"old-logit answer item {i}: ref_logprobs length {len(r)} != trajectory length {len(tr.token_ids)}"
            )
        out[i, : len(r)] = np.where(tr.loss_mask.astype(bool), r, np.nan)
    return torch.from_numpy(out)


def _old_from_answer(answer: OldLogitAnswer, i: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    lp = np.asarray(answer.old_logprobs[i], dtype=np.float32)
    st = np.asarray(answer.status[i])
    if len(lp) != n:
        raise ValueError(f"old-logit answer item {i}: length {len(lp)} != trajectory length {n}")
    return lp, st == TokenStatus.EXACT


def collate(
    trajectories: Sequence[Trajectory],
    consuming_version: int,
    *,
    old_logits: OldLogitAnswer | Sequence[np.ndarray | None] | None = None,
    temperature: float = 1.0,
    pad_token_id: int = 0,
    max_token_staleness: int | None = None,
    overlong_filter: bool = False,
    advantage: str = "grpo",
    current_from_learner: bool = False,
) -> Batch:
    """Build the padded :class:`Batch` that the learner at ``consuming_version`` trains on.

    Args:
        trajectories: sequences of one optimizer batch (whole GRPO groups; advantages are computed
            over all of them before any micro-batch or rank split).
        consuming_version: the learner version that consumes them; staleness = it - versions.
        old_logits: exact pi_old, aligned with ``trajectories``: an :class:`OldLogitAnswer` (exact
            where ``status == EXACT``; its ``ref_logprobs``, when given, become the batch's) or one
            array per trajectory (NaN where missing, ``None`` for none). When None, each
            trajectory's own ``old_logprobs`` (if attached) is used.
        temperature: sampling temperature of the rollouts (> 0).
        pad_token_id: id written into padding slots (they are masked everywhere).
        max_token_staleness: tokens with staleness above it are masked out of the loss (kept as
            context). Example: versions [3,3,3,4,4,5] at V = 6, limit 2 -> first 3 masked, N = 3.
        overlong_filter: mask whole sequences whose engine ``finish_reason`` is "length" or "abort"
            or that are flagged ``truncated`` (decided by the finish reason, never an EOS id).
        advantage: "grpo", "rloo" or "reinforce" (see :func:`sequence_advantages`).
        current_from_learner: mark the trained tokens of ``consuming_version`` that lack an exact
            value as ``current_mask`` (the learner's own forward supplies them,
            :func:`learner_gives_current`).

    Raises:
        ValueError: empty input, a sampled token newer than ``consuming_version``, a misaligned
            old-logit answer, or a non-positive temperature.
    """
    _check_inputs(trajectories, old_logits, temperature)
    ids, attn, sampled, mu, ver, old, exact, truncated = _padded_rows(trajectories, old_logits, pad_token_id)
    stale = np.where(sampled, consuming_version - ver, 0)
    if (stale < 0).any():
        i, j = map(int, np.argwhere(stale < 0)[0])
        raise ValueError(
            f"trajectory {trajectories[i].trajectory_id!r} token {j}: version {int(ver[i, j])} is newer than "
            f"the consuming learner version {consuming_version}"
        )
    train, stale_masked, overlong_seqs = _train_mask(sampled, stale, truncated, max_token_staleness, overlong_filter)
    rewards = torch.tensor([float(tr.reward) for tr in trajectories], dtype=torch.float32)
    group_ids = [tr.group_id for tr in trajectories]
    baselines = torch.tensor([math.nan if tr.baseline is None else tr.baseline for tr in trajectories])
    seq_adv = sequence_advantages(rewards, group_ids, advantage, baselines)
    train_t = torch.from_numpy(train)
    exact_t = torch.from_numpy(exact) & train_t
    current_t = train_t & ~exact_t & torch.from_numpy(stale == 0) if current_from_learner else None
    stats = {
        **_token_stats(sampled, train, stale),
        "stale_masked_tokens": float(stale_masked),
        "overlong_masked_seqs": float(overlong_seqs),
        "exact_tokens": float(exact_t.sum()),
        "current_exact_tokens": float(current_t.sum()) if current_t is not None else 0.0,
        "groups": float(len(set(group_ids))),
        "zero_variance_groups": float(zero_variance_groups(rewards, _group_index(group_ids))),
    }
    return Batch(
        token_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(attn), loss_mask=train_t,
        behav_logprobs=torch.from_numpy(mu), advantages=torch.where(train_t, seq_adv[:, None], 0.0),
        consuming_version=consuming_version, temperature=float(temperature),
        sampled_mask=torch.from_numpy(sampled), versions=torch.from_numpy(ver), staleness=torch.from_numpy(stale),
        old_logprobs=torch.from_numpy(old), exact_mask=exact_t, rewards=rewards, seq_advantages=seq_adv,
        current_mask=current_t, group_index=_group_index(group_ids), baselines=baselines.float(),
        ref_logprobs=_reference_rows(old_logits, trajectories, ids.shape[1]), stats=stats,
    )  # fmt: skip


def learner_gives_current(oldlogit_route: str, optimizer_steps: int) -> bool:
    """Whether the learner itself supplies pi_old of the tokens sampled by the version that consumes
    them, so the old-logit service never scores them (no forward done twice).

    True on a route that scores each batch when it is taken (``snapshot``,
    :attr:`protocol.RouteTraits.per_batch`) with one optimizer step per rollout batch: that step's forward
    runs under the consuming version's weights, so its detached log-probs are those tokens' exact
    pi_old. With several steps the later ones run under moved weights, and the service keeps
    scoring them; the scorer routes attach values on collect, before the consuming version is
    known; route ``none`` uses its proxy for every token by definition.
    """
    return ROUTE_TRAITS[oldlogit_route].per_batch and optimizer_steps == 1


def _padded_rows(
    trajectories: Sequence[Trajectory],
    old_logits: OldLogitAnswer | Sequence[np.ndarray | None] | None,
    pad_token_id: int,
) -> tuple[np.ndarray, ...]:
    """The trajectories right-padded to ``[B, T]``: token ids, attention mask, sampled mask, mu and
    versions (NaN / -1 off sampled tokens), exact pi_old and where it is known (sampled, flagged,
    finite), and the ``[B]`` truncation flags (finish reason or a context cut)."""
    b, t = len(trajectories), max(len(tr.token_ids) for tr in trajectories)
    ids = np.full((b, t), pad_token_id, np.int64)
    attn = np.zeros((b, t), np.int64)
    sampled = np.zeros((b, t), bool)
    mu = np.full((b, t), np.nan, np.float32)
    ver = np.full((b, t), NO_VERSION, np.int64)
    old = np.full((b, t), np.nan, np.float32)
    exact = np.zeros((b, t), bool)
    truncated = np.zeros(b, bool)
    for i, tr in enumerate(trajectories):
        n = len(tr.token_ids)
        ids[i, :n] = tr.token_ids
        attn[i, :n] = 1
        s = tr.loss_mask.astype(bool)
        sampled[i, :n] = s
        mu[i, :n] = np.where(s, tr.behav_logprobs, np.nan)
        ver[i, :n] = np.where(s, tr.versions, NO_VERSION)
        lp, ok = _old_row(old_logits, tr, i)
        ok = ok & s & np.isfinite(lp)
        old[i, :n] = np.where(ok, lp, np.nan)
        exact[i, :n] = ok
        truncated[i] = tr.finish_reason in TRUNCATED_REASONS or tr.truncated
    return ids, attn, sampled, mu, ver, old, exact, truncated


def _check_inputs(
    trajectories: Sequence[Trajectory],
    old_logits: OldLogitAnswer | Sequence[np.ndarray | None] | None,
    temperature: float,
) -> None:
    """:func:`collate`'s argument checks (its ``Raises``, except the per-row ones)."""
    if not trajectories:
        raise ValueError("collate: no trajectories")
    if not temperature > 0:
        raise ValueError(f"temperature: must be > 0, got {temperature}")
    if isinstance(old_logits, OldLogitAnswer) and len(old_logits.old_logprobs) != len(trajectories):
        raise ValueError(
            f"old-logit answer has {len(old_logits.old_logprobs)} items for {len(trajectories)} trajectories"
        )
    if old_logits is not None and not isinstance(old_logits, OldLogitAnswer) and len(old_logits) != len(trajectories):
        raise ValueError(f"old_logits has {len(old_logits)} entries for {len(trajectories)} trajectories")


def _old_row(
    old_logits: OldLogitAnswer | Sequence[np.ndarray | None] | None, tr: Trajectory, i: int
) -> tuple[np.ndarray, np.ndarray]:
    """Row ``i``'s exact pi_old ``[n]`` (NaN where unknown) and where it is known ``[n]`` bool: from
    the answer, the aligned array, or the trajectory's own ``old_logprobs`` when ``old_logits`` is None.

    Raises:
        ValueError: an aligned array of another length than the trajectory.
    """
    n = len(tr.token_ids)
    if isinstance(old_logits, OldLogitAnswer):
        return _old_from_answer(old_logits, i, n)
    if old_logits is not None and old_logits[i] is not None:
        lp = np.asarray(old_logits[i], dtype=np.float32)
        if len(lp) != n:
            raise ValueError(f"old_logits[{i}]: length {len(lp)} != trajectory length {n}")
        return lp, np.isfinite(lp)
    if old_logits is None and tr.old_logprobs is not None:
        return tr.old_logprobs, np.isfinite(tr.old_logprobs)
    return np.full(n, np.nan, np.float32), np.zeros(n, bool)


def _train_mask(
    sampled: np.ndarray,
    stale: np.ndarray,
    truncated: np.ndarray,
    max_token_staleness: int | None,
    overlong_filter: bool,
) -> tuple[np.ndarray, int, int]:
    """The ``[B, T]`` loss mask: sampled tokens past position 0 (nothing before it to score it with),
    less those staler than ``max_token_staleness`` and, with ``overlong_filter``, every token of a
    ``truncated`` ``[B]`` row; with the counts of stale-masked tokens and of overlong rows that had
    any token left to train on."""
    train = sampled.copy()
    train[:, 0] = False
    stale_masked = 0
    if max_token_staleness is not None:
        over = train & (stale > max_token_staleness)
        stale_masked = int(over.sum())
        train &= ~over
    overlong_seqs = 0
    if overlong_filter:
        overlong_seqs = int((truncated & train.any(-1)).sum())
        train &= ~truncated[:, None]
    return train, stale_masked, overlong_seqs


def _token_stats(sampled: np.ndarray, train: np.ndarray, stale: np.ndarray) -> dict[str, float]:
    """Counts of a batch's ``[B, T]`` sampled / trained tokens and the staleness of the sampled ones
    (mean and max; 0 when nothing was sampled); reply length = sampled tokens per row."""
    per_row = sampled.sum(-1)
    return {
        "sequences": float(sampled.shape[0]),
        "sampled_tokens": float(sampled.sum()),
        "response_tokens_mean": float(per_row.mean()),
        "response_tokens_max": float(per_row.max()),
        "train_tokens": float(train.sum()),
        "staleness_mean": float(stale[sampled].mean()) if sampled.any() else 0.0,
        "staleness_max": float(stale[sampled].max()) if sampled.any() else 0.0,
    }


def staleness_histogram(batch: Batch) -> dict[int, int]:
    """``{staleness: sampled-token count}`` of a batch (all sampled tokens, masked or not)."""
    vals, counts = torch.unique(batch.staleness[batch.sampled_mask], return_counts=True)
    return {int(v): int(c) for v, c in zip(vals.tolist(), counts.tolist(), strict=True)}


__all__ = ["Batch", "collate", "empty_batch", "sequence_advantages", "staleness_histogram"]
