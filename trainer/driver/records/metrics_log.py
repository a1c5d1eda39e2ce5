"""Per-step metrics to ``metrics.jsonl`` (always) and the trackers of ``logging.trackers``
(TensorBoard, Weights & Biases, MLflow: :mod:`trainer.driver.records.trackers`), plus plots after a run.

``metrics.jsonl`` holds two kinds of rows: one per learner step (no ``kind`` field) and one per
held-out evaluation (``kind = "eval"``, :meth:`MetricsLog.log_eval`); :func:`read_metrics` reads
one kind."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from trainer.driver.records.trackers import Tracker, scalars


class StepMetrics(BaseModel):
    """One learner step as the driver reports it: a row of ``metrics.jsonl``, TensorBoard scalars and
    the ``/v1/status`` fields. One name per concept; times are wall seconds, shares are in [0, 1].

    The declared fields are the ones every step has; the learner's method-specific metrics (clip
    fractions, ratio statistics, phase seconds, ``ewma_*`` ...) ride along as extra float fields.
    """

    model_config = ConfigDict(extra="allow")

    version: int = Field(ge=0)
    """The learner's version after the step (``consumed_version + 1`` when applied)."""
    consumed_version: int = Field(ge=0)
    """The version that consumed the batch (staleness is measured against it)."""
    applied: bool
    """False when the non-finite guard skipped the optimizer step (nothing was published)."""
    skipped_steps: int = Field(ge=0)
    """Steps skipped by the non-finite guard so far."""
    loss: float
    """Global token-mean policy loss of the optimizer batch."""
    tokens: float = Field(ge=0)
    """Trained (loss-masked) tokens of the batch, all ranks."""
    exact_token_fraction: float = 0.0
    """Share of the trained tokens whose pi_old was exact (the rest used the configured proxy)."""
    current_exact_tokens: float = Field(0.0, ge=0)
    """Of the exact ones, tokens of the consuming version whose pi_old the learner's own forward gave
    (the old-logit service did not score them; ``trainer.algorithm.batch.learner_gives_current``)."""
    mask_kept_fraction: float | None = None
    """Share of the trained tokens the discrepancy mask keeps (reported even when not applied)."""
    zero_variance_groups: int = Field(0, ge=0)
    """Groups whose rewards were all equal (advantages exactly 0)."""
    groups: int = Field(0, ge=0)
    """Groups of the batch (``zero_variance_groups / groups`` is the share that carries no gradient)."""
    kl_ref: float | None = None
    """Token-mean k3 estimate (nats) of KL(pi_theta || pi_ref) to the frozen reference policy over
    the trained tokens, before each optimizer step; None when ``loss.kl_coef`` is 0 (no reference)."""
    tokens_per_s: float = 0.0
    """Trained tokens per second of the learner step."""
    optimizer_steps: int = Field(1, ge=0)
    """Optimizer steps applied in the learner step (``learner.ppo_epochs * learner.ppo_mini_batches`` when none is skipped)."""
    entropy: float = Field(0.0, ge=0)
    """Mean entropy (nats) of the current policy's next-token distribution over the trained tokens, at
    the sampling temperature, before each optimizer step; a fall towards 0 comes before a collapse."""
    response_tokens_mean: float = Field(0.0, ge=0)
    """Mean sampled tokens per trajectory of the batch."""
    clip_frac_step_max: float = Field(0.0, ge=0)
    """Largest share of trained tokens clipped (``clip_frac_low + clip_frac_high``) in one optimizer step."""
    clip_grad_removed_frac: float = Field(0.0, ge=0, le=1)
    """Share of the policy-gradient weight ``|w r A|`` that sat on clipped tokens (the clip removed it)."""
    reward_mean: float
    reward_max: float
    staleness_mean: float = Field(ge=0)
    """Mean token staleness (``consumed_version - versions[t]``) over the batch's sampled tokens."""
    staleness_max: int = Field(ge=0)
    staleness_hist: dict[int, int]
    """``{staleness: sampled-token count}`` of the batch."""
    spanning_seqs: int = Field(0, ge=0)
    """Trajectories of the batch whose sampled tokens come from more than one version (partial
    rollouts continued across a weight update)."""
    old_logits_s: float = Field(ge=0)
    """The driver's wait for the batch's answer from the old-logit service (snapshot route); scoring
    done while the learner trained on the batch before is not counted."""
    train_s: float = Field(ge=0)
    """The learner step, all ranks: from its launch to its metrics."""
    taken_ahead: bool = False
    """The batch was taken (and scored) for this version while the learner trained on the one before."""
    publish_s: float = Field(ge=0)
    """The last weight publication to every consumer."""
    oldlogit_restarts: int = Field(0, ge=0)
    """Restarts of the old-logit service seen so far (a new service process; Ray restarts it)."""
    oldlogit_outages: int = Field(0, ge=0)
    """Driver calls to the old-logit service so far that failed because it was restarting and were
    submitted again (:class:`oldlogit_service.calls.RestartWait`)."""
    oldlogit_retries: int = Field(0, ge=0)
    """Tries of those calls after their first failure."""
    oldlogit_unavailable_s: float = Field(0.0, ge=0)
    """Seconds so far during which at least one such call was waiting for the service (from its first
    failure to its answer)."""

    def row(self) -> dict[str, Any]:
        """The flat dict written to ``metrics.jsonl`` (declared and extra fields)."""
        return self.model_dump()


class MetricsLog:
    """Append one JSON object per step to ``metrics.jsonl``; its finite numbers also go to each tracker
    (:mod:`trainer.driver.records.trackers`) under the same names."""

    def __init__(self, run_dir: Path, trackers: Sequence[Tracker] = ()):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._fh = open(self.path, "a", buffering=1)
        self.trackers = list(trackers)

    def log(self, step: int, metrics: StepMetrics | dict[str, Any]) -> None:
        """Append ``metrics`` (a :class:`StepMetrics` or a flat dict) as the row of ``step``."""
        if isinstance(metrics, StepMetrics):
            metrics = metrics.row()
        row = {"step": step, "time": time.time(), **metrics}
        self._fh.write(json.dumps(row, default=_jsonable) + "\n")
        values = scalars(metrics)
        for t in self.trackers:
            t.log(step, values)

    def log_eval(self, record: dict[str, Any]) -> None:
        """Append one held-out evaluation's record (``kind = "eval"``,
        :func:`trainer.driver.records.heldout.eval_record`) as a row at ``step = record["version"]``; its
        numbers go to the trackers as ``eval/<field>`` (``eval/held_out``, ``eval/success_rate``,
        ``eval/n``, ``eval/seconds``, ``eval/waited_s``) at that step."""
        step = int(record["version"])
        row = {"step": step, "time": time.time(), **record}
        self._fh.write(json.dumps(row, default=_jsonable) + "\n")
        values = {f"eval/{k}": v for k, v in scalars(record).items() if k != "version"}
        for t in self.trackers:
            t.log(step, values)

    def close(self) -> None:
        """Close the file and finish every tracker's run (each, even when one before failed)."""
        self._fh.close()
        for t in self.trackers:
            with contextlib.suppress(Exception):
                t.close()


def _jsonable(v: Any) -> Any:
    if hasattr(v, "tolist"):
        return v.tolist()
    if isinstance(v, dict):
        return {str(k): x for k, x in v.items()}
    return str(v)


def read_metrics(path: Path, kind: str = "step") -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` of one ``kind``: ``step`` (the learner steps' rows, which carry
    no ``kind``) or ``eval`` (the held-out evaluations' records), in file order."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("kind", "step") == kind]


def held_out_series(path: Path) -> tuple[list[int], list[float], int]:
    """The held-out curve of a ``metrics.jsonl``: the evaluations' versions and mean rewards in file
    order, and the last one's episode count (0 without evaluations)."""
    evals = read_metrics(path, kind="eval")
    return [e["version"] for e in evals], [e["held_out"] for e in evals], evals[-1]["n"] if evals else 0


def plot_run(run_dir: Path) -> list[Path]:
    """PNG plots from ``metrics.jsonl``, returning their paths: ``reward.png`` (the batch reward per
    step and the held-out reward of every evaluation at its pinned version) and ``staleness.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    rows = [r for r in rows if "reward_mean" in r]
    if not rows:
        return []
    steps = [r["step"] for r in rows]
    out = []
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["reward_mean"] for r in rows], marker="o", label="train reward (batch mean)")
    versions, held_out, n = held_out_series(Path(run_dir) / "metrics.jsonl")
    if versions:  # the held-out prompts, one sample each, at the version each evaluation was pinned to
        ax.plot(versions, held_out, marker="s", label=f"held-out reward ({n} prompts)")
    ax.set_ylabel("reward")
    out.append(_save(plt, fig, ax, Path(run_dir) / "reward.png"))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r.get("staleness_mean", float("nan")) for r in rows], marker="o", label="mean token staleness")
    ax.plot(steps, [r.get("staleness_max", float("nan")) for r in rows], marker="x", label="max token staleness")
    ax.plot(
        steps, [r.get("exact_token_fraction", float("nan")) for r in rows], marker=".", label="exact old-logit fraction"
    )
    out.append(_save(plt, fig, ax, Path(run_dir) / "staleness.png"))
    return out


def _save(plt, fig, ax, path: Path) -> Path:
    """Label the step axis, add the legend, write ``path`` (PNG) and close the figure."""
    ax.set_xlabel("step (policy version)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
