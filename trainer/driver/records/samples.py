"""Rollouts a reader can read: ``<run_dir>/samples.jsonl``, a few trained trajectories per step.

Each record is one trajectory of a trained batch as the learner saw it: the decoded prompt and
completion, its reward and advantage, per-token sampling versions and exact/proxy flags, and the
spans of the tokens the loss trained on. The trained mask, the exact flags and the advantages come
from :func:`trainer.algorithm.batch.collate` with the learner's own settings (advantages over the
whole batch, its groups intact), so they are the learner's values, not a second computation.

Bounds: ``logging.samples_per_step`` records per step (the batch's first trajectories: the batch
holds whole groups in order, so they compare within a group) and ``logging.max_samples`` over the
run, counting the records a resumed run finds in the file; when either is 0 nothing is written and
the tokenizer is never loaded.

Record fields (one JSON object per line):

- ``step``: the ``metrics.jsonl`` step of the batch (the learner's version after it);
  ``consumed_version``: the learner version that trained on it; ``applied``: False when the
  non-finite guard skipped the optimizer step;
- ``trajectory_id``, ``group_id``, ``finish_reason``, ``reward``, ``advantage`` (the configured
  estimator, ``loss.advantage``);
- ``prompt_len``, ``token_ids``, ``prompt`` and ``completion`` (the decoded text of
  ``token_ids[:prompt_len]`` and ``token_ids[prompt_len:]``);
- ``versions``: per token of ``token_ids``, the policy version that sampled it (-1 off sampled
  tokens); ``exact``: per token, 1 where a trained token's pi_old was exact (the old-logit answer
  said exact, or a scorer route attached it), 0 elsewhere (a trained token with 0 used the proxy);
- ``spans``: ``[start, end)`` offsets into ``token_ids`` of the runs of trained tokens (sampled,
  within the per-token staleness limit (``JobConfig.token_staleness_limit``), not removed by the overlong filter, never position 0);
- ``segments``: the completion cut where trained, exact or version changes, each
  ``{"start", "end", "text", "trained", "exact", "version"}`` (what ``vintage samples`` prints).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from protocol import OldLogitAnswer, Trajectory
from trainer.algorithm.batch import Batch, collate

if TYPE_CHECKING:
    from trainer.driver.config.schema import JobConfig

SAMPLES_FILE = "samples.jsonl"


class Decoder(Protocol):
    """What the records need of a tokenizer (a Hugging Face tokenizer has it)."""

    def decode(self, token_ids: list[int]) -> str: ...


def mask_spans(mask: np.ndarray) -> list[list[int]]:
    """``[start, end)`` pairs of the runs of True in a 1-D mask. Example: ``[0, 1, 1, 0, 1]`` ->
    ``[[1, 3], [4, 5]]``."""
    m = np.concatenate([[False], np.asarray(mask, bool), [False]])
    edges = np.flatnonzero(m[1:] != m[:-1])
    return [[int(a), int(b)] for a, b in zip(edges[::2], edges[1::2], strict=True)]


def learner_batch(
    cfg: JobConfig, trajectories: Sequence[Trajectory], consumed_version: int, answer: OldLogitAnswer | None
) -> Batch:
    """The batch the learner collated for ``trajectories`` at ``consumed_version``: the same
    :func:`collate` call with the learner's settings (temperature, the per-token staleness limit,
    ``learner.overlong_filter``, ``loss.advantage``) and the snapshot route's ``answer`` (None: each
    trajectory's attached ``old_logprobs``)."""
    return collate(
        trajectories,
        consumed_version,
        old_logits=answer,
        temperature=cfg.rollout.sampling.temperature,
        max_token_staleness=cfg.token_staleness_limit,
        overlong_filter=cfg.learner.overlong_filter,
        advantage=cfg.loss.advantage,
        current_from_learner=cfg.current_from_learner,
    )


def sample_record(
    t: Trajectory, batch: Batch, row: int, tokenizer: Decoder, *, step: int, applied: bool = True
) -> dict[str, Any]:
    """The ``samples.jsonl`` record of trajectory ``t``, row ``row`` of its collated ``batch``
    (fields in the module docstring)."""
    n = len(t.token_ids)
    ids = t.token_ids.astype(np.int64).tolist()
    trained = batch.loss_mask[row, :n].numpy()
    exact = (batch.exact_mask | batch.current_mask)[row, :n].numpy()
    versions = batch.versions[row, :n].numpy()
    p = t.prompt_len
    segments, start = [], p
    for i in range(p + 1, n + 1):
        if i == n or (trained[i], exact[i], versions[i]) != (trained[start], exact[start], versions[start]):
            segments.append(
                {
                    "start": start,
                    "end": i,
                    "text": tokenizer.decode(ids[start:i]),
                    "trained": bool(trained[start]),
                    "exact": bool(exact[start]),
                    "version": int(versions[start]),
                }
            )
            start = i
    return {
        "step": step,
        "consumed_version": batch.consuming_version,
        "applied": applied,
        "trajectory_id": t.trajectory_id,
        "group_id": t.group_id,
        "finish_reason": t.finish_reason,
        "reward": float(t.reward),
        "advantage": float(batch.seq_advantages[row]),
        "prompt_len": p,
        "prompt": tokenizer.decode(ids[:p]),
        "completion": tokenizer.decode(ids[p:]),
        "token_ids": ids,
        "versions": versions.tolist(),
        "exact": exact.astype(int).tolist(),
        "spans": mask_spans(trained),
        "segments": segments,
    }


class SamplesLog:
    """Appends a few trained trajectories per step to ``<run_dir>/samples.jsonl`` (module docstring).

    Args:
        run_dir: the run folder.
        per_step: records per step (``logging.samples_per_step``); 0 writes none.
        max_samples: records over the run, those already in the file included (``logging.max_samples``).
        model_path: the model folder whose tokenizer decodes the records (loaded once, at the first record).
        tokenizer: a tokenizer to use instead of loading one from ``model_path``.
    """

    def __init__(
        self,
        run_dir: Path,
        per_step: int,
        max_samples: int,
        model_path: Path | None = None,
        tokenizer: Decoder | None = None,
    ):
        self.path = Path(run_dir) / SAMPLES_FILE
        self.per_step, self.max_samples = per_step, max_samples
        self.model_path, self._tokenizer = model_path, tokenizer
        self.written = 0
        """Records in the file (a resumed run's included)."""
        if self.path.exists():
            with self.path.open() as fh:
                self.written = sum(1 for line in fh if line.strip())

    def room(self) -> int:
        """How many records the next step may write."""
        return max(0, min(self.per_step, self.max_samples - self.written))

    def write(
        self,
        cfg: JobConfig,
        trajectories: Sequence[Trajectory],
        learned: dict[str, Any],
        answer: OldLogitAnswer | None,
        step: int,
    ) -> int:
        """Append the records of the first :meth:`room` trajectories of a trained batch; returns how
        many. ``learned``: the learner's metrics of the step (``consumed_version``, ``applied``);
        ``answer``: the snapshot route's old-logit answer for the batch (None on other routes)."""
        k = min(self.room(), len(trajectories))
        if k == 0:
            return 0
        batch = learner_batch(cfg, trajectories, int(learned["consumed_version"]), answer)
        tok = self.tokenizer()
        applied = bool(learned["applied"])
        with self.path.open("a") as fh:
            for row in range(k):
                rec = sample_record(trajectories[row], batch, row, tok, step=step, applied=applied)
                fh.write(json.dumps(rec) + "\n")
        self.written += k
        return k

    def tokenizer(self) -> Decoder:
        """The run's tokenizer, loaded from ``model_path`` the first time it is needed."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        return self._tokenizer


def read_samples(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/samples.jsonl``, in order.

    Raises:
        FileNotFoundError: the run folder has no ``samples.jsonl``.
    """
    path = Path(run_dir) / SAMPLES_FILE
    if not path.is_file():
        raise FileNotFoundError(f"RUN_DIR: {str(Path(run_dir))!r} has no {SAMPLES_FILE}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
