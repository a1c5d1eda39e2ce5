"""The modules one learner rank builds before its DeepSpeed engine (the trainable policy, the KL
penalty's frozen reference, the EWMA forwards' scorer copy) and the EWMA forward itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from modelkit.scoring import enable_gradient_checkpointing, scoring_mode, sequence_logprobs
from trainer.algorithm.batch import Batch
from trainer.algorithm.ewma import EwmaProximal
from trainer.learner.reference import ReferencePolicy, frozen_copy
from trainer.learner.settings import LearnerSettings


@dataclass
class LearnerModels:
    """What :func:`load_learner_models` builds.

    Attributes:
        policy: the trainable model in train mode, fp32 (DeepSpeed casts it for bf16), KV cache off,
            LoRA-wrapped when ``lora.enabled`` and with gradient checkpointing when asked.
        pad_token_id: the model's pad token (0 when it names none).
        reference: the KL penalties' frozen version 0, or None when ``settings.loss.kl_penalty`` is
            False or the reference's log-probs come with each batch (``reference_in_batch``).
        ewma_scorer: a frozen copy in the learner's dtype for the EWMA forwards when the proxy is
            "ewma", the weights are trained whole and ZeRO-3 partitions them; None otherwise: the
            EWMA weights (or, with LoRA, the EWMA adapter) are swapped into the engine's own module
            for the forward, nothing is copied.
    """

    policy: torch.nn.Module
    pad_token_id: int
    reference: ReferencePolicy | None
    ewma_scorer: torch.nn.Module | None


def load_learner_models(settings: LearnerSettings, dtype: torch.dtype) -> LearnerModels:
    """Load ``settings.model_path`` and build :class:`LearnerModels` from it, on the CPU; ``dtype``
    is the learner's compute dtype (the reference's and the scorer's parameters are cast to it,
    buffers stay fp32 as DeepSpeed leaves them). The reference and the scorer are copies taken
    before any step, so they hold version 0; with LoRA the adapter's B = 0 makes version 0 the base
    model and the reference is that base with the adapter switched off."""
    from modelkit.modelhub import load_causal_lm

    model = load_causal_lm(settings.model_path, "float32")
    model.config.use_cache = False
    pad = model.config.pad_token_id
    lora = settings.lora
    if lora.enabled:
        from modelkit.lora import wrap_lora

        model = wrap_lora(model, lora.spec(), dropout=lora.dropout)
    own = settings.loss.kl_penalty and not settings.reference_in_batch
    reference = ReferencePolicy(model, dtype, lora.enabled) if own else None
    # only ZeRO-3 partitions the trained parameters; below it the EWMA weights are swapped into them
    partitioned = settings.zero_stage == 3
    scorer = frozen_copy(model, dtype) if settings.loss.proxy == "ewma" and partitioned and not lora.enabled else None
    if settings.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    model.train()
    return LearnerModels(model, int(pad if pad is not None else 0), reference, scorer)


def ewma_logprobs(
    ewma: EwmaProximal, model: torch.nn.Module, mb: Batch, first: int, scoring: dict[str, Any]
) -> torch.Tensor:
    """``[b, T]`` log-probs of micro-batch ``mb`` under the EWMA weights (no grad, eval mode, the
    learner's numerics and temperature), vocabulary logits from position ``first`` on, computed as
    ``scoring`` says (:func:`modelkit.scoring.sequence_logprobs`). ``model`` is the scorer copy under
    ZeRO-3 (whose parameters are partitioned); otherwise it is the engine's own module, into which
    the EWMA weights (with LoRA the EWMA adapter; the frozen base is shared) are swapped for the
    forward, and the trained ones are put back bit for bit."""
    with scoring_mode(model), ewma.swapped_into(model):
        return sequence_logprobs(model, mb.token_ids, mb.attention_mask, mb.temperature, first, **scoring)
