"""Tables, pooled rows and plots of the methods grid (:mod:`benchmarks.methods`) from its cell records.

A cell record is the JSON of ``cells/<cell>.json``; rows pool a (model, tag, method, W, disc) over
seeds. Outputs: ``table.md``, ``seeds.md`` (every run by seed), ``paired.md`` (each method minus
decoupled PPO seed by seed, :func:`paired_markdown`), ``results.json`` and the PNG plots in the
grid's folder. They are re-made from a folder's cells without running any job by

    python -m benchmarks.methods_report results/methods/paper_real [more folders]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.methods_grid import (
    BASE,
    LAST_K,
    METHODS,
    PROBES,
    REWARD_LEVEL,
    binomial_se,
    ci95,
    finite_mean,
    heldout_curve_score,
    paired_ci95,
)


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


# -- paired comparison ----------------------------------------------------------------------------

BASELINE = "recompute"
"""The method every other is compared with in ``paired.md``: decoupled PPO (reference recomputed at
the current version)."""

SCORES: dict[str, str] = {
    "heldout_after": "held-out after",
    "heldout_curve": "held-out curve",
    "batch_curve": "batch-reward curve",
}
"""Per-run scores of the paired comparison (key -> column title), see :func:`run_scores`."""

_NO_SCORE: dict[str, str] = {
    "heldout_after": "no run here has a held-out evaluation after training",
    "heldout_curve": "no run here was evaluated during training (`controller.eval_every`), only before and after",
    "batch_curve": "no record here carries its per-version batch reward",
}


def run_scores(rec: dict[str, Any]) -> dict[str, float]:
    """The scores of one run (a cell record), each in reward units ([0, 1]):

    * ``heldout_after``: mean held-out reward after training (the final point);
    * ``heldout_curve``: :func:`benchmarks.methods_grid.heldout_curve_score` of its pinned held-out
      evaluations (``heldout_evals``), NaN for a run evaluated only before and after;
    * ``batch_curve``: mean batch reward over all its versions (``curves.reward_mean``; training
      prompts, sampled by the versions the batch carried), NaN without a curve.
    """
    return {
        "heldout_after": _nan(rec.get("reward_after_heldout")),
        "heldout_curve": heldout_curve_score(rec.get("heldout_evals") or []),
        "batch_curve": finite_mean([_nan(x) for x in (rec.get("curves") or {}).get("reward_mean", [])]),
    }


def heldout_prompts(rec: dict[str, Any]) -> int:
    """Held-out episodes in one evaluation of run ``rec``: its ``heldout_n`` where recorded, else the
    last ``env.eval_prompts=`` of its settings (:data:`benchmarks.methods_grid.BASE`, then the
    cell's ``extra``, which the cell applies last); 0 when neither says."""
    if rec.get("heldout_n"):
        return int(rec["heldout_n"])
    for o in reversed([*BASE, *(rec.get("extra") or [])]):
        if o.replace(" ", "").startswith("env.eval_prompts="):
            return int(o.split("=", 1)[1])
    return 0


def _eval_var(rec: dict[str, Any], score: str) -> float:
    """Evaluation variance of one run's ``score`` (binomial, :func:`binomial_se` squared): of the
    held-out point after training, or of the mean of the k curve evaluations (sum of their variances
    / k^2, the evaluations independent); NaN for the batch-reward curve and where undefined."""
    n = heldout_prompts(rec)
    if score == "heldout_after":
        return binomial_se(_nan(rec.get("reward_after_heldout")), n) ** 2
    if score == "heldout_curve" and math.isfinite(heldout_curve_score(rec.get("heldout_evals") or [])):
        pn = [(_nan(e.get("held_out")), int(e.get("n") or n)) for e in rec["heldout_evals"] if int(e["version"]) > 0]
        pn = [(p, k) for p, k in pn if math.isfinite(p)]
        return sum(binomial_se(p, k) ** 2 for p, k in pn) / len(pn) ** 2
    return math.nan


def paired_rows(records: list[dict[str, Any]], baseline: str = BASELINE) -> list[dict[str, Any]]:
    """The paired comparison: per configuration (model, tag, W, disc) that has ``baseline`` runs,
    one row per method (``baseline`` first, then in :data:`METHODS` / :data:`PROBES` order) with
    its seeds, collapsed runs (``collapsed`` of the records, :func:`benchmarks.methods_grid.collapsed`),
    held-out episodes per evaluation (:func:`heldout_prompts`) and, for every score of
    :func:`run_scores`: per-seed values, unpaired mean with its 95% half-width (:func:`ci95`), sample
    sd over seeds, the paired difference to ``baseline`` (:func:`benchmarks.methods_grid.paired_ci95`;
    None on the baseline's own row), the sample sd of those differences (``diff_sd``) beside the sd a
    difference of independent runs would have, sqrt(sd^2 + sd_baseline^2) (``unpaired_diff_sd``), and
    the evaluation noise: ``eval_se`` = sqrt of the mean over runs of each run's evaluation variance
    (:func:`_eval_var`), NaN where the score has no binomial error.
    """
    groups = _by_configuration(records)
    order = {m: i for i, m in enumerate([*METHODS, *PROBES])}
    configs = sorted({(k[0], k[1], k[3], k[4]) for k in groups}, key=lambda c: (c[0] != "tiny", c[1], c[3], c[2]))
    rows = []
    for model, tag, W, disc in configs:
        base = groups.get((model, tag, baseline, W, disc))
        if not base:
            continue
        base_scores = {sc: {r["seed"]: run_scores(r)[sc] for r in base} for sc in SCORES}
        base_sd: dict[str, float] = {}
        methods = sorted(
            {k[2] for k in groups if (k[0], k[1], k[3], k[4]) == (model, tag, W, disc)},
            key=lambda m: (m != baseline, order.get(m, 99), m),
        )
        for m in methods:
            rs = sorted(groups[(model, tag, m, W, disc)], key=lambda r: r["seed"])
            row: dict[str, Any] = {"model": model, "tag": tag, "W": W, "disc": disc, "method": m,
                                   "baseline": baseline, "seeds": [r["seed"] for r in rs],
                                   "collapsed": sum(bool(r.get("collapsed", False)) for r in rs),
                                   "heldout_n": sorted({heldout_prompts(r) for r in rs}), "scores": {}}  # fmt: skip
            for sc in SCORES:
                vals = {r["seed"]: run_scores(r)[sc] for r in rs}
                xs = [x for x in vals.values() if math.isfinite(x)]
                var = [v for v in (_eval_var(r, sc) for r in rs) if math.isfinite(v)]
                sd = float(np.std(xs, ddof=1)) if len(xs) > 1 else math.nan
                paired = None if m == baseline else paired_ci95(vals, base_scores[sc])
                base_sd.setdefault(sc, sd)  # the baseline's row comes first
                diffs = paired["diffs"] if paired is not None else []
                row["scores"][sc] = {
                    "values": [vals[s] for s in row["seeds"]],
                    "mean": finite_mean(xs),
                    "ci95": ci95(xs),
                    "sd": sd,
                    "eval_se": math.sqrt(float(np.mean(var))) if var else math.nan,
                    "paired": paired,
                    "diff_sd": float(np.std(diffs, ddof=1)) if len(diffs) > 1 else math.nan,
                    "unpaired_diff_sd": math.nan if paired is None else math.hypot(sd, base_sd[sc]),
                }
            rows.append(row)
    return rows


def _signed(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:+.3f}"


def _mean_ci(mean: float, half: float) -> str:
    """``mean (+-half)``; the half-width left out where undefined; ``-`` without a mean."""
    if not math.isfinite(mean):
        return "-"
    return f"{mean:.3f}" + (f" (+-{half:.3f})" if math.isfinite(half) else "")


def _diff_cells(row: dict[str, Any], sc: str) -> str:
    """The two difference columns of score ``sc``: per seed, and the mean difference with its paired
    95% half-width, ``*`` when the interval excludes 0; the baseline's own values on its row."""
    s = row["scores"][sc]
    if s["paired"] is None:
        vals = ", ".join(f"s{seed} {_f(x)}" for seed, x in zip(row["seeds"], s["values"], strict=True))
        return f"baseline: {vals} | - |"
    p = s["paired"]
    if not p["seeds"]:
        return "- | - |"
    per = ", ".join(f"s{seed} {_signed(d)}" for seed, d in zip(p["seeds"], p["diffs"], strict=True))
    star = " *" if math.isfinite(p["ci95"]) and abs(p["mean"]) > p["ci95"] else ""
    half = f" (+-{p['ci95']:.3f})" if math.isfinite(p["ci95"]) else ""
    return f"{per} | {_signed(p['mean'])}{half}{star} |"


def _ratio(a: float, b: float) -> str:
    return "-" if not (math.isfinite(a) and math.isfinite(b)) or b == 0 else f"{a / b:.2f}"


def paired_markdown(rows: list[dict[str, Any]]) -> str:
    """``paired.md`` from :func:`paired_rows`: per configuration, a table of each method's scores
    (unpaired mean with its 95% interval) beside its per-seed differences to the baseline and their
    paired 95% interval, then a table of evaluation noise (binomial standard error of one evaluation)
    beside the run-to-run spread (sample sd over seeds) and the sd of the paired differences (with,
    in brackets, the sd of a difference of independent runs: pairing helps where it is larger). A
    score no run of a configuration has (a held-out curve without evaluations during training) is
    left out of its tables and named below them with the reason."""
    base = rows[0]["baseline"] if rows else BASELINE
    out = [
        f"# Paired comparison with decoupled PPO (`{base}`)\n",
        f"Runs of different methods with the same seed share prompts, sampling seeds and initial weights, so each "
        f"method is compared with `{base}` seed by seed: d_s = score(method, seed s) - score({base}, seed s), and the "
        "95% interval of the mean difference is the paired Student's t over the n seeds both ran, "
        "t(0.975, n - 1) * sd(d) / sqrt(n) (`benchmarks.methods_grid.paired_ci95`; t = 4.303 for 3 seeds, 2.776 "
        "for 5). `*` marks an interval that excludes 0. The unpaired means carry the interval of `seeds.md` "
        "(t over seeds, each method alone).\n",
        "Scores (reward units, [0, 1]): **held-out after** = held-out reward after training (the final point); "
        "**held-out curve** = mean of the pinned held-out evaluations at versions > 0 (during training and "
        "after; `benchmarks.methods_grid.heldout_curve_score`); **batch-reward curve** = mean batch reward over "
        "all versions (training prompts). *collapsed* = runs whose last "
        f"{LAST_K} versions' batch reward ended below the first step's, as in `table.md`.\n",
        "Evaluation noise: the binomial standard error of one held-out evaluation of n prompts, sqrt(p (1 - p) / n) "
        "(an upper bound for rewards in [0, 1] that are not 0/1), as the root mean square over a row's runs; for the "
        "curve, of the mean of its k evaluations (/ sqrt(k), the evaluations independent). Run-to-run spread: the "
        "sample sd of the score over seeds. Where SE / sd is well below 1, the spread is the runs', not the "
        f"evaluation's. The sd of the differences to `{base}` is given beside, in brackets, "
        f"sqrt(sd^2 + sd({base})^2), what it would be were the two runs of a seed independent: pairing narrows "
        "the interval where the first is the smaller.\n",
        "    python -m benchmarks.methods_report <this folder>\n",
    ]
    configs: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        configs.setdefault((r["model"], r["tag"], r["W"], r["disc"]), []).append(r)
    for (model, tag, W, disc), rs in configs.items():
        shown = [sc for sc in SCORES if any(math.isfinite(r["scores"][sc]["mean"]) for r in rs)]
        missing = [sc for sc in SCORES if sc not in shown]
        title = f"{model}{' [' + tag + ']' if tag else ''}, W = {W}, {disc}"
        out.append(f"## {title}\n")
        head = "| method | seeds | collapsed |" + "".join(
            f" {SCORES[sc]}: mean (95% CI) | minus {base}, per seed | mean difference (95% CI, paired) |"
            for sc in shown
        )
        lines = [head, "|" + "---|" * (3 + 3 * len(shown))]
        for r in rs:
            cells = "".join(
                f" {_mean_ci(r['scores'][sc]['mean'], r['scores'][sc]['ci95'])} | {_diff_cells(r, sc)}" for sc in shown
            )
            lines.append(f"| {r['method']} | {len(r['seeds'])} | {r['collapsed']}/{len(r['seeds'])} |{cells}")
        out.append("\n".join(lines) + "\n")
        noisy = [sc for sc in shown if sc != "batch_curve"]
        head = "| method | held-out prompts n |" + "".join(
            f" {SCORES[sc]}: eval SE | run-to-run sd | SE / sd | sd of differences to {base} (unpaired) |"
            for sc in noisy
        )
        lines = [head, "|" + "---|" * (2 + 4 * len(noisy))]
        for r in rs:
            cells = ""
            for sc in noisy:
                s = r["scores"][sc]
                dsd = _f(s["diff_sd"]) + (f" ({_f(s['unpaired_diff_sd'])})" if math.isfinite(s["diff_sd"]) else "")
                cells += f" {_f(s['eval_se'])} | {_f(s['sd'])} | {_ratio(s['eval_se'], s['sd'])} | {dsd} |"
            n = "/".join(str(x) for x in r["heldout_n"]) or "-"
            lines.append(f"| {r['method']} | {n} |{cells}")
        if noisy:
            out.append("Evaluation noise and run-to-run spread:\n\n" + "\n".join(lines) + "\n")
        out.extend(f"No {SCORES[sc]} score: {_NO_SCORE[sc]}.\n" for sc in missing)
    if not rows:
        out.append(f"No configuration here has `{base}` runs to compare with.\n")
    return "\n".join(out)


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
    """``table.md``, ``seeds.md`` (:func:`seeds_markdown`), ``paired.md`` (:func:`paired_markdown`),
    ``results.json`` (``meta``, ``rows``, ``paired``: the rows of :func:`paired_rows` with their
    baseline, ``cells``) and the plots for ``records``; a ``README.md`` stub if none."""
    rows = aggregate(records)
    table = table_markdown(rows)
    paired = paired_rows(records)
    (out_dir / "table.md").write_text(table)
    (out_dir / "seeds.md").write_text(seeds_markdown(records))
    (out_dir / "paired.md").write_text(paired_markdown(paired))
    result = {
        "meta": meta,
        "rows": rows,
        "paired": {"baseline": BASELINE, "rows": paired},
        "cells": [{k: v for k, v in r.items() if k != "curves"} for r in records],
    }
    (out_dir / "results.json").write_text(json.dumps(result, indent=1, default=_json_default))
    result["plots"] = [str(p) for p in plot(records, out_dir)]
    if not (out_dir / "README.md").is_file():
        (out_dir / "README.md").write_text(f"# Methods comparison ({meta['grid']} grid)\n\n{table}")
    return result


def report(out_dir: Path) -> dict[str, Any]:
    """Re-make the outputs of a grid folder (:func:`write_outputs`) from its finished cell records
    (:func:`folder_records`) without running any job; ``meta`` is the folder's ``results.json``'s
    where there is one, else ``{"grid": <folder name>}``.

    Raises:
        FileNotFoundError: ``out_dir`` has no ``cells`` folder.
    """
    out_dir = Path(out_dir)
    if not (out_dir / "cells").is_dir():
        raise FileNotFoundError(f"{out_dir / 'cells'}: no cell records to report")
    prev = out_dir / "results.json"
    meta = json.loads(prev.read_text())["meta"] if prev.is_file() else {"grid": out_dir.name}
    return write_outputs(folder_records(out_dir), out_dir, meta)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Re-make a methods grid folder's tables from its cells/*.json (no run).")
    ap.add_argument("folders", nargs="+", type=Path)
    for folder in ap.parse_args().folders:
        res = report(folder)
        print(
            f"{folder}: {len(res['cells'])} cells, {len(res['paired']['rows'])} paired rows -> {folder / 'paired.md'}"
        )
