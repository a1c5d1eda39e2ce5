"""What a job reports: each step's row and line, the ``/v1/status`` fields and the run's summary
(the rollout workers' notes are :mod:`trainer.driver.loop.worker_notes`).

The functions here read the job's parts (:class:`trainer.driver.loop.parts.Job`); only
:func:`step_report` changes anything: it adds to the job's exact-token totals, and reading the
old-logit service's status counts a restart of the service. The loop decides where each report
goes (``metrics.jsonl`` and TensorBoard, the status board, the console, ``summary.json``), except
that :func:`run_summary` prints the best version's line (:func:`best_line`) at the end of the run. The
status never shows NaN: a non-finite number is reported as None.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import psutil
import ray

from modelkit.procmem import tree_rss_bytes
from protocol import EwmaStatus, OldLogitServiceStatus, Trajectory, WorkerStatus
from trainer.driver.records.metrics_log import StepMetrics
from trainer.driver.sources.buffer import spanning_sequences, token_staleness_histogram

if TYPE_CHECKING:
    from trainer.driver.loop.parts import Job
    from trainer.driver.records.heldout import BestEval


def _finite_or_none(x: float | None) -> float | None:
    """``x`` when it is a finite number, else None (the status never shows NaN)."""
    return float(x) if x is not None and np.isfinite(x) else None


@dataclass(frozen=True)
class StepReport:
    """What one step reports: its ``metrics.jsonl`` row, and the old-logit service's and the rollout
    workers' status read for it (``/v1/status`` ``oldlogit`` and ``workers`` after the step; None
    without a service)."""

    metrics: StepMetrics
    oldlogit: OldLogitServiceStatus | None
    workers: list[WorkerStatus]


def step_report(job: Job, batch: list[Trajectory], m: dict[str, Any]) -> StepReport:
    """The step's row of ``metrics.jsonl`` - the learner's metrics ``m`` plus the batch's rewards and
    staleness, the last publication, the old-logit service's restarts and outages so far
    (:meth:`ServiceCalls.record`), the buffer's drop counts and dynamic sampling's group counts so
    far (``filtered_groups``, ``zero_variance_admitted``) - and the service's status, read first
    so that a new service process counts as a restart in the row. Adds to the job's exact-token
    totals.

    Raises:
        pydantic.ValidationError: the learner's metrics lack a field every step has.
        oldlogit_service.calls.ServiceNotBack: the service did not come back within
            ``oldlogit.restart_timeout_s``.
    """
    hist = token_staleness_histogram(batch, int(m["consumed_version"]))
    n = sum(hist.values())
    oldlogit = job.oldlogit_status()  # counts a restart of the service before the row is written
    service = job.route.service_record()
    workers = job.pool.statuses()
    memory = part_memory(m, workers, oldlogit)
    for k, v in memory.items():
        job.peak_rss[k] = max(job.peak_rss.get(k, 0.0), v)
    rewards = [t.reward for t in batch]
    exact = float(m.get("exact_token_fraction", 0.0))
    job.tokens_exact += exact * m["tokens"]
    job.tokens_total += m["tokens"]
    row = StepMetrics(
        **{
            **m,
            "reward_mean": float(np.mean(rewards)),
            "reward_max": float(np.max(rewards)),
            "exact_token_fraction": exact,
            "staleness_mean": sum(k * v for k, v in hist.items()) / max(n, 1),
            "staleness_max": max(hist, default=0),
            "staleness_hist": hist,
            "spanning_seqs": spanning_sequences(batch),
            "publish_s": job.publisher.last.get("seconds", 0.0),
            "publish_bytes": float(job.publisher.last.get("bytes", 0.0)),
            "run_segment": job.run_segment,
            "fingerprint_mismatch": job.fingerprints.mismatches,
            "fingerprint_unverified": job.fingerprints.unverified,
            "filtered_groups": job.buffer.filtered_groups,
            "zero_variance_admitted": job.buffer.zero_variance_admitted,
            **service,
            **{f"rss_{k}_bytes": v for k, v in memory.items() if k != "learner"},
            **{f"dropped_{k}": v for k, v in job.buffer.dropped.items()},
        }
    )
    return StepReport(row, oldlogit, workers)


def part_memory(
    learned: dict[str, Any], workers: list[WorkerStatus], oldlogit: OldLogitServiceStatus | None
) -> dict[str, float]:
    """Resident bytes by part at a step: ``learner`` (rank 0's process, from its metrics),
    ``workers`` (every rollout worker's process and its engine's, summed), ``oldlogit`` (the
    service's), ``driver`` (this process) and ``job`` (this process and every process it started:
    the whole job when its Ray cluster is its own private one). Pages shared between processes
    count once per process."""
    return {
        "learner": float(learned.get("rss_bytes") or 0.0),
        "workers": float(sum(w.rss_bytes for w in workers)),
        "oldlogit": float(oldlogit.rss_bytes if oldlogit is not None else 0),
        "driver": float(psutil.Process().memory_info().rss),
        "job": float(tree_rss_bytes()),
    }


def step_line(m: StepMetrics, version: int) -> str:
    """The console line of a step whose row is ``m``, the learner now at ``version``."""
    kept = m.mask_kept_fraction if m.mask_kept_fraction is not None else float("nan")
    return (
        f"step {m.consumed_version}->{version}  reward {m.reward_mean:.3f}  staleness mean {m.staleness_mean:.2f} "
        f"max {m.staleness_max}  exact {m.exact_token_fraction:.2f}  kept {kept:.2f}  "
        f"loss {m.loss:+.4f}  clip {m.clip_frac_step_max:.2f}  entropy {m.entropy:.2f}  len {m.response_tokens_mean:.0f}  "
        f"zero-var {m.zero_variance_groups}/{m.groups}  "
        + (f"kl_ref {m.kl_ref:.4f}  " if m.kl_ref is not None else "")
        + f"{m.tokens_per_s:.0f} tok/s  train {m.train_s:.1f}s"
    )


def status_fields(
    job: Job,
    oldlogit: OldLogitServiceStatus | None,
    m: StepMetrics | None = None,
    workers: list[WorkerStatus] | None = None,
) -> dict[str, Any]:
    """The ``/v1/status`` fields (:class:`protocol.JobStatus`) now, with the old-logit service's
    status ``oldlogit`` (and the workers' ``workers``, read now when not given); with the last step's row ``m``, its batch's fields too."""
    f = dict(
        learner_version=job.version,
        run_segment=job.run_segment,
        oldlogit_route=job.route.name,
        workers=workers if workers is not None else job.pool.statuses(),
        buffer_size=len(job.buffer),
        buffer_staleness_hist=job.buffer.staleness_histogram(job.version),
        generated=job.buffer.submitted,
        consumed=job.buffer.consumed,
        in_flight=job.buffer.in_flight,
        held=job.buffer.held,
        dropped=dict(job.buffer.dropped),
        filtered_groups=job.buffer.filtered_groups,
        zero_variance_admitted=job.buffer.zero_variance_admitted,
        oldlogit=oldlogit,
        last_publish_s=job.publisher.last.get("seconds"),
        last_publish_unix=job.publisher.last.get("unix"),
        fingerprint_mismatch=job.fingerprints.mismatches,
        fingerprint_unverified=job.fingerprints.unverified,
        eval_resubmitted=job.evals.resubmitted,
        gateway=job.source.status(),
        **best_status(job),
    )
    if m is not None:
        f.update(
            last_batch_staleness_hist=m.staleness_hist,
            exact_token_fraction=m.exact_token_fraction,
            proxy_fraction=1.0 - m.exact_token_fraction,
            mask_kept_fraction=_finite_or_none(m.mask_kept_fraction),
            tokens_per_s=_finite_or_none(m.tokens_per_s) or 0.0,
            skipped_steps=m.skipped_steps,
            entropy=_finite_or_none(m.entropy),
            kl_ref=_finite_or_none(m.kl_ref) if m.kl_ref is not None else None,
            zero_variance_share=m.zero_variance_groups / m.groups if m.groups else None,
        )
        extra = m.model_extra or {}
        if "ewma_beta" in extra:
            f["ewma"] = EwmaStatus(
                beta=extra["ewma_beta"],
                total_weight=extra["ewma_total_weight"],
                resets=int(extra["ewma_resets"]),
                bytes_held=int(extra.get("ewma_bytes_held", 0)),
            )
    return f


def _best(job: Job) -> BestEval | None:
    """The job's best pinned held-out evaluation so far (:attr:`trainer.driver.records.keeper.CheckpointKeeper.best`);
    None without one, or for a job without a ``keeper``."""
    return getattr(getattr(job, "keeper", None), "best", None)


def best_status(job: Job) -> dict[str, Any]:
    """``/v1/status`` ``best_version`` and ``best_held_out``: the best pinned held-out evaluation so
    far (``controller.keep_best``, :attr:`CheckpointKeeper.best`); nothing before the first (or
    without a job's ``keeper``)."""
    best = _best(job)
    return {} if best is None else {"best_version": best.version, "best_held_out": _finite_or_none(best.held_out)}


# -- the run's summary (``summary.json``) ------------------------------------------------------


def best_summary(job: Job) -> dict[str, Any]:
    """``summary.json``'s ``best_version``, ``best_held_out`` (its mean held-out reward) and
    ``best_checkpoint`` (the version's checkpoint folder): the best pinned held-out evaluation of
    the run (``controller.keep_best``, ties to the earlier version); each None when there is none."""
    best = _best(job)
    if best is None:
        return {"best_version": None, "best_held_out": None, "best_checkpoint": None}
    return {"best_version": best.version, "best_held_out": best.held_out, "best_checkpoint": best.checkpoint}


def best_line(job: Job) -> str | None:
    """The end-of-run line naming the best version, e.g. ``best held-out: version 20 (mean reward
    0.840), checkpoint runs/x/checkpoints/v20``; None when there is none."""
    s = best_summary(job)
    if s["best_version"] is None:
        return None
    return (
        f"best held-out: version {s['best_version']} (mean reward {s['best_held_out']:.3f}), "
        f"checkpoint {s['best_checkpoint']}"
    )


def loop_per_step(loop_s: float, train_s: float, steps: int) -> dict[str, float | None]:
    """Loop and learner wall seconds per step and their ratio (None without a step).

    ``loop_s``: from the first step's launch to the loop's end (the wait for the first batch is the
    rollout's ramp-up, not a per-step cost); ``train_s``: the learner steps' seconds, launch to
    metrics (:meth:`Job.finish_train`). ``loop_over_learner = loop_s / train_s`` is 1 when the loop
    does nothing but wait for the learner. Example: 3 steps, 90 s of loop, 75 s of learner:
    30 s, 25 s, 1.2.
    """
    if steps < 1 or train_s <= 0:
        return {"loop_s_per_step": None, "train_s_per_step": None, "loop_over_learner": None}
    return {
        "loop_s_per_step": loop_s / steps,
        "train_s_per_step": train_s / steps,
        "loop_over_learner": loop_s / train_s,
    }


def run_summary(
    job: Job,
    *,
    reason: str,
    before: dict[str, float],
    after: dict[str, float],
    last: StepMetrics | None,
    loop_s: float,
    t_end: float,
    t_start: float,
) -> dict[str, Any]:
    """The summary of a finished loop: why it ended (``reason``), the held-out scores ``before`` and
    ``after``, the last step's row ``last`` (None without a step), accounting, the time split, the
    old-logit service's counters, the job's thread plan (``thread_plan``) and the best pinned
    held-out evaluation (:func:`best_summary`, whose line :func:`best_line` is printed on the job's
    console here, after the end-of-run line). ``loop_s``: the loop's wall seconds; ``t_end``,
    ``t_start``: ``time.perf_counter()`` at the loop's end and the job's start."""
    gateway = job.source.status()
    if line := best_line(job):
        job.console.print(line)
    return {
        "state": "finished",
        "end_reason": reason,
        "steps": job.version,
        "reward_before": before,
        "reward_after": after,
        "tokens_exact": job.tokens_exact,
        "tokens_total": job.tokens_total,
        "exact_token_fraction": job.tokens_exact / job.tokens_total if job.tokens_total else 0.0,
        "ewma_resets": int((last.model_extra or {}).get("ewma_resets", 0)) if last else 0,
        "skipped_steps": last.skipped_steps if last else 0,
        "generated": job.buffer.submitted,
        "consumed": job.buffer.consumed,
        "dropped": dict(job.buffer.dropped),
        "filtered_groups": job.buffer.filtered_groups,
        "zero_variance_admitted": job.buffer.zero_variance_admitted,
        "buffered": len(job.buffer) + job.buffer.held,
        "in_flight": job.buffer.in_flight,
        "accounting_ok": job.buffer.accounting_ok(),
        "worker_restarts": job.workers.restarts,
        "fingerprint_mismatch": job.fingerprints.mismatches,
        "fingerprint_unverified": job.fingerprints.unverified,
        "eval_resubmitted": job.evals.resubmitted,
        **job.keeper.cost(),
        "run_segment": job.run_segment,
        "loop_s": loop_s,
        "train_steps": job.train_steps,
        "batches_taken_ahead": job.taken_ahead,
        "batches_retaken": job.retaken,
        **loop_per_step(
            t_end - job.first_launch if job.first_launch is not None else 0.0, job.times["train"], job.train_steps
        ),
        "time_split_s": dict(job.times),
        "peak_rss_gib": {k: round(v / 2**30, 2) for k, v in job.peak_rss.items()},
        "wall_s": time.perf_counter() - t_start,
        "oldlogit_route": job.route.name,
        **job.route.service_record(),
        "method": job.cfg.loss.method,
        "thread_plan": vars(job.cfg.thread_plan()),  # torch threads per part and who yields (modelkit.cores)
        "gateway": gateway.model_dump() if gateway is not None else None,
        **best_summary(job),
    }


_PARTS = {"LearnerCore": "learner", "RolloutWorker": "rollout worker", "OldLogit": "old-logit service"}


def failed_part(e: BaseException) -> str:
    """The part a failure came from: the Ray actor's role for actor errors, the part an error message
    starts with (``"learner: ..."``), else the exception type."""
    if isinstance(e, ray.exceptions.RayActorError):
        return next((part for key, part in _PARTS.items() if key in str(e)), "actor")
    return next((part for part in _PARTS.values() if str(e).startswith(part + ":")), type(e).__name__)
