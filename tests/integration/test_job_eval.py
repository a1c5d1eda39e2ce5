"""Held-out evaluation during training and ``vintage eval env``, for real: a tiny-model job (local
Ray, DeepSpeed on CPU, the transformers engine) with ``controller.eval_every = 2`` over 4 versions,
then the command on its checkpoints.

The env is the alphabet task (reward: the share of the reply's characters in a-m), whose rewards
on the random model are fractions between 0 and 1, so equal means are not an accident of all-zero
rewards. The transformers engine seeds each held-out prompt and samples each sequence alone, so
the job's evaluation (which may share the worker with training samples) and the command's sample
the same tokens from the same weights (:mod:`trainer.driver.loop.eval_env` says why vLLM agrees only in
expectation).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from typer.testing import CliRunner

from tests.tiny_job import TINY_JOB
from trainer.driver.config.schema import load_config
from trainer.driver.loop.job import run_job
from trainer.driver.records.export import checkpoint_tag
from trainer.driver.records.metrics_log import read_metrics
from trainer.learner.checkpoint import STATE_FILE, checkpointed_versions, latest_tag, read_best
from vintage_cli.main import app

pytestmark = pytest.mark.integration

EVAL_JOB = [
    *TINY_JOB,
    'env.path="rollout.envs.toy:AlphabetEnv"',
    "env.eval_prompts=4",
    "env.train_seeds=50",
    'rollout.engine="transformers"',
    "controller.total_steps=4",
    "controller.eval_every=2",
    "controller.checkpoint_every=2",
]


BEST_JOB = [
    *[o for o in EVAL_JOB if not o.startswith(("controller.eval_every", "controller.checkpoint_every"))],
    "controller.eval_every=1",
    "controller.keep_checkpoints=1",
]
"""Evaluated at every version (0 before training, 1-3 during, 4 after), no ``checkpoint_every``:
each version evaluated during training is checkpointed for its evaluation (``controller.keep_best``)."""


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory, tiny_model_path, ray_cluster):
    """The job, with ``/v1/status`` polled for the latest held-out figure while it runs."""
    run_dir = tmp_path_factory.mktemp("job-eval")
    cfg = load_config(None, [*EVAL_JOB, f'logging.run_dir="{run_dir}"'])
    result: dict = {}
    th = threading.Thread(target=lambda: result.update(run_job(cfg)), daemon=True)
    th.start()
    seen: set[tuple[int, float]] = set()
    while th.is_alive():
        if (run_dir / "server.json").exists():
            url = json.loads((run_dir / "server.json").read_text())["url"]
            try:
                s = httpx.get(f"{url}/v1/status", timeout=10).json()
            except httpx.HTTPError:  # not up yet, or stopped at the end
                s = {}
            if s.get("held_out_version") is not None:
                seen.add((s["held_out_version"], s["held_out"]))
        time.sleep(0.3)
    th.join()
    return run_dir, result, seen


def test_evaluations_at_versions_0_2_4_each_pinned_to_its_version(eval_run):
    run_dir, summary, seen = eval_run
    assert summary["state"] == "finished" and summary["steps"] == 4
    evals = read_metrics(run_dir / "metrics.jsonl", kind="eval")
    # before training (0), every 2 versions below the last (2), after training (4): three records
    assert [(e["tag"], e["version"], e["step"], e["n"]) for e in evals] == [
        ("before", 0, 0, 4),
        ("during", 2, 2, 4),
        ("after", 4, 4, 4),
    ]
    for e in evals:  # every sampled token of every episode was sampled by the pinned version
        assert e["sampled_versions"] == [e["version"]]
        assert 0.0 < e["held_out"] < 1.0 and e["waited_s"] <= e["seconds"]
    # the step rows are untouched: one per version, and the evaluation at 2 did not stop the learner
    assert [r["version"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    assert summary["reward_before"]["reward"] == evals[0]["held_out"]
    assert summary["reward_after"]["reward"] == evals[2]["held_out"]
    # /v1/status showed the latest figure with its version (0 until the evaluation at 2 ended, then 2)
    by_version = {e["version"]: e["held_out"] for e in evals}
    assert {(0, by_version[0]), (2, by_version[2])} <= seen <= set(by_version.items())


@pytest.mark.parametrize("version", ["2", "latest"])
def test_vintage_eval_env_reproduces_the_jobs_evaluation_of_a_checkpoint(eval_run, version, tmp_path):
    """The command on checkpoint 2 gives the job's evaluation during training at 2, and on the
    latest (4) the job's evaluation after training: the same mean over the same 4 episodes."""
    run_dir, _, _ = eval_run
    out = tmp_path / "eval.json"
    res = CliRunner().invoke(app, ["eval", "env", str(run_dir), "--version", version, "--out", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    want = {"2": 2, "latest": 4}[version]
    job_eval = next(e for e in read_metrics(run_dir / "metrics.jsonl", kind="eval") if e["version"] == want)
    assert report["version"] == want and report["engine"] == "transformers"
    assert report["episodes"] == job_eval["n"] == 4
    assert report["reward"] == job_eval["held_out"] and report["success_rate"] == job_eval["success_rate"]
    assert [e["env_seed"] for e in report["per_episode"]] == [50, 51, 52, 53]  # env.train_seeds = 50, 4 after
    ok = round(report["success_rate"] * 4)
    assert (
        f"held-out success {report['success_rate']:.3f} ({ok} of 4), mean reward {report['reward']:.3f}" in res.output
    )


def test_the_best_evaluations_checkpoint_is_on_disk_after_the_run(tmp_path, tiny_model_path, ray_cluster):
    """keep_checkpoints = 1 keeps the final checkpoint (the resume point) and the best version's:
    the one with the highest held-out mean (ties: the earlier), named by summary.json and exportable
    as ``--version best``; every other evaluated version's checkpoint is gone."""
    summary = run_job(load_config(None, [*BEST_JOB, f'logging.run_dir="{tmp_path}"']))
    assert summary["state"] == "finished" and summary["steps"] == 4
    evals = read_metrics(tmp_path / "metrics.jsonl", kind="eval")
    assert [e["version"] for e in evals] == [0, 1, 2, 3, 4]
    best = max(evals, key=lambda e: (e["held_out"], -e["version"]))  # ties: the earlier version
    ckpt = tmp_path / "checkpoints"
    assert (summary["best_version"], summary["best_held_out"]) == (best["version"], best["held_out"])
    assert summary["best_checkpoint"] == str((ckpt / f"v{best['version']}").resolve())
    assert (ckpt / f"v{best['version']}" / STATE_FILE).is_file()
    assert checkpointed_versions(ckpt) == sorted({best["version"], 4}) and latest_tag(ckpt) == "v4"
    assert json.loads((tmp_path / "summary.json").read_text())["best_version"] == best["version"]
    assert read_best(ckpt)["version"] == best["version"]
    assert checkpoint_tag(tmp_path, "best") == f"v{best['version']}"
