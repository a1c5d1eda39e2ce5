"""A short async job on the tiny model, for real: Ray local cluster, DeepSpeed on CPU, vLLM, HTTP.

Checks: versions advance one per step; no consumed token exceeds ``max_staleness``; the snapshot
route's answers stay exact for every token with the next batch scored while the learner trains; the
status endpoint answers during the run; ``samples.jsonl`` holds two decoded trajectories per step;
rollout workers scale up and down mid-run; the accounting identity holds; a mutating call without
the token is refused; the learning-rate schedule and the adaptive entropy bonus reach the learner
and step as worked out by hand; a resumed run continues the version sequence, the schedule's step
and the entropy coefficient from its checkpoint.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from protocol import JobStatus
from tests.tiny_job import TINY_JOB
from trainer.driver.config.schema import load_config
from trainer.driver.loop.job import run_job
from trainer.driver.records.metrics_log import read_metrics
from trainer.driver.records.samples import read_samples

pytestmark = pytest.mark.integration


SCHEDULE = [
    'learner.lr_schedule="cosine"',
    "learner.lr_warmup_steps=2",
    "learner.lr_decay_steps=16",
    "learner.lr_min_ratio=0.1",
]
"""Warm-up over 2 optimizer steps, then cosine decay to a tenth of ``learner.lr`` (1e-4) at step 16."""

ENTROPY = [
    "loss.entropy_coef=0.01",
    "loss.entropy_target=100.0",
    "loss.entropy_coef_delta=0.002",
    "loss.entropy_coef_max=0.018",
]
"""An entropy bonus starting at 0.01 under a target no policy reaches (the tiny model's vocabulary
holds far fewer than e^100 tokens), so the coefficient rises by 0.002 a version up to its ceiling."""


def _wait_for(path: Path, timeout_s: float = 300.0) -> None:
    end = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < end, f"{path} did not appear"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, tiny_model_path, ray_cluster):
    """Run 6 steps in a thread while the test talks to the HTTP API; scale 1 -> 2 -> 1 workers."""
    run_dir = tmp_path_factory.mktemp("job")
    cfg = load_config(
        None,
        TINY_JOB
        + ["controller.total_steps=6", f'logging.run_dir="{run_dir}"', 'loss.method="snapshot"']
        + ["learner.ppo_mini_batches=2", "controller.export_every=3"]
        + SCHEDULE
        + ENTROPY,
    )
    result: dict = {}
    th = threading.Thread(target=lambda: result.update(run_job(cfg)), daemon=True)
    th.start()
    _wait_for(run_dir / "server.json")
    url = json.loads((run_dir / "server.json").read_text())["url"]
    token = (run_dir / "token").read_text()
    seen = {"versions": [], "refused": None, "workers": []}
    scaled_up = scaled_down = False
    while th.is_alive():
        try:
            s = JobStatus.model_validate(httpx.get(f"{url}/v1/status", timeout=10).json())
        except httpx.ConnectError:  # the job stopped its server and is writing its summary
            break
        seen["versions"].append(s.learner_version)
        seen["workers"].append(len(s.workers))
        if seen["refused"] is None:
            seen["refused"] = httpx.post(f"{url}/v1/workers", json={"num_workers": 3}, timeout=10).status_code
        if s.learner_version >= 2 and not scaled_up:
            auth = {"Authorization": f"Bearer {token}"}
            assert httpx.post(f"{url}/v1/workers", json={"num_workers": 2}, headers=auth, timeout=10).status_code == 202
            # the new worker starts in the background; hold the loop until it has joined
            httpx.post(f"{url}/v1/pause", headers=auth, timeout=10).raise_for_status()
            deadline = time.monotonic() + 300
            while len(httpx.get(f"{url}/v1/workers", timeout=10).json()) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.2)
            seen["scale_note"] = httpx.get(f"{url}/v1/status", timeout=10).json()["scale_note"]
            httpx.post(f"{url}/v1/resume", headers=auth, timeout=10).raise_for_status()
            scaled_up = True
        if s.learner_version >= 4 and len(s.workers) == 2 and not scaled_down:
            assert (
                httpx.post(
                    f"{url}/v1/workers",
                    json={"num_workers": 1},
                    headers={"Authorization": f"Bearer {token}"},
                    timeout=10,
                ).status_code
                == 202
            )
            scaled_down = True
        time.sleep(0.5)
    th.join()
    return run_dir, result, seen


def test_versions_advance_one_per_step_and_staleness_bounded(first_run):
    run_dir, summary, _ = first_run
    assert summary["state"] == "finished" and summary["steps"] == 6
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [int(r["version"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [int(r["consumed_version"]) for r in rows] == [0, 1, 2, 3, 4, 5]
    for r in rows:
        assert max(int(k) for k in r["staleness_hist"]) <= 1  # max_staleness = 1, per token, queue time included
        assert r["exact_token_fraction"] == 1.0  # snapshot route holds [V-1, V], also for batches taken ahead
        assert 0 <= r["spanning_seqs"] <= r["sequences"]  # partial rollouts are counted among the batch's
    # a batch taken ahead (during the step before) is scored while the learner trains: its answer is
    # still exact for every token, and the summary counts every such batch
    assert summary["exact_token_fraction"] == 1.0 and summary["tokens_exact"] == summary["tokens_total"]
    assert summary["batches_taken_ahead"] == sum(r["taken_ahead"] for r in rows)
    assert summary["train_steps"] == 6


def test_two_optimizer_steps_per_version_and_exports_every_third(first_run):
    run_dir, _, _ = first_run
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["optimizer_steps"] for r in rows] == [2] * 6  # one version per batch of 8, two mini-batches of 4
    assert sorted(p.name for p in (run_dir / "exports").iterdir()) == ["v3", "v6"]
    for v in (3, 6):
        folder = run_dir / "exports" / f"v{v}"
        assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
        assert json.loads((folder / "vintage-export.json").read_text())["version"] == v


def test_the_schedule_and_the_entropy_bonus_step_as_worked_by_hand(first_run):
    """Each version's ``lr`` is the rate of its last optimizer step (0-based steps 1, 3, ..., 11 at
    two steps a version): step 1 is in the warm-up, (1 + 1) / (2 + 1) = 2/3; then
    0.1 + 0.9 (1 + cos(pi p)) / 2 with p = (step - 2) / 14: p = 1/14 -> 0.988718, 3/14 -> 0.901824,
    5/14 -> 0.745248, 1/2 -> 0.55, 9/14 -> 0.354752. The entropy coefficient a version trains with
    is the start plus 0.002 per version before it, held at the ceiling 0.018."""
    run_dir, _, _ = first_run
    rows = read_metrics(run_dir / "metrics.jsonl")
    factors = [2 / 3, 0.988718, 0.901824, 0.745248, 0.55, 0.354752]
    assert [r["lr"] for r in rows] == pytest.approx([1e-4 * f for f in factors], rel=1e-5)
    assert [r["entropy_coef"] for r in rows] == pytest.approx([0.010, 0.012, 0.014, 0.016, 0.018, 0.018])


def test_samples_are_the_batches_first_trajectories_decoded(first_run):
    run_dir, _, _ = first_run
    recs = read_samples(run_dir)
    assert len(recs) == 6 * 2  # logging.samples_per_step = 2 of each batch
    assert [r["step"] for r in recs] == [s for s in range(1, 7) for _ in range(2)]
    assert [r["consumed_version"] for r in recs] == [s - 1 for s in range(1, 7) for _ in range(2)]
    for r in recs:
        trained = sum(b - a for a, b in r["spans"])
        assert trained > 0 and sum(r["exact"]) == trained  # the snapshot route is exact on every token
        assert r["segments"][0]["start"] == r["prompt_len"] and r["segments"][-1]["end"] == len(r["token_ids"])
        assert r["prompt"] and r["completion"] and len(r["versions"]) == len(r["exact"]) == len(r["token_ids"])


def test_accounting_identity_and_summary(first_run):
    _, summary, _ = first_run
    assert summary["accounting_ok"]
    assert summary["consumed"] == 6 * 8
    assert summary["generated"] >= summary["consumed"] + sum(summary["dropped"].values())
    assert summary["skipped_steps"] == 0


def test_status_endpoint_during_run_and_token(first_run):
    _, _, seen = first_run
    assert seen["refused"] == 401
    assert seen["versions"] == sorted(seen["versions"]) and max(seen["versions"]) >= 4
    assert 2 in seen["workers"]  # scaled up mid-run
    assert seen["scale_note"] == "rollout worker(s) rollout-1 started; 2 of 2 running"
    assert seen["workers"][-1] == 1  # and back down


def test_resume_continues_version_sequence(first_run, tmp_path):
    run_dir, _, _ = first_run
    cfg = load_config(
        None,
        TINY_JOB
        + [
            "controller.total_steps=8",
            f'logging.run_dir="{tmp_path}"',
            'loss.method="ppo_ewma"',
            f'controller.resume_from="{run_dir / "checkpoints"}"',
            "env.eval_prompts=0",
            "server.enabled=false",
            *SCHEDULE,
            *ENTROPY,
        ],
    )
    summary = run_job(cfg)
    assert summary["state"] == "finished" and summary["steps"] == 8
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [int(r["consumed_version"]) for r in rows] == [6, 7]
    assert [r["run_segment"] for r in rows] == [1, 1] and summary["run_segment"] == 1  # versions 7, 8 of segment 1
    assert summary["accounting_ok"]
    # one optimizer step a version now, counted on from the checkpoint's 12: steps 12 and 13,
    # p = 10/14 -> 0.269430 and 11/14 -> 0.198176; the entropy coefficient stays at its ceiling
    assert [r["optimizer_steps"] for r in rows] == [1, 1]
    assert [r["lr"] for r in rows] == pytest.approx([1e-4 * 0.269430, 1e-4 * 0.198176], rel=1e-5)
    assert [r["entropy_coef"] for r in rows] == pytest.approx([0.018, 0.018])


@pytest.mark.parametrize("method", ["interrupt_sync", "old_logit_model"])
def test_scorer_routes_attach_exact_old_logprobs(method, tmp_path, tiny_model_path, ray_cluster):
    """interrupt_sync scores every token at its own version before the scorer moves on: all exact.
    old_logit_model scores finished trajectories only: segments superseded mid-rollout are missing,
    and the learner's exact fraction says so."""
    cfg = load_config(
        None,
        TINY_JOB
        + [
            "controller.total_steps=3",
            f'logging.run_dir="{tmp_path}"',
            f'loss.method="{method}"',
            "env.eval_prompts=0",
            "server.enabled=false",
            "rollout.sampling.max_tokens=24",
        ],
    )
    summary = run_job(cfg)
    assert summary["state"] == "finished" and summary["accounting_ok"]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 3
    for r in rows:
        assert max(int(k) for k in r["staleness_hist"]) <= 1
        if method == "interrupt_sync":
            assert r["exact_token_fraction"] == 1.0
        else:
            assert 0.0 < r["exact_token_fraction"] <= 1.0


@pytest.mark.parametrize("in_service", [False, True])
def test_kl_penalties_in_the_loss_and_the_reward_in_a_real_job(tmp_path, tiny_model_path, ray_cluster, in_service):
    """``loss.kl_coef`` 0.05 and ``loss.kl_reward_coef`` 0.1 in a real job, the reference scored by
    the learner or (``oldlogit.score_reference``) by the old-logit service beside the old logits:
    the frozen reference is version 0, so the first step's KL to it in the loss is 0 (policy and
    reference are the same weights in the same numerics); every step reports the reward's KL
    estimate and takes 0.1 times it off the rewards; the run trains all its versions with finite
    losses."""
    cfg = load_config(
        None,
        TINY_JOB
        + [
            "controller.total_steps=2",
            f'logging.run_dir="{tmp_path}"',
            "loss.kl_coef=0.05",
            "loss.kl_reward_coef=0.1",
            "server.enabled=false",
            f"oldlogit.score_reference={str(in_service).lower()}",
        ],
    )
    summary = run_job(cfg)
    assert summary["state"] == "finished" and summary["steps"] == 2 and summary["accounting_ok"]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["consumed_version"] for r in rows] == [0, 1]
    assert rows[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    for r in rows:
        assert r["kl_reward_penalty"] == pytest.approx(0.1 * r["kl_reward"], rel=1e-5, abs=1e-9)
        assert abs(r["kl_reward"]) < 50 and abs(r["loss"]) < 1e3  # finite, as read back


def test_dynamic_sampling_drops_uniform_groups_and_the_ledger_closes(tmp_path, tiny_model_path, ray_cluster):
    """Even env seeds score every reply 1.0 (:class:`tests.tiny_job.UniformOnEvenSeeds`): with
    ``controller.dynamic_sampling`` their groups are dropped as ``filtered`` once whole and new
    prompts take their places; with a bound never reached no trained group has equal rewards; the
    ledger closes by trajectory id (one fate each: consumed, dropped with its reason or buffered)."""
    from collections import Counter

    from trainer.driver.records.ledger import fates, lineage, read_ledger

    cfg = load_config(
        None,
        TINY_JOB
        + [
            "controller.total_steps=3",
            f'logging.run_dir="{tmp_path}"',
            'loss.method="ppo_ewma"',
            'env.path="tests.tiny_job:UniformOnEvenSeeds"',
            "env.train_seeds=50",
            "controller.dynamic_sampling=true",
            "controller.max_filtered_groups_per_step=100",
            "server.enabled=false",
        ],
    )
    summary = run_job(cfg)
    assert summary["state"] == "finished" and summary["steps"] == 3 and summary["accounting_ok"]
    n = summary["filtered_groups"]
    assert n >= 1 and summary["dropped"]["filtered"] == 4 * n and summary["zero_variance_admitted"] == 0
    assert summary["generated"] == (
        summary["consumed"] + sum(summary["dropped"].values()) + summary["buffered"] + summary["in_flight"]
    )
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 3
    counts = [r["filtered_groups"] for r in rows]  # so far, at each step
    assert counts == sorted(counts) and counts[-1] <= n
    for r in rows:
        assert r["zero_variance_groups"] == 0 and r["sequences"] == 8  # a full batch, every group informative
        assert r.get("dropped_filtered", 0) == 4 * r["filtered_groups"]
    got = fates(lineage(read_ledger(tmp_path)))
    assert {i: f for i, f in got.items() if len(f) != 1} == {}  # exactly one fate per id
    filtered = [i for i, f in got.items() if f == ["dropped:filtered"]]
    assert len(filtered) == summary["dropped"]["filtered"]
    groups = Counter(i.rsplit("/", 1)[0] for i in filtered)  # <request id>/<sample>: one group each
    assert set(groups.values()) == {4} and len(groups) == n
    assert any(int(g.split("-")[1]) % 2 == 0 for g in groups)  # v<version>-<seed>-<count>: even seeds
    assert sum(f == ["consumed"] for f in got.values()) == summary["consumed"] == 3 * 8
    assert sum(f == ["buffered"] for f in got.values()) == summary["buffered"]
    assert not any(i.startswith("eval-") for i in got)  # held-out samples never enter the buffer
