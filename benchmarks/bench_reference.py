"""Where the KL reference costs least: scored by the learner, or by the old-logit service beside the old logits.

Two runs of the demo config with a KL penalty (``loss.kl_coef``), one after the other on a quiet
machine, identical but for ``oldlogit.score_reference``: ``learner`` (a frozen copy of version 0 in
the learner, one no-grad forward over each batch before its first optimizer step) and ``service``
(the old-logit service keeps version 0 pinned and scores each batch under it in the request that
asks for the batch's old logits, while the learner trains the batch before). Each run is
``vintage run`` in its own process (:func:`benchmarks.demo_seeds.run_seed`: folder
``<runs>/demo-ref-<placement>-s<seed>``, read back when it finished before).

Per placement, from ``summary.json`` and ``metrics.jsonl`` (:func:`placement_record`): the learner
steps, the medians over steps after the first (start-up excluded) of the learner's step
(``train_s``), its reference forward (``ref_forward_s``) and the driver's wait for the old-logit
answer before launching a step (``old_logits_s``), the loop seconds per step, and the peak resident
GiB of the learner, the old-logit service and the whole job. The table sets them side by side.

    python -m benchmarks.bench_reference --seed 1 --steps 12 --out results/reference_placement.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.demo_seeds import CONFIG, run_outputs, run_seed

PLACEMENTS = {"learner": "false", "service": "true"}
"""``oldlogit.score_reference`` of each placement."""
STEP_KEYS = ("train_s", "ref_forward_s", "old_logits_s")


def median_after_first(rows: Sequence[dict[str, Any]], key: str) -> float:
    """Median of ``key`` over the learner steps after the first (NaN with none)."""
    vals = [float(r[key]) for r in rows[1:] if key in r]
    return statistics.median(vals) if vals else float("nan")


def placement_record(summary: dict[str, Any], rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One placement's figures from its ``summary.json`` and its learner-step rows.

    Example: steps with ``train_s`` 9, 5, 7 give a median of 6.0 (the first step left out)."""
    peak = summary.get("peak_rss_gib") or {}
    return {
        "state": summary.get("state"),
        "steps": summary.get("steps"),
        **{f"{k}_median": median_after_first(rows, k) for k in STEP_KEYS},
        "loop_s_per_step": summary.get("loop_s_per_step"),
        "learner_gib": peak.get("learner"),
        "oldlogit_gib": peak.get("oldlogit"),
        "job_gib": peak.get("job"),
    }


def table(records: dict[str, dict[str, Any]]) -> str:
    """The placements side by side, one row per figure."""
    keys = [k for k in next(iter(records.values())) if k != "state"]
    lines = ["| figure | " + " | ".join(records) + " |", "|---|" + "---|" * len(records)]
    for k in keys:
        cells = [f"{v[k]:.3f}" if isinstance(v[k], float) else str(v[k]) for v in records.values()]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def save(path: Path, out: dict[str, Any], records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Write ``out`` as JSON to ``path`` and print ``records`` side by side (:func:`table`); returns ``out``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(table(records))
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12, help="controller.total_steps of each run")
    ap.add_argument("--kl-coef", type=float, default=0.01)
    ap.add_argument("--runs", type=Path, default=Path("runs"))
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--out", type=Path, default=Path("runs/bench/reference_placement.json"))
    a = ap.parse_args(argv)
    sets = [f"loss.kl_coef={a.kl_coef}", f"controller.total_steps={a.steps}", "controller.eval_every=0"]
    records = {}
    for name, flag in PLACEMENTS.items():
        run_dir = run_seed(a.seed, a.runs, a.config, [*sets, f"oldlogit.score_reference={flag}"], f"ref-{name}")
        records[name] = placement_record(*run_outputs(run_dir))
    return save(a.out, {"seed": a.seed, "config": a.config, "sets": sets, "placements": records}, records)


if __name__ == "__main__":
    main()
