"""Cores to whoever needs them: the learner's seconds per step alone vs inside the asynchronous loop,
one thread each vs the thread plan of :mod:`modelkit.cores`, side by side in one run.

    python -m benchmarks.bench_cores [--model tiny|smollm2] [--steps 8] [--out runs/bench/cores.json]

Every run is the real pipeline (:func:`trainer.driver.loop.job.run_job` on ``deploy/configs/demo.toml``:
vLLM rollout worker, DeepSpeed learner, snapshot old-logit service, the same batches and sampling):

- ``alone``: ``controller.max_staleness = 0``. The synchronous loop generates and scores a batch,
  then trains on it while nothing else runs: the learner's step on the machine alone.
- ``loop``: ``controller.max_staleness = 2``. The worker generates the next batches and the service
  scores the next one while the learner trains: the learner's step inside the loop.

Policies: ``one_each`` (``learner.threads = 1``, no yielding: one thread per process), ``threads``
(``learner.threads`` = the machine's cores, no yielding), ``plan`` (both ``"auto"``: on a
box with fewer cores than processes the learner takes them all and the others yield),
``plan_spin`` (the plan with libgomp's own wait: an OpenMP thread out of work spins ~3 ms
before it sleeps, instead of sleeping at once as the plan has it when the others yield,
:func:`trainer.driver.cluster.environment.worker_env`; ``GOMP_SPINCOUNT=300000`` sets that spin,
libgomp's count when no policy is given, and an explicit count overrides the passive policy's;
not in the default ``--policies``). The ``alone``
run is made once per learner thread count (1 and the cores); yielding changes nothing there.

Per run: the learner's seconds per step (median of the metrics rows' ``train_s``, the first step
left out: thread pools and allocator warm up there), the loop's seconds per step and
``loop_over_learner`` (the summary's), completions per second, the driver's wait for old logits
per step (``old_logits_s_per_step``: the summary's total over its steps, the first included), and
``os.getloadavg()`` before and after. Per policy: learner inside the loop / alone (goal <= 1.1) and loop / learner (goal <= 1.02).
A run that started while the 1-minute load average exceeded 2.5 on this 2-core box shared the CPU
with other jobs: its seconds are not to be read (``readable = false``). The load after a run is
recorded but not judged: the job's own processes raise it. Before each run the benchmark waits up
to :data:`SETTLE_S` for the previous run's load to decay below the limit. Prints a table, writes
JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

os.environ.setdefault("OMP_NUM_THREADS", "1")

LEARNER_GOAL = 1.1
"""Learner seconds per step inside the loop over alone that the thread plan aims at."""
LOOP_GOAL = 1.02
"""Loop seconds per step over learner seconds per step that the thread plan aims at."""
LOAD_LIMIT = 2.5
"""Largest 1-minute load average at which this 2-core box's timings are read."""
SETTLE_S = 180.0
"""Longest wait, in seconds, for the load average to fall to :data:`LOAD_LIMIT` before a run."""

CONFIG = "deploy/configs/demo.toml"
"""The config every job of the benchmark starts from."""

POLICIES: dict[str, list[str]] = {
    "one_each": ["learner.threads=1", "machine.yield_to_learner=false"],
    "threads": ["learner.threads={cores}", "machine.yield_to_learner=false"],
    "plan": ['learner.threads="auto"', 'machine.yield_to_learner="auto"'],
    "plan_spin": ['learner.threads="auto"', 'machine.yield_to_learner="auto"'],
}
"""Config overrides per policy (``{cores}``: the machine's cores)."""
POLICY_ENV: dict[str, dict[str, str]] = {"plan_spin": {"GOMP_SPINCOUNT": "300000"}}
"""Environment variables a policy's job runs with (the driver's, passed to every Ray worker)."""


def steady_median(values: list[float]) -> float:
    """Median of ``values`` without the first (warm-up) one; of all when there is one. NaN for none.

    Example: [9.0, 2.0, 4.0, 3.0] -> median of [2, 4, 3] = 3.0.
    """
    vals = values[1:] if len(values) > 1 else values
    return statistics.median(vals) if vals else float("nan")


def readable(loads: list[float], limit: float = LOAD_LIMIT) -> bool:
    """Whether every 1-minute load average in ``loads`` is at most ``limit`` (timings worth reading)."""
    return all(x <= limit for x in loads)


def settle(limit_s: float, limit: float = LOAD_LIMIT, poll_s: float = 5.0) -> float:
    """Wait until the 1-minute load average is at most ``limit`` or ``limit_s`` seconds have passed;
    the seconds waited."""
    t0 = time.monotonic()
    while os.getloadavg()[0] > limit and time.monotonic() - t0 < limit_s:
        time.sleep(poll_s)
    return time.monotonic() - t0


def compare(alone: dict[str, Any], loop: dict[str, Any]) -> dict[str, Any]:
    """One policy's figures from its ``alone`` and ``loop`` rows (``learner_s``, ``loop_over_learner``,
    ``loads``): learner inside / alone and loop / learner, against :data:`LEARNER_GOAL` and
    :data:`LOOP_GOAL`. Example: alone 10 s, loop learner 12 s, loop/learner 1.05: 1.2 (goal missed),
    1.05 (goal missed)."""
    ratio = loop["learner_s"] / alone["learner_s"]
    return {
        "learner_alone_s": alone["learner_s"],
        "learner_in_loop_s": loop["learner_s"],
        "in_loop_over_alone": ratio,
        "loop_over_learner": loop["loop_over_learner"],
        "loop_s_per_step": loop["loop_s_per_step"],
        "completions_per_s": loop["completions_per_s"],
        "old_logits_s_per_step": loop["old_logits_s_per_step"],
        "learner_goal_met": ratio <= LEARNER_GOAL,
        "loop_goal_met": (loop["loop_over_learner"] or float("inf")) <= LOOP_GOAL,
        "readable": readable(alone["loads"] + loop["loads"]),
    }


def job_sets(model: str, steps: int, staleness: int, run_dir: str) -> list[str]:
    """The ``--set`` items of every job of the benchmark on top of :data:`CONFIG`: ``steps`` versions
    at ``controller.max_staleness = staleness`` into ``run_dir``, no held-out evaluation, server,
    trackers, plots or samples."""
    return [
        f'model.path="{model}"', f"controller.total_steps={steps}", f"controller.max_staleness={staleness}",
        "controller.time_budget_s=3600", "env.eval_prompts=0", "controller.eval_every=0", "server.enabled=false",
        "logging.trackers=[]", "logging.plots=false", "logging.samples_per_step=0", "rollout.start_timeout_s=900",
        f'logging.run_dir="{run_dir}"',
    ]  # fmt: skip


def run_one(
    model: str, steps: int, staleness: int, overrides: list[str], env: dict[str, str] | None = None
) -> dict[str, Any]:
    """One job (see the module docstring) with ``controller.max_staleness = staleness`` and ``env``
    set in this process while it runs (restored after); its row."""
    from trainer.driver.config.schema import load_config
    from trainer.driver.loop.job import run_job
    from trainer.driver.records.metrics_log import read_metrics

    run_dir = tempfile.mkdtemp(prefix=f"vintage-cores-{staleness}-")
    cfg = load_config(CONFIG, [*job_sets(model, steps, staleness, run_dir), *overrides])
    plan = cfg.thread_plan()
    settle(SETTLE_S)
    load0 = os.getloadavg()
    with mock.patch.dict(os.environ, env or {}):
        s = run_job(cfg)
    load1 = os.getloadavg()
    rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    train = [float(r["train_s"]) for r in rows]
    return {
        "max_staleness": staleness,
        "overrides": overrides,
        "env": env or {},
        "plan": plan.__dict__,
        "steps": s["steps"],
        "learner_s": steady_median(train),
        "learner_s_each": train,
        "learner_s_mean_summary": s["train_s_per_step"],
        "loop_s_per_step": s["loop_s_per_step"],
        "loop_over_learner": s["loop_over_learner"],
        "completions_per_s": s["consumed"] / s["loop_s"] if s["loop_s"] else float("nan"),
        "time_split_s": s["time_split_s"],
        "old_logits_s_per_step": s["time_split_s"].get("old_logits", 0.0) / max(1, s["steps"]),
        "loadavg_before": list(load0),
        "loadavg_after": list(load1),
        "loads": [load0[0]],
    }


def print_table(result: dict[str, Any]) -> None:
    """The policies side by side."""
    head = f"{'policy':>12} {'threads L/R/O':>13} {'yield':>5} {'alone s':>8} {'in loop s':>9} {'loop/alone':>10} {'loop/learner':>12} {'compl/s':>7} {'old-logit wait/step (mean)':>27} {'load start':>10} {'read':>4}"
    print(head)
    for name, c in result["policies"].items():
        p = result["runs"][f"{name}/loop"]["plan"]
        loads = result["runs"][f"{name}/loop"]["loads"]
        print(
            f"{name:>12} {p['learner']:>5}/{p['rollout']}/{p['oldlogit']:<5} {str(p['yield_to_learner'])[0]:>5} "
            f"{c['learner_alone_s']:>8.2f} {c['learner_in_loop_s']:>9.2f} {c['in_loop_over_alone']:>10.2f} "
            f"{c['loop_over_learner'] or float('nan'):>12.3f} {c['completions_per_s']:>7.2f} "
            f"{c['old_logits_s_per_step']:>27.2f} {max(loads):>10.1f} {'yes' if c['readable'] else 'NO':>4}"
        )
    print(
        f"goals: learner in loop / alone <= {LEARNER_GOAL}, loop / learner <= {LOOP_GOAL}; timings are not to be read where the load at a run's start > {LOAD_LIMIT}"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark (see the module docstring); returns and writes the result."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny (random 2-layer Llama) or smollm2")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--policies", nargs="+", default=["one_each", "threads", "plan"], choices=list(POLICIES))
    ap.add_argument("--out", default="runs/bench/cores.json")
    a = ap.parse_args(argv)

    from benchmarks.machine import machine_facts
    from modelkit.cores import available_cores
    from trainer.driver.cluster.netguard import reexec_with_loopback

    reexec_with_loopback()  # the private cluster, this driver included, listens on loopback only
    t0, cores = time.perf_counter(), available_cores()
    runs: dict[str, dict[str, Any]] = {}
    alone_for = {"one_each": "alone@1", **{p: f"alone@{cores}" for p in ("threads", "plan", "plan_spin")}}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    for name in a.policies:
        key = alone_for[name]
        if key not in runs:
            threads = key.split("@")[1]
            runs[key] = run_one(a.model, a.steps, 0, [f"learner.threads={threads}", "machine.yield_to_learner=false"])
        overrides = [o.format(cores=cores) for o in POLICIES[name]]
        runs[f"{name}/loop"] = run_one(a.model, a.steps, 2, overrides, POLICY_ENV.get(name))
        done = [n for n in a.policies if f"{n}/loop" in runs]
        result = {
            "model": a.model,
            "steps": a.steps,
            "cores": cores,
            "machine": machine_facts(t0),
            "load_limit": LOAD_LIMIT,
            "goals": {"in_loop_over_alone": LEARNER_GOAL, "loop_over_learner": LOOP_GOAL},
            "runs": runs,
            "policies": {n: compare(runs[alone_for[n]], runs[f"{n}/loop"]) for n in done},
        }
        out.write_text(json.dumps(result, indent=2))  # after every policy: a stopped run keeps what it measured
    print_table(result)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
