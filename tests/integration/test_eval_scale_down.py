"""A held-out evaluation survives the loss of a rollout worker that holds some of its requests, for
real: a tiny-model job (local Ray, DeepSpeed on CPU, the transformers engine) with 2 rollout
workers and ``controller.eval_every = 2``; right after the evaluation at version 2 is sent, a scale
request to 1 worker arrives over HTTP (``POST /v1/workers``), and the loop's next controls remove
``rollout-1`` with the held-out requests it took. They are sent again to ``rollout-0``: the run
finishes, the evaluation scores every episode, its resubmissions are counted apart, only the
removed worker's training samples count as ``worker_removed``, and the accounting identity and
the ledger hold."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.tiny_job import TINY_JOB
from trainer.driver.config.schema import load_config
from trainer.driver.loop.job import run_job
from trainer.driver.loop.pinned_eval import PinnedEvaluation
from trainer.driver.records.ledger import fates, lineage, read_ledger
from trainer.driver.records.metrics_log import read_metrics

pytestmark = pytest.mark.integration

EVAL_PROMPTS = 12
"""Enough held-out requests that the worker removed holds some: each goes to the worker with the
fewest samples in flight."""


def test_an_evaluation_whose_worker_is_scaled_away_completes(tmp_path, tiny_model_path, ray_cluster, monkeypatch):
    cfg = load_config(
        None,
        [
            *TINY_JOB,
            'env.path="rollout.envs.toy:AlphabetEnv"',
            f"env.eval_prompts={EVAL_PROMPTS}",
            "env.train_seeds=50",
            "env.eval_timeout_s=60",
            'rollout.engine="transformers"',
            "rollout.num_workers=2",
            "controller.total_steps=4",
            "controller.eval_every=2",
            f'logging.run_dir="{tmp_path}"',
        ],
    )
    on_removed: dict = {}
    start_eval = PinnedEvaluation.start

    def start_eval_then_scale_down(evals: PinnedEvaluation, tag: str) -> bool:
        """The evaluation at version 2 is sent; note what rollout-1 holds, then ask for 1 worker."""
        started = start_eval(evals, tag)
        if tag == "during" and not on_removed:
            pool = evals.source.pool
            with pool._lock:
                held = dict(pool.held.by_worker.get("rollout-1", {}))
            on_removed["eval"] = sorted(r for r in held if r.startswith("eval-"))
            on_removed["train"] = sum(n for r, n in held.items() if not r.startswith("eval-"))
            url = json.loads((tmp_path / "server.json").read_text())["url"]
            auth = {"Authorization": f"Bearer {(tmp_path / 'token').read_text()}"}
            httpx.post(f"{url}/v1/workers", json={"num_workers": 1}, headers=auth, timeout=10).raise_for_status()
        return started

    monkeypatch.setattr(PinnedEvaluation, "start", start_eval_then_scale_down)
    summary = run_job(cfg)
    assert summary["state"] == "finished", summary.get("error")
    assert summary["steps"] == 4
    lost = len(on_removed["eval"])
    assert lost >= 1, "rollout-1 held no held-out request when it was removed"

    evals = read_metrics(tmp_path / "metrics.jsonl", kind="eval")
    assert [(e["tag"], e["version"], e["n"]) for e in evals] == [
        ("before", 0, EVAL_PROMPTS),
        ("during", 2, EVAL_PROMPTS),
        ("after", 4, EVAL_PROMPTS),
    ]
    assert [e["eval_resubmitted"] for e in evals] == [0, lost, 0]
    assert evals[1]["sampled_versions"] == [2]  # the episodes sent again are pinned to version 2 too
    assert summary["eval_resubmitted"] == lost

    # only the removed worker's training samples are lost; the identity holds
    assert summary["dropped"].get("worker_removed", 0) == on_removed["train"]
    assert summary["accounting_ok"]
    assert summary["generated"] == (
        summary["consumed"] + sum(summary["dropped"].values()) + summary["buffered"] + summary["in_flight"]
    )
    got = fates(lineage(read_ledger(tmp_path)))
    assert {i: f for i, f in got.items() if len(f) != 1} == {}  # exactly one fate per id
    assert not any(i.startswith("eval-") for i in got)  # held-out samples never enter the buffer
