"""The TRL side of the vintage-vs-TRL benchmark (:mod:`benchmarks.bench_vs_trl`): ``GRPOTrainer``'s
config mapped from vintage's, and the child process that trains it until the budget.

    python -m benchmarks.trl_side SPEC_JSON   # started by bench_vs_trl.run_trl
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.vs_trl_shared import EnvReward, load_policy, prompt_rows, side_record

_AGGREGATION_TO_TRL = {"token_mean": "dapo", "seq_mean_token_mean": "grpo"}
"""vintage ``loss.aggregation`` -> TRL ``loss_type`` with the same denominator: ``dapo`` divides by the
trained tokens of the whole optimizer batch, ``grpo`` averages per-sequence token means."""


def _trl_schedule(cfg) -> dict[str, Any]:
    """transformers' scheduler settings for ``learner.lr_schedule``: ``constant`` (or
    ``constant_with_warmup``), ``linear``, ``cosine_with_min_lr`` with ``min_lr_rate``; a decaying
    schedule also sets ``max_steps`` to the decay length (transformers decays over ``max_steps``).
    transformers' warm-up starts at 0 (``lr * s / W``), vintage's at ``lr / (W + 1)``.

    Raises:
        ValueError: a linear decay with ``lr_min_ratio > 0`` (transformers' linear decays to 0)."""
    lr, c = cfg.learner, cfg.controller
    out: dict[str, Any] = {"warmup_steps": lr.lr_warmup_steps}
    if lr.lr_schedule == "constant":
        out["lr_scheduler_type"] = "constant_with_warmup" if lr.lr_warmup_steps else "constant"
        return out
    if lr.lr_schedule == "linear" and lr.lr_min_ratio > 0:
        raise ValueError(f"learner.lr_min_ratio: {lr.lr_min_ratio} with a linear decay has no transformers equivalent")
    out["max_steps"] = lr.lr_decay_steps or c.total_steps * lr.ppo_epochs * lr.ppo_mini_batches
    if lr.lr_schedule == "linear":
        out["lr_scheduler_type"] = "linear"
    else:
        out["lr_scheduler_type"] = "cosine_with_min_lr"
        out["lr_scheduler_kwargs"] = {"min_lr_rate": lr.lr_min_ratio}
    return out


def trl_config_kwargs(cfg, output_dir: str, *, cpu: bool = True, max_steps: int = 10**6) -> dict[str, Any]:
    """``trl.GRPOConfig`` keyword arguments that reproduce the vintage job config ``cfg`` (a
    :class:`trainer.driver.config.schema.JobConfig`).

    Per optimizer step both train ``controller.batch_groups`` prompts x ``sampling.n`` completions,
    in forward/backward chunks of ``learner.micro_batch_size`` (TRL: per-device batch = micro batch,
    gradient accumulation = batch / micro batch, one generation per optimizer step). AdamW betas and
    eps are vintage's learner defaults (:class:`trainer.learner.LearnerSettings`); the learning-rate
    schedule is transformers' equivalent of ``learner.lr_schedule`` (:func:`_trl_schedule`).
    ``max_steps`` is a ceiling: the wall-clock budget stops the run. Dynamic sampling
    (``controller.dynamic_sampling``) has no GRPOTrainer equivalent: TRL trains every group.

    Raises:
        ValueError: a setting has no GRPOTrainer equivalent (the message names the field and value):
            the batch is not a whole number of micro-batches, an advantage other than ``grpo``, an
            aggregation other than ``token_mean``/``seq_mean_token_mean``, a sequence-level
            (``gspo``) policy loss, top-p/top-k truncation, or a linear decay with a floor.
    """
    from trainer.learner import LearnerSettings

    s, lr, loss, c = cfg.rollout.sampling, cfg.learner, cfg.loss, cfg.controller
    batch = c.batch_groups * s.n
    if batch % lr.micro_batch_size:
        raise ValueError(
            f"learner.micro_batch_size: {lr.micro_batch_size} does not divide the batch of {batch} completions"
        )
    if loss.advantage != "grpo":
        raise ValueError(f"loss.advantage: {loss.advantage!r} has no GRPOTrainer equivalent (only 'grpo')")
    if loss.aggregation not in _AGGREGATION_TO_TRL:
        raise ValueError(f"loss.aggregation: {loss.aggregation!r} has no GRPOTrainer loss_type equivalent")
    if loss.policy_loss != "ppo_clip":
        raise ValueError(f"loss.policy_loss: {loss.policy_loss!r} is not compared with TRL (token clip only)")
    schedule = _trl_schedule(cfg)
    if schedule.get("max_steps") is not None:
        max_steps = min(max_steps, schedule.pop("max_steps"))
    defaults = LearnerSettings.model_fields
    beta1, beta2 = defaults["betas"].default
    fused = defaults["fused_adam"].default
    return {
        "output_dir": output_dir,
        "per_device_train_batch_size": lr.micro_batch_size,
        "gradient_accumulation_steps": batch // lr.micro_batch_size,
        "num_generations": s.n,
        "max_completion_length": s.max_tokens,
        "temperature": s.temperature,
        "top_p": 1.0,
        "top_k": 0,  # off, like vintage (its sampling refuses truncated supports)
        "learning_rate": lr.lr,
        **schedule,
        "optim": "adamw_torch_fused" if fused else "adamw_torch",
        "adam_beta1": beta1,
        "adam_beta2": beta2,
        "adam_epsilon": defaults["adam_eps"].default,
        "weight_decay": lr.weight_decay,
        "max_grad_norm": lr.grad_clip,
        "bf16": lr.dtype == "bfloat16",
        "fp16": False,
        "beta": loss.kl_coef,
        "num_iterations": 1,
        "epsilon": loss.eps_low,
        "epsilon_high": loss.eps_high,
        "loss_type": _AGGREGATION_TO_TRL[loss.aggregation],
        "scale_rewards": "group",
        "mask_truncated_completions": lr.overlong_filter,
        "gradient_checkpointing": lr.gradient_checkpointing,
        "use_vllm": False,
        "shuffle_dataset": False,  # vintage admits training seeds in order 0, 1, 2, ...
        "seed": c.seed,
        "max_steps": max_steps,
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "remove_unused_columns": False,
        "use_cpu": cpu,
    }


def trl_child(spec_path: Path) -> None:
    """The TRL side (run in its own process by :func:`run_trl`): train until the budget, save the
    final model to ``<work>/final`` and the side record to ``<work>/side.json``."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainer.driver.cluster.environment import defaults_env
    from trainer.driver.config.schema import load_config

    spec = json.loads(Path(spec_path).read_text())
    defaults_env()
    t0 = time.perf_counter()  # the budget starts here, after the imports (as vintage's run_job)
    launch = spec["launch"]
    work = Path(spec["work"])
    cfg = load_config(spec["config"], spec["overrides"])
    model_path = Path(spec["model_path"])
    rows = prompt_rows(cfg.env.path, cfg.env.kwargs, list(range(cfg.env.train_seeds)))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = load_policy(model_path)
    args = GRPOConfig(**trl_config_kwargs(cfg, str(work / "trainer"), cpu=not torch.cuda.is_available()))
    times: dict[str, float] = {"generate": 0.0, "generate_and_score": 0.0}
    step_end: list[float] = []
    logged: list[dict[str, Any]] = []
    budget = float(spec["budget_s"])
    clock: dict[str, float] = {}

    class Budget(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock["begin"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            step_end.append(time.time() - launch)
            clock["end"] = time.perf_counter()
            if clock["end"] - t0 >= budget:
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kw):
            if logs is not None:
                logged.append(dict(logs))

    class Timed(GRPOTrainer):
        def _generate(self, prompts):
            t = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                times["generate"] += time.perf_counter() - t

        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                times["generate_and_score"] += time.perf_counter() - t

    trainer = Timed(
        model=model,
        reward_funcs=[EnvReward(cfg.env.path, cfg.env.kwargs)],
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Budget()],
    )
    trainer.train()
    steps = int(trainer.state.global_step)
    batch = cfg.controller.batch_groups * cfg.rollout.sampling.n
    rec = side_record(
        steps=steps,
        samples=steps * batch,
        loop_s=clock.get("end", t0) - clock.get("begin", t0),
        step_end_s=step_end,
        tokens=round(sum(r["completions/mean_length"] for r in logged if "completions/mean_length" in r) * batch),
    )
    rec.update(
        generated=steps * batch,
        generate_s=times["generate"],
        generate_and_score_s=times["generate_and_score"],
        train_reward=[float(r["reward"]) for r in logged if "reward" in r],
        threads=torch.get_num_threads(),
        config={k: v for k, v in trainer.args.to_dict().items() if k in trl_config_kwargs(cfg, "")},
        process_s=time.time() - launch,
    )
    trainer.model.save_pretrained(work / "final", safe_serialization=True)
    (work / "side.json").write_text(json.dumps(rec, indent=1, default=str))


if __name__ == "__main__":
    trl_child(Path(sys.argv[1]))
