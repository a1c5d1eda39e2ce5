"""Methods x staleness x discrepancy, side by side, on the real pipeline.

Every cell is one real job (``trainer.driver.job.run_job``: vLLM rollout worker, DeepSpeed learner, the
old-logit service, the EWMA, the async controller) on the tiny random model and the procedural
``rollout.envs.toy:AlphabetEnv`` task (reward = fraction of reply characters in ``a``-``m``; the
random model starts at ~0.42, the optimum is 1.0). One Ray session serves the whole grid.

Axes:

* methods (``METHODS``): ``recompute`` (``decoupled_ppo``: reference recomputed at the current
  version), ``loglinear_prox``, ``linear_prox``, ``snapshot`` (exact old logits, EWMA where
  missing), ``ppo_ewma`` (with auto-reset), ``icepop`` (mask on the recompute reference), ``ppo``
  (clip on pi_theta/mu, the floor);
* staleness ``W = controller.max_staleness`` in {1, 2, 4, 8}, enforced by the controller (the
  per-token staleness histogram of every step is kept);
* discrepancy (``DISCREPANCY``): ``bf16`` (vLLM in bfloat16 against the fp32 learner) and
  ``inject`` (bf16 plus ``rollout.inject_mismatch_std``: rollout weights multiplied by
  ``1 + N(0, std)``, a fresh draw per version);
* seeds (``controller.seed``: sampling, data order and the injected noise; the model is the same).

Proxy probes (``PROBES``): a ``snapshot`` run whose configured proxy is another method's reference
(``recompute``, ``linear_prox``, ``loglinear_prox``). Every token has exact old logits there, so the
proxy is never used for the loss (training is the snapshot method's) but the learner measures its
error against the exact reference: ``proxy_abs_err`` = mean |proxy - log pi_old| in nats. The plain
``snapshot`` cell measures the EWMA's error the same way.

Grids:

* ``full`` (the default of ``vintage bench methods``): 7 methods x W {1,2,4,8} x {bf16, inject} x
  3 seeds = 168 runs, plus the proxy probes (3 x 4 W x 3 seeds = 36 runs), 40 steps each. Measured
  here: ~3 min per 32-step run on a 2-core CPU box (vLLM + DeepSpeed start ~20-40 s, 3-5 s per
  step), so ~11 hours; on a GPU machine far less. Cells already finished in ``out_dir`` are
  skipped, so it can be resumed.
* ``quick`` (CI smoke, ~3 min): the 7 methods at W = 1, bf16, one seed, 2 steps.
* ``confirm``: the real model (SmolLM2-135M-Instruct, easy ``basic_arithmetic``, W = 2, bf16) for
  recompute, snapshot and ppo_ewma, 12 steps each (:data:`CONFIRM`); ~8 min per run on 2 CPUs.
* ``reduced`` (what fits in ~1 hour here, 22 runs of 32 steps, one seed; see ``results/methods/README.md``):
  the 7 methods at W = 4 (bf16); recompute / snapshot / ppo_ewma at W = 1, 8 and 2 (bf16); recompute /
  snapshot / ppo_ewma / icepop at W = 4 with injected mismatch; the recompute and log-linear probes at W = 4.
* ``seeds``: seeds 1 and 2 of recompute / snapshot / ppo_ewma at W = 1, 4, 8 (bf16; 18 runs), to put
  a spread over three seeds on the ``reduced`` grid's core rows when run into the same folder.
* ``lr``: recompute / snapshot / ppo_ewma at W = 4 with lr 3e-2 and 3e-3 (tagged rows ``[lr...]``).
* ``eps``: snapshot / ppo_ewma at W = 4 with a wide clip band, eps_low 0.5 / eps_high 1.0.
* ``paper``: the paper's regime (:data:`PAPER`: 4 optimizer steps per rollout batch, lr
  :data:`PAPER_LR`), the 5 methods of :data:`PAPER_METHODS` at W = 2 and 4, bf16, seeds 0-2
  (30 runs of :data:`PAPER_STEPS` versions, rows tagged ``mb4-lr5e-3``, W = 2's three seeds first;
  ~2 hours here).
* ``paper_lr``: recompute and snapshot at W = 2 in that regime with lr 1e-3, 3e-3, 1e-2: which
  learning rate keeps one version mostly inside the clip band (the largest per-step clip fraction).
* ``paper_real``: the same comparison on SmolLM2 and the demo's task (2 mini-batches of 8 per
  16-sample batch, W = 2, 3 seeds, 20 steps; ~2.5 hours here).

Per row: the final reward's mean with its 95% interval over seeds (Student's t), how many runs
collapsed (ended below their first step's reward), the largest clipped fraction of one optimizer
step and the share of the policy-gradient weight on clipped tokens.

Every grid's table covers all finished cells in its ``out_dir``, so grids run into one folder pool.

Outputs in ``out_dir``: ``cells/<cell>.json`` (per run: summary numbers and per-step curves),
``results.json`` (all cells plus the seed-aggregated rows), ``table.md``, and ``reward_curves.png``,
``staleness_sweep.png``, ``mask_kept.png``. Run folders (metrics.jsonl, config) go to
``out_dir/runs/`` (git-ignored); their checkpoints are deleted after each cell.

    vintage bench methods                       # full grid
    vintage bench methods --quick --out /tmp/q  # smoke
    python -m benchmarks.methods --grid reduced --out results/methods
    python -m benchmarks.methods --grid seeds --out results/methods
    python -m benchmarks.methods --grid confirm --out results/methods/confirm
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

METHODS: dict[str, str] = {
    "recompute": "decoupled_ppo",
    "loglinear_prox": "loglinear_prox",
    "linear_prox": "linear_prox",
    "snapshot": "snapshot",
    "ppo_ewma": "ppo_ewma",
    "icepop": "icepop",
    "ppo": "ppo",
}
"""Label in the tables -> ``loss.method`` preset (``trainer.algorithm.loss_config.METHODS``)."""

PROBES: dict[str, str] = {
    "probe_recompute": "recompute",
    "probe_linear": "linear_prox",
    "probe_loglinear": "loglinear_prox",
}
"""Proxy probes: ``snapshot`` method with ``loss.proxy`` set to the given reference (error measured, not used)."""

INJECT_STD = 0.1
"""Injected mismatch. Measured on the tiny model at initialisation (``make_tiny_model(0)``, 32 x 40
random tokens): bf16 alone gives mean |log mu - log pi| ~0.0011 nats; ``1 + N(0, std)`` on top gives
0.005 (std 0.01), 0.010 (0.02), 0.024 (0.05), 0.049 (0.1) nats. 0.1 is ~45x the natural bf16
mismatch of this model and the size measured for bf16 on the real model (~0.045)."""

DISCREPANCY: dict[str, list[str]] = {
    "bf16": ['rollout.dtype="bfloat16"', "rollout.inject_mismatch_std=0.0"],
    "inject": ['rollout.dtype="bfloat16"', f"rollout.inject_mismatch_std={INJECT_STD}"],
}

REWARD_LEVEL = 0.6
"""'Steps to level': first version at which the 3-step moving mean of the batch reward reaches it."""

LAST_K = 5
"""Final reward = mean batch reward over the last ``LAST_K`` steps."""

BASE: list[str] = [
    'model.path="tiny"',
    "model.tiny_seed=0",
    'env.path="rollout.envs.toy:AlphabetEnv"',
    "env.train_seeds=100000",
    "env.eval_prompts=32",
    "rollout.num_workers=1",
    "rollout.max_batch=64",
    "rollout.sampling.max_tokens=6",
    "rollout.sampling.n=8",
    "rollout.sampling.temperature=1.0",
    "controller.batch_groups=4",
    "controller.buffer_capacity=512",
    "learner.lr=1e-2",
    "learner.micro_batch_size=32",
    "oldlogit.memory_budget_bytes=2147483648",
    "server.port=0",
    "logging.trackers=[]",
    "logging.plots=false",
    "ray.num_cpus=6",
]
"""Settings shared by every cell. lr 1e-2 and 6-token replies: measured on this box, decoupled PPO at
W = 1 goes 0.43 -> 0.81 in 30 steps (slower settings barely moved: lr 3e-3, 16 tokens: 0.43 -> 0.45)."""


@dataclass(frozen=True)
class Cell:
    method: str
    W: int
    disc: str
    seed: int
    steps: int
    extra: tuple[str, ...] = ()
    model: str = "tiny"
    tag: str = ""
    """Names a variant of the base settings (e.g. ``lr3e-2``); tagged cells are separate table rows."""

    @property
    def name(self) -> str:
        prefix = "" if self.model == "tiny" else f"{self.model}-"
        suffix = f"-{self.tag}" if self.tag else ""
        return f"{prefix}{self.method}-W{self.W}-{self.disc}-s{self.seed}{suffix}"

    def overrides(self, run_dir: Path) -> list[str]:
        if self.method in PROBES:
            loss = ['loss.method="snapshot"', f'loss.proxy="{PROBES[self.method]}"']
        else:
            loss = [f'loss.method="{METHODS[self.method]}"']
        return (
            BASE
            + DISCREPANCY[self.disc]
            + loss
            + [
                f"controller.max_staleness={self.W}",
                f"controller.seed={self.seed}",
                f"controller.total_steps={self.steps}",
                f'logging.run_dir="{run_dir}"',
            ]
            + list(self.extra)
        )


CONFIRM: tuple[str, ...] = (
    'model.path="smollm2"',
    'env.path="rollout.envs.reasoning_gym_env:ReasoningGymEnv"',
    'env.kwargs={dataset="basic_arithmetic", level="easy", size=2000}',
    "env.train_seeds=1800",
    "env.eval_prompts=64",
    "rollout.kv_cache_gib=2",
    "rollout.sampling.max_tokens=48",
    "controller.batch_groups=2",
    "learner.lr=5e-5",
    "learner.micro_batch_size=16",
)
"""The confirmation run on the real model (the demo's settings: SmolLM2-135M-Instruct, easy
basic_arithmetic, 2 prompts x 8 samples per step, lr 5e-5), applied over :data:`BASE`."""

PAPER: tuple[str, ...] = ("learner.ppo_mini_batches=4", "learner.micro_batch_size=8")
"""The paper's regime: several optimizer steps per rollout batch (4 mini-batches of one 32-sample
batch), so the recompute reference is behind the current policy from the second step on and its
clip acts, exact old logits stay the behaviour version's, and the EWMA moves every step."""

PAPER_LR = "5e-3"
"""Learning rate of the ``paper`` grid. ``paper_lr`` measured, at 4 optimizer steps per version:
1e-2 learns in 32 versions but clips ~20% of recompute's tokens (a version moves the policy out of
the band); 3e-3 clips ~1% and does not move in 32 versions; 5e-3 over :data:`PAPER_STEPS` versions
sits between."""

PAPER_STEPS = 64
"""Versions per ``paper`` run: at half the lr that reaches 0.6 in ~17 versions, about twice as many."""

PAPER_METHODS = ("recompute", "snapshot", "ppo_ewma", "loglinear_prox", "icepop")
"""Methods the paper compares: decoupled PPO (recompute), exact snapshot, PPO-EWMA, the log-linear
proxy and IcePop's mask on the recompute reference."""

PAPER_REAL_STEPS = 20
"""Steps per ``paper_real`` run on SmolLM2 (the demo's task; ~25 s per step with 2 mini-batches here)."""

CONFIRM_STEPS = 12
"""Steps per confirmation run: the demo's batch reward rises from ~0.4 to ~0.7 within ~12 steps."""


def grid(kind: str) -> list[Cell]:
    """The cells of grid ``kind`` (one of :data:`GRIDS`), in run order.

    Raises:
        ValueError: ``kind`` is not one of :data:`GRIDS`.
    """
    core = ("recompute", "snapshot", "ppo_ewma")
    if kind == "confirm":
        return [Cell(m, 2, "bf16", 0, CONFIRM_STEPS, CONFIRM, model="smollm2") for m in core]
    if kind == "quick":
        return [Cell(m, 1, "bf16", 0, 2, ("env.eval_prompts=4",)) for m in METHODS]
    if kind == "full":
        return [
            Cell(m, W, d, s, 40)
            for s in (0, 1, 2)
            for d in DISCREPANCY
            for W in (1, 2, 4, 8)
            for m in [*METHODS, *(PROBES if d == "bf16" else ())]
        ]
    if kind == "reduced":
        cells = [Cell(m, 4, "bf16", 0, REDUCED_STEPS) for m in METHODS]
        cells += [Cell(m, W, "bf16", 0, REDUCED_STEPS) for W in (1, 8, 2) for m in core]
        cells += [Cell(m, 4, "inject", 0, REDUCED_STEPS) for m in (*core, "icepop")]
        cells += [Cell(p, 4, "bf16", 0, REDUCED_STEPS) for p in ("probe_recompute", "probe_loglinear")]
        return cells
    if kind == "seeds":
        return [Cell(m, W, "bf16", s, REDUCED_STEPS) for W in (1, 4, 8) for s in (1, 2) for m in core]
    if kind == "lr":
        return [
            Cell(m, 4, "bf16", 0, REDUCED_STEPS, (f"learner.lr={lr}",), tag=f"lr{lr}")
            for lr in ("3e-2", "3e-3")
            for m in core
        ]
    if kind == "paper":
        extra = (*PAPER, f"learner.lr={PAPER_LR}")
        return [
            Cell(m, W, "bf16", s, PAPER_STEPS, extra, tag=f"mb4-lr{PAPER_LR}")
            for W in (2, 4)
            for s in (0, 1, 2)
            for m in PAPER_METHODS
        ]
    if kind == "paper_lr":
        return [
            Cell(m, 2, "bf16", 0, REDUCED_STEPS, (*PAPER, f"learner.lr={lr}"), tag=f"mb4-lr{lr}")
            for lr in ("1e-3", "3e-3", "1e-2")
            for m in ("recompute", "snapshot")
        ]
    if kind == "paper_real":
        extra = (*CONFIRM, "learner.ppo_mini_batches=2", "learner.micro_batch_size=8")
        return [
            Cell(m, 2, "bf16", s, PAPER_REAL_STEPS, extra, model="smollm2", tag="mb2")
            for s in (0, 1, 2)
            for m in PAPER_METHODS
        ]
    if kind == "eps":
        wide = ("loss.eps_low=0.5", "loss.eps_high=1.0")
        return [Cell(m, 4, "bf16", 0, REDUCED_STEPS, wide, tag="eps0.5-1.0") for m in ("snapshot", "ppo_ewma")]
    raise ValueError(f"grid: unknown kind {kind!r} ({', '.join(GRIDS)})")


GRIDS = ("quick", "reduced", "seeds", "lr", "eps", "full", "confirm", "paper", "paper_lr", "paper_real")
REDUCED_STEPS = 32


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


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return float(np.mean(xs)) if xs else math.nan


def collapsed(final_reward: float, first_reward: float) -> bool:
    """A run collapsed when its final reward (mean batch reward of the last :data:`LAST_K` steps)
    ended below its first step's batch reward: it ended worse than it began."""
    return bool(math.isfinite(final_reward) and math.isfinite(first_reward) and final_reward < first_reward)


def ci95(values: list[float]) -> float:
    """Half-width of the 95% confidence interval of the mean of ``values``: t(0.975, n - 1) * sd / sqrt(n)
    (Student's t, sample sd); NaN with fewer than 2 values. Example: 0.4, 0.6, 0.8 -> 4.303 * 0.2 /
    sqrt(3) = 0.4968."""
    from scipy.stats import t

    xs = [x for x in values if math.isfinite(x)]
    if len(xs) < 2:
        return math.nan
    return float(t.ppf(0.975, len(xs) - 1) * np.std(xs, ddof=1) / math.sqrt(len(xs)))


def cell_record(cell: Cell, rows: list[dict[str, Any]], summary: dict[str, Any], poller: _Poller) -> dict[str, Any]:
    """Per-run numbers from ``metrics.jsonl`` rows and the job summary."""
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
        "final_reward": _mean(reward[-LAST_K:]),
        "reward_first": reward[0] if reward else math.nan,
        "reward_before_heldout": before.get("reward", math.nan),
        "reward_after_heldout": after.get("reward", math.nan),
        "steps_to_level": reach,
        "mask_kept_fraction": _mean(g("mask_kept_fraction")),
        "mask_kept_fraction_min": min((x for x in g("mask_kept_fraction") if math.isfinite(x)), default=math.nan),
        "clip_frac_low": _mean(g("clip_frac_low")),
        "clip_frac_high": _mean(g("clip_frac_high")),
        "clip_frac_step_max": max((x for x in g("clip_frac_step_max") if math.isfinite(x)), default=math.nan),
        "clip_grad_removed_frac": _mean(g("clip_grad_removed_frac")),
        "entropy_last": _mean(g("entropy")[-LAST_K:]),
        "collapsed": collapsed(_mean(reward[-LAST_K:]), reward[0] if reward else math.nan),
        "exact_token_fraction": float(summary.get("exact_token_fraction", math.nan)),
        "proxy_abs_err": _mean(g("proxy_abs_err")),
        "discrepancy_kl": _mean(g("discrepancy_kl")),
        "weight_capped_frac": _mean(g("weight_capped_frac")),
        "ewma_resets": int(summary.get("ewma_resets", 0)),
        "oldlogit_bytes": poller.max_bytes,
        "oldlogit_versions_held": poller.max_versions,
        "ewma_bytes": int(max((x for x in g("ewma_bytes_held") if math.isfinite(x)), default=0)),
        "old_logits_s": _mean(g("old_logits_s")),
        "ewma_s": _mean([float(r.get("ewma_forward_s", 0.0)) + float(r.get("ewma_update_s", 0.0)) for r in rows]),
        "extra_s_per_step": _mean(extra),
        "train_s": _mean(g("train_s")),
        "publish_s": _mean(g("publish_s")),
        "staleness_mean": _mean(g("staleness_mean")),
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
    from trainer.driver.config import load_config
    from trainer.driver.job import run_job
    from trainer.driver.metrics_log import read_metrics

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
    rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    rec = cell_record(cell, rows, summary, poller)
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


def _json_default(o: Any) -> Any:
    if isinstance(o, float | np.floating):
        return None if not math.isfinite(o) else float(o)
    if isinstance(o, np.integer):
        return int(o)
    return str(o)


# -- aggregation, table, plots --------------------------------------------------------------------


def _nan(x: Any) -> float:
    return math.nan if x is None else float(x)


def aggregate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, tag, method, W, disc): means over seeds, final-reward spread (sample sd)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r.get("model", "tiny"), r.get("tag", ""), r["method"], r["W"], r["disc"]), []).append(r)
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
        row["clip_frac_step_max"] = _mean([_nan(r.get("clip_frac_step_max")) for r in rs])
        row["clip_grad_removed_frac"] = _mean([_nan(r.get("clip_grad_removed_frac")) for r in rs])
        row["reward_first"] = _mean([_nan(r["reward_first"]) for r in rs])
        for k in ("reward_before_heldout", "reward_after_heldout"):
            row[k] = _mean([_nan(r.get(k)) for r in rs])
        row["steps_to_level"] = _mean([float(x) for x in reach if x is not None])
        row["reached_level"] = sum(x is not None for x in reach)
        for k in ("mask_kept_fraction", "mask_kept_fraction_min", "clip_frac_low", "clip_frac_high", "exact_token_fraction",
                  "proxy_abs_err", "discrepancy_kl", "ewma_resets", "oldlogit_bytes", "ewma_bytes",
                  "old_logits_s", "ewma_s", "extra_s_per_step", "train_s", "staleness_mean", "wall_s"):  # fmt: skip
            row[k] = _mean([_nan(r.get(k)) for r in rs])
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
            f"| {r['method']}{' [' + r['tag'] + ']' if r.get('tag') else ''} | {r['W']} | {r['disc']}{'' if r.get('model', 'tiny') == 'tiny' else ' (' + r['model'] + ')'} | {r['seeds']} | {_f(r['reward_first'])} -> "
            f"{_f(r['final_reward'])}{sd} | {_f(r['reward_before_heldout'])} -> {_f(r['reward_after_heldout'])} | {reach} | "
            f"{_f(r['mask_kept_fraction'])} ({_f(r['mask_kept_fraction_min'])}) | "
            f"{_f(r['clip_frac_low'])} / {_f(r['clip_frac_high'])} | {_f(r['exact_token_fraction'], '.2f')} | "
            f"{_f(r['proxy_abs_err'], '.4f')} | {_f(r['ewma_resets'], '.0f')} | {mib} | "
            f"{_f(r['extra_s_per_step'], '.2f')} | {_f(r['train_s'], '.2f')} | {_f(r['wall_s'], '.0f')} | "
            f"+-{_f(r.get('final_reward_ci95', math.nan))} | {r.get('collapsed', 0)}/{r['seeds']} | "
            f"{_f(r.get('clip_frac_step_max', math.nan))} | {_f(r.get('clip_grad_removed_frac', math.nan))} |"
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
    """``table.md``, ``results.json`` and the plots for ``records``; a ``README.md`` stub if none."""
    rows = aggregate(records)
    table = table_markdown(rows)
    (out_dir / "table.md").write_text(table)
    result = {"meta": meta, "rows": rows, "cells": [{k: v for k, v in r.items() if k != "curves"} for r in records]}
    (out_dir / "results.json").write_text(json.dumps(result, indent=1, default=_json_default))
    result["plots"] = [str(p) for p in plot(records, out_dir)]
    if not (out_dir / "README.md").is_file():
        (out_dir / "README.md").write_text(f"# Methods comparison ({meta['grid']} grid)\n\n{table}")
    return result


def run_grid(cells: list[Cell], out_dir: Path, console: Console, grid_name: str) -> dict[str, Any]:
    """Run ``cells`` in one Ray session (reused if already initialised), writing outputs after each.

    The outputs cover every finished cell in ``out_dir`` (this grid's and earlier ones'), so grids
    run into one folder (``reduced``, then ``seeds``) make one table with the seeds pooled per row.
    """
    from trainer.driver.config import load_config
    from trainer.driver.environment import defaults_env
    from trainer.driver.job import ray_session

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
    out_dir: Path = Path("results/methods"), quick: bool = False, console: Console | None = None, kind: str = "full"
) -> dict[str, Any]:
    """``vintage bench methods``: grid ``kind`` (``quick`` when ``quick``); returns the results dict.

    Raises:
        ValueError: ``kind`` is not one of :data:`GRIDS`.
    """
    kind = "quick" if quick else kind
    return run_grid(grid(kind), Path(out_dir), console or Console(), kind)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", default="full", choices=GRIDS)
    ap.add_argument("--out", type=Path, default=Path("results/methods"))
    a = ap.parse_args()
    main(a.out, kind=a.grid)
