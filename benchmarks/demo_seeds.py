"""The demo config over several seeds: does every run end above where it began, and keep what it learned?

Each seed is one fresh ``vintage run deploy/configs/demo.toml --set controller.seed=S`` in its own
process, as a user runs it (private local Ray cluster, vLLM rollout worker, DeepSpeed learner, the
old-logit service), one after the other on a quiet machine; its run folder is ``<runs>/demo-sS``, or
``<runs>/demo-<tag>-sS`` with ``--tag`` (so runs of another config do not collide). ``--set
section.field=value`` (repeatable) goes to every run, before the benchmark's own ``controller.seed``,
``logging.run_dir`` and ``server.port`` (which it may not name). A seed whose run folder already holds
a finished ``summary.json`` is read, not run again, so the benchmark can be resumed and extended with
more seeds; the folder's ``demo_seeds.json`` records the config and ``--set`` list it was run with, and
reading it with another list is refused.

Per seed it reports, from ``summary.json`` and the run's ``metrics.jsonl`` (one row per learner step,
one ``kind = "eval"`` record per pinned held-out evaluation, the ones before and after training
included): the held-out success rate (share of 64 unseen prompts, one sample each, the training
sampler, whose reward is above 0.5) before training (version 0) and after it (the final version), the
best pinned evaluation of the run and its version (highest success rate, ties to the earlier
version), whether the run holds (after >= best - :data:`HOLD_MARGIN`) and whether it ended below its
start, the gain (after - before), the policy entropy (nats) at the last step and its minimum over the
run, ``filtered_groups`` (groups dynamic sampling dropped, run total), the mean ``kl_ref`` of the last
5 steps, the steps taken, the wall seconds, and the collapse signals: the largest per-step clip
fraction, the largest ratio, the largest gradient norm and the zero-variance groups. The summary gives
the median and range of the gains, the median last-step entropy, how many runs hold and how many
ended below their start, and whether the goals are met (:func:`summarize`).

    python -m benchmarks.demo_seeds --seeds 1 2 3 4 5 6 --out results/demo_seeds
    python -m benchmarks.demo_seeds --tag kl --set loss.kl_coef=0.05 --out results/demo_seeds_kl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

CONFIG = "deploy/configs/demo.toml"

HOLD_MARGIN = 0.08
"""A run holds when its final held-out success rate is at least its best one minus this (a share of
the held-out prompts: 0.08 of 64 is about 5 prompts)."""

GOAL_GAIN_MEDIAN = 0.30
"""Goal: the median gain in held-out success rate over finished runs is at least this."""

GOAL_ENTROPY_MEDIAN = 0.5
"""Goal: the median policy entropy (nats) at the last step over finished runs is at least this."""

_EPS = 1e-9
"""Slack on the ``>=`` comparisons, so that 0.84 - 0.08 against 0.76 is decided by the numbers, not
by float rounding."""

_OWN_KEYS = ("controller.seed", "logging.run_dir", "server.port")
"""The ``--set`` keys the benchmark sets per run itself."""

_TAG = re.compile(r"[A-Za-z0-9._-]+")


def run_name(seed: int, tag: str | None = None) -> str:
    """The run folder's name: ``demo-s{seed}``, or ``demo-{tag}-s{seed}`` with a tag.

    Raises:
        ValueError: the tag is empty or holds another character than letters, digits, ``.``, ``_``, ``-``.
    """
    if tag is None:
        return f"demo-s{seed}"
    if not _TAG.fullmatch(tag):
        raise ValueError(f"--tag {tag!r}: use letters, digits, '.', '_' or '-'")
    return f"demo-{tag}-s{seed}"


def check_sets(sets: Sequence[str]) -> list[str]:
    """The ``--set`` items as a list, each ``section.field=value`` and none of the keys the benchmark
    sets per run (``controller.seed``, ``logging.run_dir``, ``server.port``).

    Raises:
        ValueError: an item has no ``=`` or names one of those keys.
    """
    for item in sets:
        key = item.split("=", 1)[0].strip()
        if "=" not in item or not key:
            raise ValueError(f"--set {item!r}: expected section.field=value")
        if key in _OWN_KEYS:
            raise ValueError(f"--set {item!r}: {key} is set per run by the benchmark")
    return list(sets)


def finished(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a ``summary.json`` whose ``state`` is ``finished``."""
    summary = run_dir / "summary.json"
    return summary.is_file() and json.loads(summary.read_text()).get("state") == "finished"


def stored_records(results: Path, config: str, sets: Sequence[str], tag: str | None) -> dict[int, dict[str, Any]]:
    """Seed records of an earlier ``results.json`` written with the same config, ``--set`` list and
    tag, by seed; empty when the file is absent or was written with other settings. Only finished
    runs are kept: they stand in for seeds whose run folder is gone (a fresh checkout keeps
    ``results/`` but not ``runs/``), while a seed recorded as failed or missing is run again."""
    if not results.is_file():
        return {}
    earlier = json.loads(results.read_text())
    if (earlier.get("config"), earlier.get("sets"), earlier.get("tag")) != (config, list(sets), tag):
        return {}
    return {int(rec["seed"]): rec for rec in earlier.get("seeds", []) if rec.get("state") == "finished"}


def run_outputs(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A run's ``summary.json`` ({} when absent) and its learner-step rows of ``metrics.jsonl``
    ([] without a summary)."""
    from trainer.driver.records.metrics_log import read_metrics

    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    return summary, read_metrics(run_dir / "metrics.jsonl") if summary else []


def run_seed(
    seed: int,
    runs: Path,
    config: str = CONFIG,
    sets: Sequence[str] = (),
    tag: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Path:
    """Run the config with ``controller.seed = seed`` and the ``sets`` overrides into
    ``runs/demo[-{tag}]-s{seed}`` unless a finished summary is there already; returns the run folder.
    ``env``: environment variables the run gets on top of this process's own. The run's output goes
    to ``run.log`` in it; ``demo_seeds.json`` records ``config``, ``sets`` and ``env`` when given.

    Raises:
        ValueError: a bad tag or ``--set`` item (:func:`run_name`, :func:`check_sets`), or the folder
            holds a finished run recorded with another config or ``--set`` list.
    """
    sets = check_sets(sets)
    run_dir = runs / run_name(seed, tag)
    recorded = run_dir / "demo_seeds.json"
    wanted: dict[str, Any] = {"config": config, "sets": sets, **({"env": dict(env)} if env else {})}
    if finished(run_dir):
        if recorded.is_file() and (got := json.loads(recorded.read_text())) != wanted:
            raise ValueError(
                f"{run_dir}: finished with config {got.get('config')!r}, --set {got.get('sets')} and env "
                f"{got.get('env', {})}, not {config!r}, {sets} and {dict(env or {})}; use another --tag or --runs"
            )
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    recorded.write_text(json.dumps(wanted, indent=1))
    cmd = [str(Path(sys.executable).with_name("vintage")), "run", config]
    for item in sets:
        cmd += ["--set", item]
    cmd += ["--set", f"controller.seed={seed}", "--set", f'logging.run_dir="{run_dir}"', "--set", "server.port=0"]
    with open(run_dir / "run.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False, env={**os.environ, **(env or {})})
    return run_dir


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _max(rows: list[dict[str, Any]], key: str) -> float:
    vals = [float(r[key]) for r in rows if _finite(r.get(key))]
    return max(vals) if vals else math.nan


def _rate(d: Any) -> float:
    """``d["success_rate"]`` of a summary's ``reward_before`` / ``reward_after`` (NaN where absent)."""
    x = d.get("success_rate") if isinstance(d, dict) else None
    return float(x) if _finite(x) else math.nan


def best_eval(evals: list[tuple[int, float]]) -> tuple[int | None, float]:
    """The best of ``(version, success rate)`` evaluations: the highest finite rate, ties to the
    earlier version; ``(None, NaN)`` without one.

    Example: (0, 0.20), (10, 0.50), (20, 0.84), (30, 0.56), (40, 0.48) -> (20, 0.84)."""
    ok = [(v, s) for v, s in evals if _finite(s)]
    if not ok:
        return None, math.nan
    v, s = max(ok, key=lambda e: (e[1], -e[0]))
    return v, s


def holds(after: float, best: float, margin: float = HOLD_MARGIN) -> bool:
    """Whether a run kept what it learned: ``after >= best - margin`` (success rates; False when
    either is NaN). Example: best 0.84, after 0.48: 0.48 < 0.76, does not hold."""
    return _finite(after) and _finite(best) and after >= best - margin - _EPS


def seed_record(seed: int, run_dir: Path) -> dict[str, Any]:
    """One seed's numbers from its ``summary.json`` and ``metrics.jsonl`` (NaN where absent).

    Held-out success rates: ``before`` is the evaluation pinned to version 0 (else the summary's
    ``reward_before``), ``after`` the summary's ``reward_after`` (else the last evaluation tagged
    ``after``); ``best`` / ``best_version`` the best of every evaluation (:func:`best_eval`; before
    and after count, from the summary where ``metrics.jsonl`` lacks them). ``entropy_last`` (nats)
    is the last step row's ``entropy``, ``filtered_groups`` the summary's (else the last step row's)
    run total, ``kl_ref_last5`` the mean finite ``kl_ref`` of the last 5 step rows."""
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    lines = []
    if (run_dir / "metrics.jsonl").is_file():
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in lines if r.get("kind", "step") == "step" and "reward_mean" in r]
    evals = [r for r in lines if r.get("kind") == "eval" and isinstance(r.get("version"), int)]
    curve = [
        (int(e["version"]), float(e["success_rate"]) if _finite(e.get("success_rate")) else math.nan) for e in evals
    ]

    before = next((s for v, s in curve if v == 0 and math.isfinite(s)), _rate(summary.get("reward_before")))
    after = _rate(summary.get("reward_after"))
    if not math.isfinite(after):
        after = next(
            (s for e, (_, s) in zip(reversed(evals), reversed(curve), strict=True) if e.get("tag") == "after"), math.nan
        )
    candidates = list(curve)
    if not any(v == 0 for v, _ in curve) and math.isfinite(before):
        candidates.insert(0, (0, before))
    steps = summary.get("steps")
    if not any(e.get("tag") == "after" for e in evals) and math.isfinite(after):
        candidates.append((int(steps) if isinstance(steps, int) else max((v for v, _ in curve), default=0), after))
    best_version, best = best_eval(candidates)

    entropy = [float(r["entropy"]) for r in rows if _finite(r.get("entropy"))]
    last = rows[-1] if rows else {}
    filtered = summary.get("filtered_groups", last.get("filtered_groups"))
    kl = [float(r["kl_ref"]) for r in rows[-5:] if _finite(r.get("kl_ref"))]
    return {
        "seed": seed,
        "state": summary.get("state", "missing"),
        "end_reason": summary.get("end_reason"),
        "before": before,
        "best": best,
        "best_version": best_version,
        "after": after,
        "gain": after - before,
        "holds": holds(after, best),
        "below_start": _finite(after - before) and after < before,
        "evals": [[v, s] for v, s in curve],
        "steps": steps,
        "wall_s": summary.get("wall_s", math.nan),
        "entropy_last": float(last["entropy"]) if _finite(last.get("entropy")) else math.nan,
        "entropy_min": min(entropy) if entropy else math.nan,
        "filtered_groups": int(filtered) if _finite(filtered) else None,
        "kl_ref_last5": statistics.fmean(kl) if kl else math.nan,
        "clip_frac_step_max": _max(rows, "clip_frac_step_max"),
        "ratio_max": _max(rows, "ratio_max"),
        "grad_norm_max": _max(rows, "grad_norm"),
        "zero_variance_groups": sum(int(r.get("zero_variance_groups", 0)) for r in rows),
        "batch_reward_last5": statistics.fmean(r["reward_mean"] for r in rows[-5:]) if rows else math.nan,
    }


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and range of the held-out gains over finished seeds, how many ended above and below their
    start, how many hold, the median last-step entropy (nats), and the goals.

    The goals (``goals``, all met: ``goals_met``): ``every_run_holds`` (every seed asked for finished
    and holds, :func:`holds`), ``none_below_start`` (no finished run ended below its start),
    ``gain_median`` >= :data:`GOAL_GAIN_MEDIAN` and ``entropy_last_median`` >=
    :data:`GOAL_ENTROPY_MEDIAN`; none is met without a finished run.

    Example: gains 0.1, 0.3, 0.5 -> median 0.3, range [0.1, 0.5], 3 of 3 above."""
    done = [r for r in records if r["state"] == "finished" and math.isfinite(r["gain"])]
    gains = [r["gain"] for r in done]
    entropy = [r["entropy_last"] for r in done if math.isfinite(r.get("entropy_last", math.nan))]
    gain_median = statistics.median(gains) if gains else math.nan
    entropy_median = statistics.median(entropy) if entropy else math.nan
    below = sum(bool(r.get("below_start")) for r in done)
    goals = {
        "every_run_holds": bool(done) and all(r["state"] == "finished" and r.get("holds") for r in records),
        "none_below_start": bool(done) and below == 0,
        "gain_median": math.isfinite(gain_median) and gain_median >= GOAL_GAIN_MEDIAN - _EPS,
        "entropy_last_median": math.isfinite(entropy_median) and entropy_median >= GOAL_ENTROPY_MEDIAN - _EPS,
    }
    return {
        "seeds": [r["seed"] for r in done],
        "runs": len(done),
        "asked": len(records),
        "above_start": sum(g > 0 for g in gains),
        "below_start": below,
        "hold": sum(bool(r.get("holds")) for r in done),
        "gain_median": gain_median,
        "gain_min": min(gains) if gains else math.nan,
        "gain_max": max(gains) if gains else math.nan,
        "before_median": statistics.median(r["before"] for r in done) if done else math.nan,
        "after_median": statistics.median(r["after"] for r in done) if done else math.nan,
        "after_min": min((r["after"] for r in done), default=math.nan),
        "after_max": max((r["after"] for r in done), default=math.nan),
        "entropy_last_median": entropy_median,
        "goals": goals,
        "goals_met": all(goals.values()),
    }


def table_markdown(records: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """The per-seed table and the summary lines (held-out success rates on 64 prompts, entropy in nats)."""

    def f(x: Any, fmt: str = ".3f") -> str:
        return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)

    lines = [
        "| seed | before | best (version) | after | holds | entropy (last / min) | gain | steps | wall s | "
        "filtered groups | kl_ref last 5 | largest step clip | ratio max | grad norm max | zero-variance groups |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        best = f"{f(r['best'])} (v{r['best_version']})" if r["best_version"] is not None else "-"
        lines.append(
            f"| {r['seed']} | {f(r['before'])} | {best} | {f(r['after'])} | {'yes' if r['holds'] else 'no'} | "
            f"{f(r['entropy_last'], '.2f')} / {f(r['entropy_min'], '.2f')} | {f(r['gain'], '+.3f')} | "
            f"{r['steps']} | {f(r['wall_s'], '.0f')} | {f(r['filtered_groups'], 'd')} | {f(r['kl_ref_last5'], '.4f')} | "
            f"{f(r['clip_frac_step_max'], '.2f')} | {f(r['ratio_max'], '.2f')} | {f(r['grad_norm_max'], '.1f')} | "
            f"{r['zero_variance_groups']} |"
        )
    s = summary
    g = s["goals"]

    def mark(ok: bool) -> str:
        return "met" if ok else "NOT met"

    lines += [
        "",
        f"{s['above_start']} of {s['runs']} runs ended above their start, {s['below_start']} below; "
        f"gain median {f(s['gain_median'], '+.3f')} (range {f(s['gain_min'], '+.3f')} to {f(s['gain_max'], '+.3f')}); "
        f"held-out after: median {f(s['after_median'])} (range {f(s['after_min'])}-{f(s['after_max'])}), "
        f"before: median {f(s['before_median'])}.",
        "",
        f"{s['hold']} of {s['runs']} runs hold (after >= best - {HOLD_MARGIN:.2f}); "
        f"last-step entropy median {f(s['entropy_last_median'], '.2f')} nats.",
        "",
        f"Goals {'met' if s['goals_met'] else 'NOT met'}: every run holds ({s['hold']} of {s['asked']}): "
        f"{mark(g['every_run_holds'])}; none below start: {mark(g['none_below_start'])}; "
        f"gain median >= {GOAL_GAIN_MEDIAN:+.2f}: {mark(g['gain_median'])}; "
        f"last-step entropy median >= {GOAL_ENTROPY_MEDIAN:.1f} nats: {mark(g['entropy_last_median'])}.",
    ]
    return "\n".join(lines) + "\n"


def main(
    seeds: list[int],
    out: Path,
    runs: Path,
    config: str = CONFIG,
    sets: Sequence[str] = (),
    tag: str | None = None,
) -> dict[str, Any]:
    """Run (or read) every seed with the ``sets`` overrides into ``runs/demo[-{tag}]-s{seed}``, then
    write ``out/results.json`` (the config, ``sets``, ``tag``, the summary and every seed's record)
    and ``out/table.md``."""
    sets = check_sets(sets)
    for s in seeds:
        run_name(s, tag)  # a bad tag fails before any run
    stored = stored_records(out / "results.json", config, sets, tag)
    records = []
    for s in seeds:
        t0 = time.perf_counter()
        if s in stored and not finished(runs / run_name(s, tag)):
            rec, source = stored[s], f"read from {out / 'results.json'}"
        else:
            rec, source = seed_record(s, run_seed(s, runs, config, sets, tag)), "run folder"
        records.append(rec)
        print(
            f"seed {s} ({source}): {rec['state']} before {rec['before']:.3f} best {rec['best']:.3f} (v{rec['best_version']}) "
            f"after {rec['after']:.3f} {'holds' if rec['holds'] else 'does not hold'} "
            f"({time.perf_counter() - t0:.0f} s)"
        )
    summary = summarize(records)
    out.mkdir(parents=True, exist_ok=True)
    argv = ["python", "-m", "benchmarks.demo_seeds", "--seeds", *map(str, seeds)]
    if config != CONFIG:
        argv += ["--config", config]
    if tag is not None:
        argv += ["--tag", tag]
    for item in sets:
        argv += ["--set", item]
    result = {"config": config, "sets": sets, "tag": tag, "command": shlex.join(argv),
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
    ap.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
        help="section.field=value for every run (repeatable)",
    )  # fmt: skip
    ap.add_argument("--tag", default=None, help="name the run folders demo-<tag>-s<seed>")
    a = ap.parse_args()
    main(a.seeds, a.out, a.runs, a.config, a.sets, a.tag)
