"""Async vs synchronous training on the same work, side by side in one run.

    python -m benchmarks.bench_async [--model smollm2|tiny] [--steps 6]

Both runs use the real pipeline (``trainer.driver.loop.job.run_job``: vLLM rollout worker, DeepSpeed learner,
snapshot old-logit service) with identical batches, model and sampling; only
``controller.max_staleness`` differs: 0 is the synchronous baseline (generate a batch, train on it,
publish, repeat), 2 lets the worker generate the next batches while the learner trains. With
``OMP_NUM_THREADS=1`` per process, rollout and learner each get one of this box's two cores.

Reported per run: wall seconds of the training loop per optimizer step (startup and held-out
evaluation excluded), the learner's seconds per step, the loop's seconds per learner second, and
the ratio async/sync (goal <= 0.75). Prints a table and writes
``runs/bench/async.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

GOAL = 0.75
"""Async seconds per step over sync seconds per step that the asynchrony should reach on 2 cores."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2 (the real model) or tiny")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default="runs/bench/async.json")
    a = ap.parse_args()

    from trainer.driver.cluster.netguard import reexec_with_loopback

    reexec_with_loopback()  # the private cluster, this driver included, listens on loopback only
    from trainer.driver.config.schema import load_config
    from trainer.driver.loop.job import run_job

    rows = []
    for staleness in (0, 2):
        run_dir = tempfile.mkdtemp(prefix=f"vintage-async-{staleness}-")
        cfg = load_config(
            "deploy/configs/demo.toml",
            [
                f'model.path="{a.model}"', f"controller.total_steps={a.steps}", f"controller.max_staleness={staleness}",
                "controller.time_budget_s=3600", "env.eval_prompts=0", "server.enabled=false", "logging.trackers=[]",
                "logging.plots=false", f'logging.run_dir="{run_dir}"',
            ],
        )  # fmt: skip
        s = run_job(cfg)
        split = s["time_split_s"]
        rows.append({
            "max_staleness": staleness, "steps": s["steps"], "loop_s": s["loop_s"], "s_per_step": s["loop_s"] / max(s["steps"], 1),
            "train_s": split.get("train", 0.0), "old_logits_s": split.get("old_logits", 0.0), "publish_s": split.get("publish", 0.0),
            "learner_s_per_step": s["train_s_per_step"], "loop_over_learner": s["loop_over_learner"],
            "consumed": s["consumed"], "dropped": s["dropped"],
        })  # fmt: skip
    sync, asyn = rows
    result = {
        "model": a.model,
        "steps": a.steps,
        "runs": rows,
        "async_over_sync": asyn["s_per_step"] / sync["s_per_step"],
        "goal": GOAL,
    }
    print(
        f"{'max_staleness':>13} {'s/step':>8} {'train s':>8} {'old-logit s':>11} {'publish s':>9} {'loop/learner':>12}"
    )
    for r in rows:
        print(
            f"{r['max_staleness']:>13} {r['s_per_step']:>8.2f} {r['train_s']:>8.1f} {r['old_logits_s']:>11.1f} "
            f"{r['publish_s']:>9.1f} {r['loop_over_learner'] or float('nan'):>12.2f}"
        )
    print(f"async/sync per step: {result['async_over_sync']:.3f} (goal <= {GOAL})")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
