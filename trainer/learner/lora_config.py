"""The ``[lora]`` section: train a LoRA adapter on a frozen base model (torch-free, loads instantly).

With LoRA on (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"), a policy
version is an adapter: the learner trains only the ``A`` and ``B`` factors of the targeted linear
modules (peft), publishes only them (``protocol.AdapterSpec``), the old-logit service keeps one
base plus one adapter per held version, and the PPO-EWMA proxy averages only the adapter.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from protocol import AdapterSpec

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of a Llama-style decoder (SmolLM2's names)."""

LORA_ZERO_STAGES = (0, 1, 2)
"""DeepSpeed ZeRO stages that train a LoRA adapter on CPU (gloo), tested fp32 on 0, 1, 2 and bf16
on 0, 1, 2. Stage 3 partitions every parameter, the adapter too: its optimizer step runs, but the
adapter read for publication and the in-place EWMA adapter swap see empty partitions, so it is
refused (``lora_zero_refusal``)."""


class LoraSettings(BaseModel):
    """LoRA fine-tuning of the learner (off by default: full-weight training)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    enabled: bool = False
    """Train a LoRA adapter instead of every weight. Needs ``learner.zero_stage`` in
    :data:`LORA_ZERO_STAGES` (0, 1 or 2; ZeRO-3 is refused) and no ``rollout.inject_mismatch_std``."""
    rank: int = Field(8, ge=1, le=4096)
    """LoRA rank r: ``A`` is ``[r, in_features]``, ``B`` is ``[out_features, r]``."""
    alpha: float = Field(16.0, gt=0.0)
    """LoRA alpha: the adapter's update is ``(alpha / rank) * B @ A`` (peft's scaling, no rsLoRA)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input during training forwards only. Old-logit scoring, the EWMA
    forward, publication and every consumer run without it (eval mode), so exact old logits stay
    exact; with dropout > 0 the training forward is a noisy estimate of the policy, and the ratio
    of the current policy to its own exact old logits is not exactly 1 at staleness 0. Keep 0."""
    target_modules: tuple[str, ...] = Field(DEFAULT_TARGET_MODULES, min_length=1)
    """Module names (last name component) that get an adapter; default: attention and MLP projections."""

    @field_validator("target_modules")
    @classmethod
    def _names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            if not name.isidentifier():
                raise ValueError(f"{name!r} is not a module name (letters, digits, underscores)")
        if len(set(v)) != len(v):
            raise ValueError(f"duplicate names in {list(v)}")
        return v

    def spec(self) -> AdapterSpec:
        """The :class:`protocol.AdapterSpec` of the adapters this learner publishes."""
        return AdapterSpec(rank=self.rank, alpha=self.alpha, target_modules=list(self.target_modules))


def lora_zero_refusal(stage: int) -> str | None:
    """The one-line config error for ZeRO stage ``stage`` with LoRA on, or None when supported."""
    if stage in LORA_ZERO_STAGES:
        return None
    return f"learner.zero_stage: {stage} is not supported with lora.enabled (supported: {', '.join(map(str, LORA_ZERO_STAGES))})"
