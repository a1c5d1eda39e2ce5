"""What one learner rank is told: :class:`LearnerOptions` (the ``[learner]`` table a user sets, shared
with the job config) and :class:`LearnerSettings` (those plus what the job derives: model folder,
loss, EWMA, temperature, seed, rendezvous); the process group's start-up.

Imports pydantic only at module level (the job config imports it without torch or DeepSpeed).
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.algorithm.loss_config import EwmaConfig, LossConfig, loss_config
from trainer.learner.lora_config import LoraSettings, lora_zero_refusal
from trainer.learner.schedule import lr_multiplier

LOGPROB_CHUNK_BYTES = 160 * 2**20
"""Default of :attr:`LearnerOptions.logprob_chunk_bytes`, 160 MiB: 53 positions of a micro-batch of
16 over SmolLM2's 49,152 tokens, so a demo micro-batch (replies of up to 48 tokens, prompts within 5
tokens of each other) is one chunk, kept for backward with no recompute. Above
``modelkit.scoring.DEFAULT_CHUNK_BYTES`` (the no-grad default): under autograd every chunk but the
last costs a recomputed output projection in backward."""


class LearnerOptions(BaseModel):
    """The learner's user-facing options, declared once: the job config's ``[learner]`` table and
    :class:`LearnerSettings` both inherit them, so one value has one name and one definition."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    zero_stage: int = Field(0, ge=0, le=3)
    """DeepSpeed ZeRO stage; 0-3 all work on CPU with gloo (with LoRA: 0-2, see ``trainer.learner.lora_config``)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype; bf16 keeps fp32 master weights in DeepSpeed's optimizer wrapper."""
    lr: float = Field(1e-5, gt=0.0)
    """AdamW peak learning rate; ``lr_schedule`` and ``lr_warmup_steps`` shape it over optimizer steps."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after the warm-up, over optimizer steps (:func:`trainer.learner.schedule.lr_multiplier`):
    constant, linear, or cosine (Loshchilov & Hutter 2017, SGDR) from ``lr`` down to
    ``lr * lr_min_ratio`` at ``lr_decay_steps``, then held there."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warm-up: step s (0-based) of the warm-up uses ``lr * (s + 1) /
    (lr_warmup_steps + 1)`` (Goyal et al. 2017), so no step runs at a learning rate of 0."""
    lr_min_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Floor of the decay as a fraction of ``lr`` (``lr_schedule`` linear or cosine)."""
    lr_decay_steps: int | None = Field(None, ge=1)
    """Optimizer step at which the decay reaches its floor, warm-up included; None: the job's last
    one (``controller.total_steps * ppo_epochs * ppo_mini_batches``). Only applied optimizer steps
    count (a step the non-finite guard refused does not advance the schedule); the count is saved
    in checkpoints, so a resumed run continues at the same rate."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW decoupled weight decay."""
    grad_clip: float = Field(1.0, ge=0.0)
    """Global gradient-norm clip (DeepSpeed ``gradient_clipping``); 0 disables it."""
    rollback_copy: Literal["auto", "on", "off"] = "auto"
    """Keep a copy of the weights and optimizer state before each optimizer step, to undo a step
    that leaves a non-finite weight or state (cost: 3x the trained parameters' bytes with AdamW,
    1.6 GB for SmolLM2-135M, and ~0.2 s per step on a 2-core CPU). ``auto``: only without gradient
    clipping. With finite gradients (the guard refuses a step with any other) clipped to a finite
    norm, a finite learning rate and weight decay (the settings refuse others), AdamW's moments and
    update stay finite, so the copy would never be used. Either way the weights and state are
    checked after every step; a non-finite one without a copy fails the learner, naming this
    setting."""
    micro_batch_size: int = Field(8, ge=1)
    """Sequences per forward/backward on one rank; the loss does not depend on it (global token count)."""
    ppo_mini_batches: int = Field(1, ge=1, le=1024)
    """Optimizer steps per pass over one rollout batch (verl's batch / ``ppo_mini_batch_size``,
    AReaL's ``ppo_n_minibatches``): the batch's rows split into this many contiguous mini-batches
    (``Batch.mini_batches``), each a token-mean over its own tokens, micro-batched inside. One
    rollout batch is still one policy version: it is published once, after all its optimizer steps."""
    ppo_epochs: int = Field(1, ge=1, le=64)
    """Passes over one rollout batch (verl's ``ppo_epochs``, TRL's ``num_iterations``); the learner
    takes ``ppo_epochs * ppo_mini_batches`` optimizer steps per version. From the second step on,
    the recompute reference is the consuming version's log-probs taken before the first step, exact
    old logits stay the behaviour version's, and the EWMA has folded in every earlier step."""
    logprob_chunk_bytes: int = Field(LOGPROB_CHUNK_BYTES, ge=0)
    """Largest fp32 ``[micro-batch, chunk, vocab]`` logits tensor of every learner log-prob, bytes:
    the output projection and the log-softmax run over chunks of positions, and backward recomputes
    every chunk but the last (:mod:`modelkit.scoring`); 0 keeps whole-sequence logits for backward."""
    pack_sequences: bool = False
    """Pack each micro-batch's right-padded rows, first-fit decreasing, into as few rows of the
    padded width as hold them, before every learner forward (training, EWMA, reference, recompute):
    no compute on padding, the output projection only at the wanted positions, and HF's
    block-diagonal causal mask from the restarted position ids (:mod:`modelkit.scoring`). The job's
    old-logit service packs its forwards too. Log-probs and gradients equal the padded path's up to
    rounding (~1e-6 in fp32); a row packed beside other rows is no longer bit-identical between the
    service and the learner, so the first optimizer step's ratio on exact tokens is 1 to that
    rounding rather than exactly."""
    shuffle_mini_batches: bool = True
    """Split each pass over a rollout batch into mini-batches in a seeded random row order, drawn
    anew for every epoch from (``seed``, consuming version, epoch), identical on every rank; False
    keeps the batch's own order (the buffer's, oldest first) in every epoch. With one mini-batch the
    order changes nothing and none is drawn."""
    gradient_checkpointing: bool = False
    """Keep only each decoder layer's input for backward and recompute the layer there (HF
    ``gradient_checkpointing_enable``, non-reentrant): the activations of a micro-batch fall from
    every layer's intermediates to one ``[micro-batch, seq, hidden]`` tensor per layer, for about
    one more forward's time. Gradients equal the stored-activation path's (same kernels, same order)."""
    overlong_filter: bool = False
    """Mask whole sequences truncated by the length budget (engine finish reason ``length``/``abort``
    or a multi-turn context cut) out of the loss, DAPO's overlong filtering."""


class LearnerSettings(LearnerOptions):
    """Everything one learner rank needs: the :class:`LearnerOptions` plus what the job derives."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: str
    """HF model folder (``modelkit.modelhub``); loaded in fp32 on CPU, cast by DeepSpeed for bf16."""
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0.0)
    fused_adam: bool = True
    """Use torch's own fused AdamW kernel (``torch.optim.AdamW(fused=True)``, about 2x faster on CPU
    than the default loop; no JIT build). DeepSpeed's FusedAdam/CPUAdam are never used."""
    loss: LossConfig = Field(default_factory=lambda: loss_config("ppo_ewma"))
    """Correction method (``trainer.algorithm.loss_config``); proxy "ewma" keeps an EWMA copy of the weights."""
    ewma: EwmaConfig = Field(default_factory=EwmaConfig)
    """PPO-EWMA decay and reset threshold (used when ``loss.proxy == "ewma"``)."""
    temperature: float = Field(1.0, gt=0.0)
    """The rollouts' sampling temperature; every learner log-prob uses it."""
    max_token_staleness: int | None = Field(None, ge=0)
    """Tokens staler than this are masked out of the loss, kept as context."""
    current_from_learner: bool = False
    """Trained tokens of the consuming version without an exact value take pi_old from this learner's
    own forward (exact: one optimizer step per batch runs under that version's weights); the job sets
    it where the snapshot route leaves those tokens unscored
    (:func:`trainer.algorithm.batch.learner_gives_current`)."""
    reference_in_batch: bool = False
    """The KL penalties' reference log-probs arrive with each batch (scored by the old-logit service,
    ``oldlogit.score_reference``): this learner holds no frozen copy and refuses a batch without them."""
    seed: int = 0
    """Seed of the learner's torch generators."""
    torch_threads: int = Field(1, ge=1)
    """Torch intra-op threads of this rank during :meth:`trainer.learner.core.LearnerCore.train_step`
    (the job's ``learner.threads``, :func:`modelkit.cores.plan_threads`); the count is restored after."""
    master_addr: str = "127.0.0.1"
    """Rendezvous address of rank 0 (``MASTER_ADDR``)."""
    master_port: int = Field(29500, ge=1, le=65535)
    """Rendezvous port (``MASTER_PORT``); :class:`trainer.learner.group.LearnerGroup` picks a free one."""
    dist_backend: str | None = None
    """torch.distributed backend; None: gloo on CPU, the accelerator's own otherwise."""
    lora: LoraSettings = Field(default_factory=LoraSettings)
    """Train a LoRA adapter on the frozen base instead of every weight (``trainer.learner.lora_config``)."""

    def lr_at(self, optimizer_steps: int) -> float:
        """The learning rate of the optimizer step after ``optimizer_steps`` applied ones: ``lr``
        times :func:`trainer.learner.schedule.lr_multiplier` of the schedule settings."""
        f = lr_multiplier(
            optimizer_steps, self.lr_schedule, self.lr_warmup_steps, self.lr_decay_steps, self.lr_min_ratio
        )
        return self.lr * f

    @property
    def keeps_rollback_copy(self) -> bool:
        """Whether the optimizer's rollback copy is kept (:attr:`rollback_copy`)."""
        return self.rollback_copy == "on" or (self.rollback_copy == "auto" and self.grad_clip == 0)

    @property
    def checks_grads_by_norm(self) -> bool:
        """Whether the learner computes the gradient norm itself (ZeRO stage 0 in fp32, where
        DeepSpeed keeps none) and so checks the gradients through it instead of a hook per tensor."""
        return self.zero_stage == 0 and self.dtype == "float32"

    def deepspeed_config(self) -> dict[str, Any]:
        """The DeepSpeed engine's configuration: one micro-batch of ``micro_batch_size`` rows per
        engine step (the learner accumulates over micro-batches itself), ``grad_clip``, ZeRO
        ``zero_stage`` with the torch optimizer the learner builds, bf16 when ``dtype`` says so, and
        DeepSpeed's own step printing and timers off."""
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.grad_clip,
            "zero_optimization": {"stage": self.zero_stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        if self.dtype == "bfloat16":
            cfg["bf16"] = {"enabled": True}
        return cfg

    @model_validator(mode="after")
    def _check(self) -> LearnerSettings:
        if self.current_from_learner and self.ppo_epochs * self.ppo_mini_batches != 1:
            raise ValueError(
                f"current_from_learner: needs one optimizer step per batch, got ppo_epochs * ppo_mini_batches = "
                f"{self.ppo_epochs * self.ppo_mini_batches}"
            )
        if self.lr_schedule != "constant" and self.lr_decay_steps is None:
            raise ValueError(
                f"lr_decay_steps: None with lr_schedule = {self.lr_schedule!r}: the decay needs its length"
            )
        if self.lora.enabled and (msg := lora_zero_refusal(self.zero_stage)):
            raise ValueError(msg)
        return self


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(settings: LearnerSettings, rank: int, world_size: int) -> None:
    """Join (or check) the torch.distributed group of ``world_size`` ranks as ``rank``.

    Raises:
        RuntimeError: a process group already exists with another rank or size.
    """
    import logging

    import deepspeed
    import torch.distributed as dist

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its INFO lines (kernel fallbacks) are noise here

    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(
                f"process group already initialized as rank {dist.get_rank()}/{dist.get_world_size()}, wanted {rank}/{world_size}"
            )
        return
    os.environ.update(
        MASTER_ADDR=settings.master_addr, MASTER_PORT=str(settings.master_port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=os.environ.get("LOCAL_RANK", "0") if world_size == 1 else str(rank),
    )  # fmt: skip
    backend = settings.dist_backend
    if backend is None:
        from deepspeed.accelerator import get_accelerator

        backend = "gloo" if get_accelerator().device_name() == "cpu" else get_accelerator().communication_backend_name()
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints "... built successfully" here
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
