"""Tables, pooled rows and plots of the methods grid (:mod:`benchmarks.methods`) from its cell records.

A cell record is the JSON of ``cells/<cell>.json``; rows pool a (model, tag, method, W, disc) over
seeds. Outputs: ``table.md``, ``seeds.md`` (every run by seed), ``results.json`` and the PNG plots in
the grid's folder.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.methods_grid import LAST_K, METHODS, PROBES, REWARD_LEVEL, ci95, finite_mean


def _json_default(o: Any) -> Any:
    if isinstance(o, float | np.floating):
        return None if not math.isfinite(o) else float(o)
    if isinstance(o, np.integer):
        return int(o)
    return str(o)


# -- aggregation, table, plots --------------------------------------------------------------------


def _nan(x: Any) -> float:
    return math.nan if x is None else float(x)


def _by_configuration(records: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    """Records grouped by (model, tag, method, W, disc): the seeds of one table row."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r.get("model", "tiny"), r.get("tag", ""), r["method"], r["W"], r["disc"]), []).append(r)
    return groups


def _label(method: str, tag: str, W: int, disc: str, model: str) -> str:
    """The first three cells of a table line: method with its tag, W, mismatch with the model."""
    return (
        f"| {method}{' [' + tag + ']' if tag else ''} | {W} | {disc}{'' if model == 'tiny' else ' (' + model + ')'} |"
    )


def aggregate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, tag, method, W, disc): means over seeds, final-reward spread (sample sd)."""
    groups = _by_configuration(records)
    order = {m: i for i, m in enumerate([*METHODS, *PROBES])}
    rows = []
    for (model, tag, m, W, d), rs in sorted(
        groups.items(), key=lambda kv: (kv[0][0] != "tiny", kv[0][1], kv[0][4], kv[0][3], order.get(kv[0][2], 99))
    ):
        fr = [_nan(r["final_reward"]) for r in rs]
        reach = [r["steps_to_level"] for r in rs]
        row = {"model": model, "tag": tag, "method": m, "W": W, "disc": d, "seeds": len(rs), "steps": rs[0]["steps"]}
        row["final_reward"] = float(np.mean(fr))
        row["final_reward_sd"] = float(np.std(fr, ddof=1)) if len(fr) > 1 else math.nan
        row["final_reward_ci95"] = ci95(fr)
        row["collapsed"] = sum(bool(r.get("collapsed", False)) for r in rs)
        row["clip_frac_step_max"] = finite_mean([_nan(r.get("clip_frac_step_max")) for r in rs])
        row["clip_grad_removed_frac"] = finite_mean([_nan(r.get("clip_grad_removed_frac")) for r in rs])
        row["reward_first"] = finite_mean([_nan(r["reward_first"]) for r in rs])
        for k in ("reward_before_heldout", "reward_after_heldout"):
            row[k] = finite_mean([_nan(r.get(k)) for r in rs])
        row["steps_to_level"] = finite_mean([float(x) for x in reach if x is not None])
        row["reached_level"] = sum(x is not None for x in reach)
        for k in ("mask_kept_fraction", "mask_kept_fraction_min", "clip_frac_low", "clip_frac_high", "exact_token_fraction",
                  "proxy_abs_err", "discrepancy_kl", "ewma_resets", "oldlogit_bytes", "ewma_bytes",
                  "old_logits_s", "ewma_s", "extra_s_per_step", "train_s", "staleness_mean", "wall_s"):  # fmt: skip
            row[k] = finite_mean([_nan(r.get(k)) for r in rs])
        rows.append(row)
    return rows


def _f(x: float, fmt: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def table_markdown(rows: list[dict[str, Any]]) -> str:
    """The results table (one line per method x W x discrepancy)."""
    head = (
        "| method | W | mismatch | seeds | reward start -> final (sd) | held-out before -> after | steps to "
        f"{REWARD_LEVEL} | mask kept (min) | clip low / high | exact | proxy err (nats) | EWMA resets | "
        "old-logit MiB (snap + EWMA) | extra s/step | train s/step | wall s | final 95% CI | collapsed | "
        "largest step clip | gradient clipped |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        sd = f" ({_f(r['final_reward_sd'])})" if math.isfinite(r["final_reward_sd"]) else ""
        reach = (
            f"{_f(r['steps_to_level'], '.0f')} ({r['reached_level']}/{r['seeds']})"
            if r["reached_level"]
            else f"> {r['steps']}"
        )
        mib = f"{_f(r['oldlogit_bytes'] / 2**20, '.1f')} + {_f(r['ewma_bytes'] / 2**20, '.1f')}"
        lines.append(
            f"{_label(r['method'], r.get('tag', ''), r['W'], r['disc'], r.get('model', 'tiny'))} {r['seeds']} | {_f(r['reward_first'])} -> "
            f"{_f(r['final_reward'])}{sd} | {_f(r['reward_before_heldout'])} -> {_f(r['reward_after_heldout'])} | {reach} | "
            f"{_f(r['mask_kept_fraction'])} ({_f(r['mask_kept_fraction_min'])}) | "
            f"{_f(r['clip_frac_low'])} / {_f(r['clip_frac_high'])} | {_f(r['exact_token_fraction'], '.2f')} | "
            f"{_f(r['proxy_abs_err'], '.4f')} | {_f(r['ewma_resets'], '.0f')} | {mib} | "
            f"{_f(r['extra_s_per_step'], '.2f')} | {_f(r['train_s'], '.2f')} | {_f(r['wall_s'], '.0f')} | "
            f"+-{_f(r.get('final_reward_ci95', math.nan))} | {r.get('collapsed', 0)}/{r['seeds']} | "
            f"{_f(r.get('clip_frac_step_max', math.nan))} | {_f(r.get('clip_grad_removed_frac', math.nan))} |"
        )
    return head + "\n".join(lines) + "\n"


def _pct(x: float) -> str:
    """``x`` as a percentage with one decimal; ``-`` when not finite."""
    return "-" if not math.isfinite(x) else f"{100 * x:.1f}%"


def _ci(values: list[float]) -> str:
    """``mean (+-half-width)`` of the finite values, the interval as :func:`ci95`; ``-`` when none."""
    xs = [x for x in values if math.isfinite(x)]
    if not xs:
        return "-"
    half = ci95(xs)
    return f"{np.mean(xs):.3f}" + (f" (+-{half:.3f})" if math.isfinite(half) else "")


def seeds_markdown(records: list[dict[str, Any]]) -> str:
    """The per-seed table: one line per (model, tag, W, mismatch, method), best final reward first
    within each configuration, every run's value by seed beside the pooled figures.

    Columns: final reward (mean of the last :data:`LAST_K` batch rewards) as mean with its 95%
    interval (:func:`ci95`), median and range, and per seed; held-out after as mean with interval and
    per seed as before -> after; versions to :data:`REWARD_LEVEL` (runs that reached it); collapsed
    runs; the largest per-step clipped share (max over runs); the clipped gradient share (mean over
    runs); entropy at the end per seed (nats); the share of trained sequences whose tokens came from
    more than one version (partial rollouts; mean over runs, ``-`` for runs recorded without it);
    old-logit MiB (snapshot + EWMA, mean); extra seconds per step as the median over runs (a run that shared the box is one outlier, not a shift).
    """
    groups = _by_configuration(records)
    final = {k: np.mean([_nan(r["final_reward"]) for r in rs]) for k, rs in groups.items()}
    head = (
        "| method | W | mismatch | seeds | final reward, mean (95% CI) | median (range) | per seed | "
        "held-out after, mean (95% CI) | held-out before -> after per seed | versions to "
        f"{REWARD_LEVEL} | collapsed | largest step clip (any run) | gradient clipped | entropy at the end (nats) | "
        "sequences spanning versions | old-logit MiB (snap + EWMA) | extra s/step (median) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for k in sorted(groups, key=lambda k: (k[0] != "tiny", k[1], k[4], k[3], -final[k], k[2])):
        model, tag, method, W, disc = k
        rs = sorted(groups[k], key=lambda r: r["seed"])
        fr = [_nan(r["final_reward"]) for r in rs]
        after = [_nan(r.get("reward_after_heldout")) for r in rs]
        reach = [r["steps_to_level"] for r in rs if r["steps_to_level"] is not None]
        seeds = ", ".join(f"s{r['seed']} {_f(x)}" for r, x in zip(rs, fr, strict=True))
        held = ", ".join(
            f"s{r['seed']} {_f(_nan(r.get('reward_before_heldout')))} -> {_f(x)}"
            for r, x in zip(rs, after, strict=True)
        )
        entropy = ", ".join(f"s{r['seed']} {_f(_nan(r.get('entropy_last')), '.2f')}" for r in rs)
        mib = " + ".join(
            _f(finite_mean([_nan(r.get(b)) for r in rs]) / 2**20, ".1f") for b in ("oldlogit_bytes", "ewma_bytes")
        )
        lines.append(
            f"{_label(method, tag, W, disc, model)} {len(rs)} | {_ci(fr)} | {_f(float(np.median(fr)))} ({_f(min(fr))}-{_f(max(fr))}) | {seeds} | "
            f"{_ci(after)} | {held} | {_f(float(np.mean(reach)), '.0f') if reach else '-'} ({len(reach)}/{len(rs)}) | "
            f"{sum(bool(r.get('collapsed', False)) for r in rs)}/{len(rs)} | "
            f"{_f(max((_nan(r.get('clip_frac_step_max')) for r in rs), default=math.nan))} | "
            f"{_pct(finite_mean([_nan(r.get('clip_grad_removed_frac')) for r in rs]))} | {entropy} | "
            f"{_pct(finite_mean([_nan(r.get('spanning_frac')) for r in rs]))} | {mib} | "
            f"{_f(float(np.median([_nan(r.get('extra_s_per_step')) for r in rs])), '.2f')} |"
        )
    return head + "\n".join(lines) + "\n"


def plot(records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Reward curves per method (one panel per W x mismatch), final reward vs W, mask kept fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    real = [r for r in records if r["method"] in METHODS and not r.get("tag")]
    panels = sorted({(r.get("model", "tiny"), r["disc"], r["W"]) for r in real})
    if not panels:
        return paths
    colors = {m: f"C{i}" for i, m in enumerate(METHODS)}

    def curves(rs: list[dict[str, Any]], key: str) -> dict[str, np.ndarray]:
        by: dict[str, list[list[float]]] = {}
        for r in rs:
            by.setdefault(r["method"], []).append(r["curves"][key])
        out = {}
        for m, cs in by.items():
            n = min(len(c) for c in cs)
            out[m] = np.nanmean(np.array([[_nan(x) for x in c[:n]] for c in cs], dtype=float), axis=0)
        return out

    ncol = min(4, len(panels))
    nrow = -(-len(panels) // ncol)
    for key, fname, ylabel in (("reward_mean", "reward_curves.png", "batch reward"),
                               ("mask_kept_fraction", "mask_kept.png", "discrepancy-mask kept fraction")):  # fmt: skip
        fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.3 * nrow), squeeze=False, sharey=True)
        for ax, (model, d, W) in zip(axes.flat, panels, strict=False):
            same = [r for r in real if (r.get("model", "tiny"), r["disc"], r["W"]) == (model, d, W)]
            for m, c in curves(same, key).items():
                ax.plot(np.arange(1, len(c) + 1), c, label=m, color=colors[m], lw=1.4)
            ax.set_title(f"W={W}, {d}" + ("" if model == "tiny" else f", {model}"))
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        for ax in axes.flat[len(panels) :]:
            ax.axis("off")
        axes[0, 0].set_ylabel(ylabel)
        handles = {}
        for ax in axes.flat:
            for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(lab, h)
        labels = [m for m in METHODS if m in handles]
        fig.legend([handles[m] for m in labels], labels, loc="lower center", ncol=len(labels), fontsize=8)
        fig.tight_layout(rect=(0, 0.08 if nrow == 1 else 0.04, 1, 1))
        p = out_dir / fname
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    rows = aggregate(real)
    sweep = [r for r in rows if r["disc"] == "bf16" and r["model"] == "tiny"]
    if len({r["W"] for r in sweep}) > 1:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for m in METHODS:
            pts = sorted((r["W"], r["final_reward"], r["final_reward_sd"]) for r in sweep if r["method"] == m)
            if len(pts) > 1:
                ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[0 if math.isnan(p[2]) else p[2] for p in pts],
                            marker="o", label=m, color=colors[m], capsize=3)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max staleness W")
        ax.set_ylabel(f"final reward (mean of last {LAST_K} steps)")
        ax.set_title("bf16 rollout vs fp32 learner")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = out_dir / "staleness_sweep.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def folder_records(out_dir: Path) -> list[dict[str, Any]]:
    """Every cell recorded in ``out_dir/cells`` that ran all its steps (grids run into one folder add
    up), by name; one stopped by a signal before its last step is left out."""
    recs = [json.loads(p.read_text()) for p in sorted((Path(out_dir) / "cells").glob("*.json"))]
    return [r for r in recs if r.get("state") == "finished" and r.get("steps_done") == r.get("steps")]


def write_outputs(records: list[dict[str, Any]], out_dir: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """``table.md``, ``seeds.md`` (:func:`seeds_markdown`), ``results.json`` and the plots for
    ``records``; a ``README.md`` stub if none."""
    rows = aggregate(records)
    table = table_markdown(rows)
    (out_dir / "table.md").write_text(table)
    (out_dir / "seeds.md").write_text(seeds_markdown(records))
    result = {"meta": meta, "rows": rows, "cells": [{k: v for k, v in r.items() if k != "curves"} for r in records]}
    (out_dir / "results.json").write_text(json.dumps(result, indent=1, default=_json_default))
    result["plots"] = [str(p) for p in plot(records, out_dir)]
    if not (out_dir / "README.md").is_file():
        (out_dir / "README.md").write_text(f"# Methods comparison ({meta['grid']} grid)\n\n{table}")
    return result
