"""Peak resident memory of a whole job, part by part, for settings that trade memory for time.

Each variant is a short run of the demo config (``--steps`` versions, the demo's own held-out
evaluation before training and at the end included) in its own ``vintage run`` process, one after
the other on a quiet machine (:func:`benchmarks.demo_seeds.run_seed`: folder
``<runs>/demo-mem-<variant>-s<seed>``, read back when it finished before). Variants (``--variants``,
each its ``--set`` items on top of the config):

* ``default``: the config as it is, under the job's environment defaults (glibc's mmap threshold
  at 1 MiB: :data:`trainer.driver.cluster.environment.MMAP_THRESHOLD_BYTES`);
* ``checkpointing``: ``learner.gradient_checkpointing = true`` (each decoder layer recomputed in
  backward, only its input kept);
* ``kv1``: ``rollout.kv_cache_gib = 1`` (the vLLM worker's KV cache, GiB);
* ``both``: the two together;
* ``mmap``, ``mmap8m``: every process started with ``MALLOC_MMAP_THRESHOLD_`` at 64 KiB or 8 MiB
  instead (glibc serves every block of at least that size by ``mmap`` and returns it to the system
  when freed; the smaller ones come from the heap, whose freed blocks stay resident).

Per variant, from ``summary.json`` (``peak_rss_gib``: the largest resident set seen at a step, by
part) and ``metrics.jsonl``: the peak GiB of the learner, the rollout workers (each worker's process
and its engine's), the old-logit service, the driver and the whole job (the driver's process tree:
the private Ray cluster's daemons included; pages shared between processes count once per
process), the median learner step (``train_s``, steps after the first) and the loop's seconds per
step. The table sets them side by side (:func:`benchmarks.bench_reference.table`).

    python -m benchmarks.bench_job_memory --seed 1 --steps 8 --out results/job_memory.json
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.bench_reference import median_after_first, save
from benchmarks.demo_seeds import CONFIG, run_outputs, run_seed

VARIANTS: dict[str, tuple[str, ...]] = {
    "default": (),
    "checkpointing": ("learner.gradient_checkpointing=true",),
    "kv1": ("rollout.kv_cache_gib=1",),
    "both": ("learner.gradient_checkpointing=true", "rollout.kv_cache_gib=1"),
    "mmap": (),
    "mmap8m": (),
}
"""Each variant's ``--set`` items on top of the config."""
VARIANT_ENV: dict[str, dict[str, str]] = {
    name: {"MALLOC_MMAP_THRESHOLD_": str(threshold)} for name, threshold in (("mmap", 64 << 10), ("mmap8m", 8 << 20))
}
"""The environment variables a variant's run gets (every process of the job inherits them)."""
PARTS = ("learner", "workers", "oldlogit", "driver", "job")


def memory_record(summary: dict[str, Any], rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One variant's figures from its ``summary.json`` and its learner-step rows.

    Example: ``peak_rss_gib`` {"learner": 8.5, "job": 19.6} and steps with ``train_s`` 9, 5, 7 give
    ``learner_gib`` 8.5, ``job_gib`` 19.6, ``workers_gib`` None and ``train_s_median`` 6.0 (the
    first step left out)."""
    peak = summary.get("peak_rss_gib") or {}
    return {
        "state": summary.get("state"),
        "steps": summary.get("steps"),
        **{f"{p}_gib": peak.get(p) for p in PARTS},
        "train_s_median": median_after_first(rows, "train_s"),
        "loop_s_per_step": summary.get("loop_s_per_step"),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8, help="controller.total_steps of each run")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--runs", type=Path, default=Path("runs"))
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--out", type=Path, default=Path("runs/bench/job_memory.json"))
    a = ap.parse_args(argv)
    sets = [f"controller.total_steps={a.steps}"]
    records = {}
    for name in a.variants:
        env = VARIANT_ENV.get(name)
        run_dir = run_seed(a.seed, a.runs, a.config, [*sets, *VARIANTS[name]], f"mem-{name}", env)
        records[name] = memory_record(*run_outputs(run_dir))
    variants = {k: {"sets": list(VARIANTS[k]), "env": VARIANT_ENV.get(k, {})} for k in a.variants}
    return save(
        a.out, {"seed": a.seed, "config": a.config, "sets": sets, "variants": variants, "records": records}, records
    )


if __name__ == "__main__":
    main()
