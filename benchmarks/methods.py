"""Methods x staleness x discrepancy, side by side, on the real pipeline: the grid's runner.

The axes, cells and grids are described in :mod:`benchmarks.methods_grid`; the tables and plots are
made by :mod:`benchmarks.methods_report`. Every cell is one real job (``trainer.driver.loop.job.run_job``:
vLLM rollout worker, DeepSpeed learner, the old-logit service, the EWMA, the async controller); one
Ray session serves the whole grid, and a cell already finished in ``out_dir`` is loaded, not run again.

    vintage bench methods                       # full grid
    vintage bench methods --quick --out /tmp/q  # smoke
    python -m benchmarks.methods --grid paper --out results/methods/paper
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from benchmarks.methods_grid import BASE, DISCREPANCY, GRIDS, LAST_K, REWARD_LEVEL, Cell, collapsed, finite_mean, grid
from benchmarks.methods_report import _json_default, folder_records, table_markdown, write_outputs

# -- one cell -------------------------------------------------------------------------------------


@dataclass
class _Poller:
    """Polls the job's ``/v1/status`` for the old-logit service's ``bytes_held`` while it runs."""

    run_dir: Path
    stop: threading.Event = field(default_factory=threading.Event)
    max_bytes: int = 0
    max_versions: int = 0

    def __call__(self) -> None:
        import httpx

        url = None
        while not self.stop.is_set():
            try:
                if url is None and (self.run_dir / "server.json").is_file():
                    url = json.loads((self.run_dir / "server.json").read_text())["url"]
                if url is not None:
                    s = httpx.get(f"{url}/v1/status", timeout=5).json()
                    ol = s.get("oldlogit") or {}
                    self.max_bytes = max(self.max_bytes, int(ol.get("bytes_held") or 0))
                    self.max_versions = max(self.max_versions, len(ol.get("versions_held") or []))
            except Exception:  # noqa: BLE001 - the server may be starting or gone; keep polling
                pass
            self.stop.wait(1.0)


def cell_record(
    cell: Cell,
    rows: list[dict[str, Any]],
    summary: dict[str, Any],
    poller: _Poller,
    evals: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Per-run numbers from ``metrics.jsonl`` step rows, its held-out evaluation records ``evals``
    (``kind = "eval"``: before, every ``controller.eval_every`` versions during training, after) and
    the job summary. ``heldout_evals`` keeps each evaluation's version, tag, mean reward, success
    rate and episode count; ``heldout_n`` is the held-out episode count of one evaluation."""
    evals = evals or []
    g = lambda k: [float(r.get(k, math.nan)) for r in rows]  # noqa: E731
    reward = g("reward_mean")
    smooth = [float(np.mean(reward[max(0, i - 2) : i + 1])) for i in range(len(reward))]
    reach = next((int(rows[i]["version"]) for i, x in enumerate(smooth) if x >= REWARD_LEVEL), None)
    hist: dict[str, int] = {}
    for r in rows:
        for k, v in r.get("staleness_hist", {}).items():
            hist[k] = hist.get(k, 0) + int(v)
    extra = [
        float(r.get("old_logits_s", 0.0)) + float(r.get("ewma_forward_s", 0.0)) + float(r.get("ewma_update_s", 0.0))
        for r in rows
    ]
    before, after = summary.get("reward_before") or {}, summary.get("reward_after") or {}
    return {
        "cell": cell.name,
        **asdict(cell),
        "extra": list(cell.extra),
        "steps_done": int(summary.get("steps", 0)),
        "state": summary.get("state"),
        "final_reward": finite_mean(reward[-LAST_K:]),
        "reward_first": reward[0] if reward else math.nan,
        "reward_before_heldout": before.get("reward", math.nan),
        "reward_after_heldout": after.get("reward", math.nan),
        "success_after_heldout": after.get("success_rate", math.nan),
        "heldout_n": int(after.get("episodes") or (evals[-1].get("n", 0) if evals else 0)),
        "heldout_evals": [{k: e.get(k) for k in ("version", "tag", "held_out", "success_rate", "n")} for e in evals],
        "steps_to_level": reach,
        "mask_kept_fraction": finite_mean(g("mask_kept_fraction")),
        "mask_kept_fraction_min": min((x for x in g("mask_kept_fraction") if math.isfinite(x)), default=math.nan),
        "clip_frac_low": finite_mean(g("clip_frac_low")),
        "clip_frac_high": finite_mean(g("clip_frac_high")),
        "clip_frac_step_max": max((x for x in g("clip_frac_step_max") if math.isfinite(x)), default=math.nan),
        "clip_grad_removed_frac": finite_mean(g("clip_grad_removed_frac")),
        "entropy_last": finite_mean(g("entropy")[-LAST_K:]),
        "collapsed": collapsed(finite_mean(reward[-LAST_K:]), reward[0] if reward else math.nan),
        "exact_token_fraction": float(summary.get("exact_token_fraction", math.nan)),
        "proxy_abs_err": finite_mean(g("proxy_abs_err")),
        "discrepancy_kl": finite_mean(g("discrepancy_kl")),
        "weight_capped_frac": finite_mean(g("weight_capped_frac")),
        "ewma_resets": int(summary.get("ewma_resets", 0)),
        "oldlogit_bytes": poller.max_bytes,
        "oldlogit_versions_held": poller.max_versions,
        "ewma_bytes": int(max((x for x in g("ewma_bytes_held") if math.isfinite(x)), default=0)),
        "old_logits_s": finite_mean(g("old_logits_s")),
        "ewma_s": finite_mean([float(r.get("ewma_forward_s", 0.0)) + float(r.get("ewma_update_s", 0.0)) for r in rows]),
        "extra_s_per_step": finite_mean(extra),
        "train_s": finite_mean(g("train_s")),
        "publish_s": finite_mean(g("publish_s")),
        "staleness_mean": finite_mean(g("staleness_mean")),
        "spanning_frac": finite_mean(g("spanning_seqs")) / finite_mean(g("sequences")),
        "staleness_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
        "wall_s": float(summary.get("wall_s", math.nan)),
        "loop_s": float(summary.get("loop_s", math.nan)),
        "curves": {
            k: g(k)
            for k in (
                "reward_mean",
                "mask_kept_fraction",
                "clip_frac_low",
                "clip_frac_high",
                "proxy_abs_err",
                "discrepancy_kl",
                "staleness_mean",
                "exact_token_fraction",
            )  # fmt: skip
        },
    }


def is_complete(rec: dict[str, Any], cell: Cell) -> bool:
    """Whether a saved record is ``cell`` run to its end: state ``finished`` with every one of its
    steps done (a run stopped by a signal also finishes, with fewer steps)."""
    return rec.get("state") == "finished" and rec.get("steps") == rec.get("steps_done") == cell.steps


def run_cell(cell: Cell, out_dir: Path, console: Console) -> dict[str, Any]:
    """Run one cell (or load it when ``cells/<name>.json`` says it finished all its steps; a run
    interrupted before its last step runs again) and return its record."""
    from trainer.driver.config.schema import load_config
    from trainer.driver.loop.job import run_job
    from trainer.driver.records.metrics_log import read_metrics

    path = out_dir / "cells" / f"{cell.name}.json"
    if path.is_file():
        rec = json.loads(path.read_text())
        if is_complete(rec, cell):
            console.print(f"[dim]{cell.name}: done before, loaded[/dim]")
            return rec
    run_dir = out_dir / "runs" / cell.name
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = load_config(None, cell.overrides(run_dir))
    poller = _Poller(run_dir)
    th = threading.Thread(target=poller, daemon=True)
    th.start()
    t0 = time.perf_counter()
    try:
        summary = run_job(cfg, Console(quiet=True))
    finally:
        poller.stop.set()
        th.join(timeout=10)
    metrics = run_dir / "metrics.jsonl"
    rows = read_metrics(metrics) if metrics.is_file() else []
    evals = read_metrics(metrics, kind="eval") if metrics.is_file() else []
    rec = cell_record(cell, rows, summary, poller, evals)
    rec["cell_wall_s"] = time.perf_counter() - t0
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1, default=_json_default))
    console.print(
        f"{cell.name}: reward {rec['reward_first']:.3f} -> {rec['final_reward']:.3f} (held-out {rec['reward_after_heldout']:.3f}), "
        f"kept {rec['mask_kept_fraction']:.3f}, exact {rec['exact_token_fraction']:.2f}, proxy err {rec['proxy_abs_err']:.4f}, "
        f"resets {rec['ewma_resets']}, {rec['cell_wall_s']:.0f}s"
    )
    return rec


def run_grid(
    cells: list[Cell], out_dir: Path, console: Console, grid_name: str, stop_after_s: float | None = None
) -> dict[str, Any]:
    """Run ``cells`` in one Ray session (reused if already initialised), writing outputs after each.

    The outputs cover every finished cell in ``out_dir`` (this grid's and earlier ones'), so grids
    run into one folder (``reduced``, then ``seeds``) make one table with the seeds pooled per row.
    With ``stop_after_s`` no cell starts once that many seconds have passed since the grid started
    (the cell under way finishes; the rest wait for a resumed grid).
    """
    from trainer.driver.cluster.environment import defaults_env
    from trainer.driver.cluster.session import ray_session
    from trainer.driver.config.schema import load_config

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    defaults_env()
    t0 = time.perf_counter()
    prev = out_dir / "results.json"
    walls = json.loads(prev.read_text())["meta"].get("grid_wall_s", {}) if prev.is_file() else {}
    spent = walls.get(grid_name, 0.0)  # a resumed grid adds to the time already spent on it
    meta = {"grid": grid_name, "base": BASE, "discrepancy": DISCREPANCY, "grid_wall_s": walls,
            "reward_level": REWARD_LEVEL, "last_k": LAST_K, "env": "rollout.envs.toy:AlphabetEnv (a-m)"}  # fmt: skip
    records: list[dict[str, Any]] = []
    first = load_config(None, cells[0].overrides(out_dir / "runs" / "_"))
    with ray_session(first):
        for i, cell in enumerate(cells):
            if stop_after_s is not None and time.perf_counter() - t0 > stop_after_s:
                console.print(
                    f"stopped after {stop_after_s / 60:.0f} min: cells {i + 1}-{len(cells)} left for a resumed grid"
                )
                break
            console.print(f"[bold]cell {i + 1}/{len(cells)}[/bold] {cell.name}")
            try:
                records.append(run_cell(cell, out_dir, console))
            except Exception as e:  # noqa: BLE001 - one failed cell must not lose the grid
                console.print(f"[red]{cell.name} failed: {type(e).__name__}: {e}[/red]")
                continue
            walls[grid_name] = spent + time.perf_counter() - t0
            result = write_outputs(folder_records(out_dir), out_dir, meta)
    walls[grid_name] = spent + time.perf_counter() - t0
    result = write_outputs(folder_records(out_dir), out_dir, meta)
    console.print(table_markdown(result["rows"]))
    console.print(
        f"grid {grid_name}: {len(records)}/{len(cells)} cells in {walls[grid_name] / 60:.1f} min -> {out_dir}"
    )
    return result


def main(
    out_dir: Path = Path("results/methods"),
    quick: bool = False,
    console: Console | None = None,
    kind: str = "full",
    stop_after_min: float | None = None,
) -> dict[str, Any]:
    """``vintage bench methods``: grid ``kind`` (``quick`` when ``quick``); returns the results dict.
    With ``stop_after_min`` no cell starts after that many minutes (:func:`run_grid`).

    Raises:
        ValueError: ``kind`` is not one of :data:`GRIDS`.
    """
    kind = "quick" if quick else kind
    stop_after_s = None if stop_after_min is None else 60.0 * stop_after_min
    return run_grid(grid(kind), Path(out_dir), console or Console(), kind, stop_after_s)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", default="full", choices=GRIDS)
    ap.add_argument("--out", type=Path, default=Path("results/methods"))
    ap.add_argument("--stop-after-min", type=float, default=None, help="start no cell after this many minutes")
    a = ap.parse_args()
    main(a.out, kind=a.grid, stop_after_min=a.stop_after_min)
