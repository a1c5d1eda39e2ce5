"""The frozen reference policy of the KL penalty: version 0, scored in the learner's own numerics.

Full-weight training keeps one frozen copy of the initial model (the model folder) in the learner's
dtype, on the engine's device: one model's memory, and one no-grad forward per micro-batch. With
LoRA the reference is the base model with the adapter switched off (peft's ``disable_adapter``): the
engine's own module runs it, nothing is copied. :func:`with_kl_reward_penalty` lowers a batch's
rewards by the KL penalty of the reward.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

from modelkit.scoring import scoring_mode, sequence_logprobs
from trainer.algorithm.batch import Batch
from trainer.algorithm.losses import kl_in_reward


def frozen_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of ``model`` in eval mode with no gradient, its parameters cast to ``dtype`` and its
    buffers left as they are (fp32), as DeepSpeed casts the trained model: scored by it, a token gets
    the learner's own numerics."""
    frozen = copy.deepcopy(model).eval().requires_grad_(False)
    for p in frozen.parameters():
        p.data = p.data.to(dtype)
    return frozen


class ReferencePolicy:
    """Log-probs of the frozen reference policy (version 0).

    Args:
        model: the HF model (or the peft-wrapped one with LoRA) before any training step.
        dtype: the learner's compute dtype; parameters are cast to it, buffers stay fp32 (as
            DeepSpeed casts the trained model), so the reference is scored as the learner scores.
        lora: the model is peft-wrapped; the reference is its base with the adapter disabled.

    Attributes:
        bytes: host or device memory held by the reference (0 with LoRA).
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, lora: bool) -> None:
        self.lora = lora
        self._copy: torch.nn.Module | None = None
        self.bytes = 0
        if not lora:
            self._copy = frozen_copy(model, dtype)
            self.bytes = sum(p.numel() * p.element_size() for p in self._copy.parameters())

    def to(self, device: torch.device | str) -> ReferencePolicy:
        """Move the frozen copy to ``device`` (no-op with LoRA); returns self."""
        if self._copy is not None:
            self._copy.to(device)
        return self

    def logprobs(
        self,
        engine_module: Any,
        token_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        temperature: float,
        first: int,
        chunk_bytes: int,
        packed: bool = False,
    ) -> torch.Tensor:
        """``[batch, seq]`` fp32 log-probs (nats) of the reference, no gradient, eval mode, at the
        sampling temperature, vocabulary logits from position ``first`` on, rows packed with
        ``packed`` (:func:`modelkit.scoring.sequence_logprobs`). ``engine_module`` is the trained module (used
        with LoRA, its adapter disabled for the forward and its train/eval mode restored)."""
        model = self._copy if self._copy is not None else engine_module
        switch = model.disable_adapter() if self.lora else contextlib.nullcontext()
        with scoring_mode(model), switch:
            return sequence_logprobs(model, token_ids, attention_mask, temperature, first, chunk_bytes, packed)


def require_reference_logprobs(batch: Batch) -> None:
    """Check that every loss token of ``batch`` brings a finite reference log-prob (the batch's
    ``ref_logprobs`` came from the old-logit service instead of the learner's own reference).

    Raises:
        ValueError: some loss tokens lack one; the message counts them and names the version.
    """
    missing = int((batch.loss_mask & ~torch.isfinite(batch.ref_logprobs)).sum())
    if missing:
        raise ValueError(
            f"ref_logprobs: {missing} loss tokens of the batch at version {batch.consuming_version} came "
            "without the reference's log-probs (oldlogit.score_reference: the service did not hold version 0)"
        )


def with_kl_reward_penalty(batch: Batch, coef: float, advantage: str) -> tuple[Batch, dict[str, float]]:
    """``batch`` with each reward lowered by ``coef *`` :func:`kl_in_reward` and its advantages
    recomputed with the ``advantage`` estimator (:meth:`trainer.algorithm.batch.Batch.with_rewards`),
    and the metrics ``kl_reward`` (mean per-sequence estimate, nats) and ``kl_reward_penalty``
    (mean amount taken off a reward); ``batch`` itself and no metrics when ``coef`` is 0.

    Example: ``coef`` 0.1, one sequence with reward 1.0 and estimate 0.5 nats: reward 0.95,
    ``kl_reward`` 0.5, ``kl_reward_penalty`` 0.05.
    """
    if coef <= 0:
        return batch, {}
    kl = kl_in_reward(batch.behav_logprobs, batch.ref_logprobs, batch.loss_mask)
    out = batch.with_rewards(batch.rewards - coef * kl, advantage)
    return out, {"kl_reward": float(kl.mean()), "kl_reward_penalty": float(coef * kl.mean())}
