"""The demo config over several seeds: does every run end above where it began?

Each seed is one fresh ``vintage run deploy/configs/demo.toml --set controller.seed=S`` in its own
process, as a user runs it (private local Ray cluster, vLLM rollout worker, DeepSpeed learner, the
old-logit service), one after the other on a quiet machine; its run folder is ``<runs>/demo-sS``.
A seed whose run folder already holds a finished ``summary.json`` is read, not run again, so the
benchmark can be resumed and extended with more seeds.

Per seed it reports the held-out success rate before and after training (64 unseen prompts, one
sample each, the training sampler), the gain, the steps taken, the wall seconds, and the collapse
signals of its ``metrics.jsonl``: the lowest per-step policy entropy, the largest per-step clip
fraction, the largest ratio, the largest gradient norm and the zero-variance groups. The summary
gives the median and range of the gains and how many runs ended above their start.

    python -m benchmarks.demo_seeds --seeds 1 2 3 4 5 6 --out results/demo_seeds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CONFIG = "deploy/configs/demo.toml"


def run_seed(seed: int, runs: Path, config: str = CONFIG) -> Path:
    """Run the demo config with ``controller.seed = seed`` into ``runs/demo-s{seed}`` unless a finished
    summary is there already; returns the run folder. The run's output goes to ``run.log`` in it."""
    run_dir = runs / f"demo-s{seed}"
    summary = run_dir / "summary.json"
    if summary.is_file() and json.loads(summary.read_text()).get("state") == "finished":
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(Path(sys.executable).with_name("vintage")), "run", config, "--set", f"controller.seed={seed}",
        "--set", f'logging.run_dir="{run_dir}"', "--set", "server.port=0",
    ]  # fmt: skip
    with open(run_dir / "run.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False, env=os.environ.copy())
    return run_dir


def _max(rows: list[dict[str, Any]], key: str) -> float:
    vals = [float(r[key]) for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
    return max(vals) if vals else math.nan


def seed_record(seed: int, run_dir: Path) -> dict[str, Any]:
    """One seed's numbers from its ``summary.json`` and ``metrics.jsonl`` (NaN where absent)."""
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    rows = []
    if (run_dir / "metrics.jsonl").is_file():
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        rows = [r for r in rows if "reward_mean" in r]
    before = (summary.get("reward_before") or {}).get("success_rate", math.nan)
    after = (summary.get("reward_after") or {}).get("success_rate", math.nan)
    entropy = [float(r["entropy"]) for r in rows if isinstance(r.get("entropy"), int | float)]
    return {
        "seed": seed,
        "state": summary.get("state", "missing"),
        "end_reason": summary.get("end_reason"),
        "before": before,
        "after": after,
        "gain": after - before,
        "steps": summary.get("steps"),
        "wall_s": summary.get("wall_s", math.nan),
        "entropy_min": min(entropy) if entropy else math.nan,
        "clip_frac_step_max": _max(rows, "clip_frac_step_max"),
        "ratio_max": _max(rows, "ratio_max"),
        "grad_norm_max": _max(rows, "grad_norm"),
        "zero_variance_groups": sum(int(r.get("zero_variance_groups", 0)) for r in rows),
        "batch_reward_last5": statistics.fmean(r["reward_mean"] for r in rows[-5:]) if rows else math.nan,
    }


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and range of the held-out gains over finished seeds, and how many ended above their start.

    Example: gains 0.1, 0.3, 0.5 -> median 0.3, range [0.1, 0.5], 3 of 3 above."""
    done = [r for r in records if r["state"] == "finished" and math.isfinite(r["gain"])]
    gains = [r["gain"] for r in done]
    return {
        "seeds": [r["seed"] for r in done],
        "runs": len(done),
        "above_start": sum(g > 0 for g in gains),
        "gain_median": statistics.median(gains) if gains else math.nan,
        "gain_min": min(gains) if gains else math.nan,
        "gain_max": max(gains) if gains else math.nan,
        "before_median": statistics.median(r["before"] for r in done) if done else math.nan,
        "after_median": statistics.median(r["after"] for r in done) if done else math.nan,
        "after_min": min((r["after"] for r in done), default=math.nan),
        "after_max": max((r["after"] for r in done), default=math.nan),
    }


def table_markdown(records: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """The per-seed table and a summary line (held-out success rates, 64 prompts)."""

    def f(x: Any, fmt: str = ".3f") -> str:
        return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)

    lines = [
        "| seed | held-out before | after | gain | steps | wall s | lowest entropy | largest step clip | ratio max | grad norm max | zero-variance groups |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['seed']} | {f(r['before'])} | {f(r['after'])} | {f(r['gain'], '+.3f')} | {r['steps']} | "
            f"{f(r['wall_s'], '.0f')} | {f(r['entropy_min'], '.2f')} | {f(r['clip_frac_step_max'], '.2f')} | "
            f"{f(r['ratio_max'], '.2f')} | {f(r['grad_norm_max'], '.1f')} | {r['zero_variance_groups']} |"
        )
    s = summary
    lines.append("")
    lines.append(
        f"{s['above_start']} of {s['runs']} runs ended above their start; gain median {f(s['gain_median'], '+.3f')} "
        f"(range {f(s['gain_min'], '+.3f')} to {f(s['gain_max'], '+.3f')}); held-out after: median "
        f"{f(s['after_median'])} (range {f(s['after_min'])}-{f(s['after_max'])}), before: median {f(s['before_median'])}."
    )
    return "\n".join(lines) + "\n"


def main(seeds: list[int], out: Path, runs: Path, config: str = CONFIG) -> dict[str, Any]:
    """Run (or read) every seed, then write ``out/results.json`` and ``out/table.md``."""
    records = []
    for s in seeds:
        t0 = time.perf_counter()
        rec = seed_record(s, run_seed(s, runs, config))
        records.append(rec)
        print(
            f"seed {s}: {rec['state']} before {rec['before']:.3f} after {rec['after']:.3f} ({time.perf_counter() - t0:.0f} s)"
        )
    summary = summarize(records)
    out.mkdir(parents=True, exist_ok=True)
    result = {"config": config, "command": f"python -m benchmarks.demo_seeds --seeds {' '.join(map(str, seeds))}",
              "summary": summary, "seeds": records}  # fmt: skip
    (out / "results.json").write_text(json.dumps(result, indent=1, default=lambda o: None))
    (out / "table.md").write_text(table_markdown(records, summary))
    print(table_markdown(records, summary))
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    ap.add_argument("--out", type=Path, default=Path("runs/bench/demo_seeds"))
    ap.add_argument("--runs", type=Path, default=Path("runs"))
    ap.add_argument("--config", default=CONFIG)
    a = ap.parse_args()
    main(a.seeds, a.out, a.runs, a.config)
