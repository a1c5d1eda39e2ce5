"""Parts failing mid-run: the job goes on and every sample is accounted for.

A tiny job (Ray local cluster, DeepSpeed on CPU, two rollout workers on the transformers engine)
trains while the test kills one rollout worker's process with SIGKILL. The pool notices, the dead
worker's in-flight samples are dropped with reason ``worker_died``, a replacement starts, and the
job completes with ``generated = consumed + dropped + buffered + in flight``. A worker that hangs
(alive, answering nothing) is killed after ``rollout.hang_timeout_s`` and replaced the same way,
its samples dropped as ``worker_hung``. A killed learner ends the run; its resume trains every
finished trajectory of the last checkpoint exactly once (checked by id in the run's ledger).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import psutil
import pytest

from trainer.driver.config.schema import load_config
from trainer.driver.loop.job import run_job, run_with_restarts
from trainer.driver.records.metrics_log import read_metrics
from trainer.learner.checkpoint import latest_tag

pytestmark = pytest.mark.integration


BASE = [
    'model.path="tiny"', "env.eval_prompts=0", 'rollout.engine="transformers"', "rollout.max_num_seqs=16",
    "rollout.sampling.max_tokens=12", "rollout.sampling.n=4", "controller.batch_groups=2",
    "controller.max_staleness=1", "learner.micro_batch_size=8", "server.enabled=false",
    "logging.trackers=[]", "logging.plots=false",
]  # fmt: skip


def _processes(name_part: str) -> list[psutil.Process]:
    """Processes started under this test process whose name holds ``name_part`` (oldest first)."""
    procs = [p for p in psutil.Process(os.getpid()).children(recursive=True) if name_part in p.name()]
    return sorted(procs, key=lambda p: p.create_time())


def _run_and_kill(tmp_path, overrides: list[str], name_part: str, expect: int, runner=run_job) -> tuple[dict, int]:
    """Run a job in a thread (``runner``: :func:`run_job` or :func:`run_with_restarts`); after its
    second step SIGKILL the oldest of the ``expect`` processes whose name holds ``name_part``.
    Returns the job's summary and the killed PID."""
    cfg = load_config(None, [*BASE, f'logging.run_dir="{tmp_path}"', *overrides])
    result: dict = {}

    def job() -> None:
        try:
            result.update(runner(cfg))
        except Exception as e:  # a failed run: its summary.json says why
            result["raised"] = e

    th = threading.Thread(target=job, daemon=True)
    th.start()
    metrics, killed = tmp_path / "metrics.jsonl", None
    deadline = time.monotonic() + 900
    while th.is_alive() and time.monotonic() < deadline:
        if killed is None and metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            procs = _processes(name_part)
            assert len(procs) == expect, procs
            killed = procs[0].pid
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.2)
    th.join(timeout=60)
    assert killed is not None
    return result, killed


def test_killed_rollout_worker_is_replaced_and_accounted(tmp_path, tiny_model_path, ray_cluster):
    overrides = ["rollout.num_workers=2", "controller.total_steps=6", 'loss.method="ppo_ewma"']
    result, killed = _run_and_kill(tmp_path, overrides, "ray::RolloutWork", expect=2)
    assert not psutil.pid_exists(killed)
    assert result["state"] == "finished" and result["end_reason"] == "completed" and result["steps"] == 6
    assert result["accounting_ok"]
    assert "worker_died" in result["dropped"] and result["worker_restarts"] == 1
    assert [int(r["version"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_hung_rollout_worker_is_killed_replaced_and_accounted(tmp_path, tiny_model_path, ray_cluster):
    """The first environment step anywhere never returns (``tests/hang_env.py``): the worker running
    it hangs before any of its samples finishes, holding both its groups (the pool spreads the first
    four requests of 4 samples alternately: 8 each), and answers no call. After 6 s without a
    finished trajectory it is killed, its 8 samples are dropped as ``worker_hung``, one replacement
    starts, ``/v1/status`` says so, and the job completes on the other worker and the replacement.
    The other worker alone keeps the job going (8 samples per version); 6 steps (about 2.5 s each
    on the tiny model) give the 6 s rule time to fire before the run ends. On a loaded machine the
    healthy worker may pass the 6 s rule too: then it is replaced as well, and the samples lost with
    it free their admission room, so the run still completes."""
    overrides = [
        f'logging.run_dir="{tmp_path}"', "rollout.num_workers=2", "controller.total_steps=6", 'loss.method="ppo_ewma"',
        'env.path="tests.hang_env:HangOnceEnv"', f'env.kwargs={{marker="{tmp_path / "hang-marker"}"}}',
        "rollout.hang_timeout_s=6", "server.enabled=true", "server.port=0",
    ]  # fmt: skip
    cfg = load_config(None, [*BASE, *overrides])
    result: dict = {}
    th = threading.Thread(target=lambda: result.update(run_job(cfg)), daemon=True)
    th.start()
    notes: set[str] = set()
    while th.is_alive():
        if (tmp_path / "server.json").exists():
            url = json.loads((tmp_path / "server.json").read_text())["url"]
            try:
                notes.add(httpx.get(f"{url}/v1/status", timeout=10).json()["scale_note"])
            except httpx.HTTPError:  # not serving yet, or stopped after the run
                pass
        time.sleep(0.5)
    th.join()
    assert result["state"] == "finished" and result["end_reason"] == "completed" and result["steps"] == 6
    assert result["dropped"].get("worker_hung", 0) >= 8 and "worker_died" not in result["dropped"]
    assert 1 <= result["worker_restarts"] <= 3 and result["accounting_ok"]
    hung = r"rollout-\d+ hung \(no finished trajectory in 6 s\)"
    note = rf"rollout worker\(s\) {hung}(, {hung})* \(\d+ samples lost\); [012] of 2 running(, [12] starting)?, [123] of 3 restarts used"
    assert any(re.fullmatch(note, n) for n in notes), notes


def test_killed_oldlogit_service_restarts_and_missing_tokens_use_the_proxy(tmp_path, tiny_model_path, ray_cluster):
    """Snapshot route, max_staleness 1: after the service dies it holds no version; the next batch's
    tokens of the version before the restart are missing (proxy), later batches are exact again."""
    overrides = ["rollout.num_workers=1", "controller.total_steps=7", 'loss.method="snapshot"']
    result, _ = _run_and_kill(tmp_path, overrides, "OldLogit", expect=1)
    assert result["state"] == "finished" and result["end_reason"] == "completed" and result["accounting_ok"]
    exact = [r["exact_token_fraction"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert len(exact) == 7 and exact[:2] == [1.0, 1.0]
    assert min(exact) < 1.0 and exact[-1] == 1.0  # missing right after the restart, exact again after


def test_killed_learner_fails_the_run_naming_it_and_resume_continues_from_the_last_checkpoint(
    tmp_path, tiny_model_path, ray_cluster, monkeypatch
):
    """A checkpoint after every step; the learner's process is killed after the second step. The run
    ends ``failed: learner`` (no replacement: its weights and optimizer state died with it); the same
    command with the checkpoint folder as ``controller.resume_from`` (what ``--resume auto`` picks)
    continues at the checkpoint's version (the last complete one: the kill may land mid-save), as run
    segment 1, and completes. The kernel's OOM kill count is held still: this kill is not for memory."""
    monkeypatch.setattr("trainer.driver.loop.job.oom_kill_count", lambda: 5)
    overrides = ["rollout.num_workers=1", "controller.total_steps=5", "controller.checkpoint_every=1"]
    result, killed = _run_and_kill(tmp_path, overrides, "ray::LearnerCore", expect=1)
    assert not psutil.pid_exists(killed)
    failed = json.loads((tmp_path / "summary.json").read_text())
    assert failed["state"] == "failed" and failed["end_reason"] == "failed: learner"
    assert type(result["raised"]).__name__ == "ActorDiedError"
    saved = int(latest_tag(tmp_path / "checkpoints").removeprefix("v"))
    ckpt = f'controller.resume_from="{tmp_path / "checkpoints"}"'
    cfg = load_config(None, [*BASE, f'logging.run_dir="{tmp_path}"', *overrides, ckpt])
    resumed = run_job(cfg)
    assert resumed["state"] == "finished" and resumed["end_reason"] == "completed" and resumed["steps"] == 5
    assert resumed["run_segment"] == 1 and resumed["accounting_ok"] and 1 <= saved < 5  # the last complete one


def test_a_killed_learner_is_restarted_in_the_run_from_its_last_checkpoint(
    tmp_path, tiny_model_path, ray_cluster, monkeypatch
):
    """With ``controller.max_learner_restarts = 1`` and a checkpoint after every step, the learner
    killed after the second step costs the run nothing but the steps since the checkpoint: the same
    call goes on from the checkpoint as run segment 1 and completes all 5 versions, with one restart
    in the summary and the accounting closed."""
    monkeypatch.setattr("trainer.driver.loop.job.oom_kill_count", lambda: 5)
    overrides = [
        "rollout.num_workers=1", "controller.total_steps=5", "controller.checkpoint_every=1",
        "controller.max_learner_restarts=1",
    ]  # fmt: skip
    result, killed = _run_and_kill(tmp_path, overrides, "ray::LearnerCore", expect=1, runner=run_with_restarts)
    assert not psutil.pid_exists(killed) and "raised" not in result, result.get("raised")
    assert result["state"] == "finished" and result["end_reason"] == "completed" and result["steps"] == 5
    assert result["learner_restarts"] == 1 and result["run_segment"] == 1 and result["accounting_ok"]
    assert json.loads((tmp_path / "summary.json").read_text())["learner_restarts"] == 1


def test_resume_after_a_killed_learner_trains_every_finished_trajectory_exactly_once(
    tmp_path, tiny_model_path, ray_cluster, monkeypatch
):
    """Staleness bound 2 keeps trajectories buffered (and a batch taken ahead) at every checkpoint.
    The learner is killed after the second step; the resumed run gets back every finished
    trajectory of the last complete checkpoint (``trajectories.jsonl``), loses only what was in
    flight then, and the ledger closes by trajectory id: over the lineage of the final weights
    every id that arrived is consumed exactly once, dropped with a reason, or buffered at the end.

    The kernel's OOM kill count rises between the job's start and the learner's death (0, then 1),
    as when the kernel kills it for memory: the run says so in one line, with what the learner held."""
    counts = iter([0])
    monkeypatch.setattr("trainer.driver.loop.job.oom_kill_count", lambda: next(counts, 1))
    from trainer.driver.records.ledger import fates, lineage, read_ledger
    from trainer.driver.sources.resume import read_trajectories
    from trainer.learner.checkpoint import read_state

    overrides = [
        "rollout.num_workers=1", "controller.total_steps=6", "controller.checkpoint_every=1",
        "controller.max_staleness=2",
    ]  # fmt: skip
    result, _ = _run_and_kill(tmp_path, overrides, "ray::LearnerCore", expect=1)
    assert type(result["raised"]).__name__ == "KilledForMemory"
    assert type(result["raised"].__cause__).__name__ == "ActorDiedError"
    failed = json.loads((tmp_path / "summary.json").read_text())
    assert failed["end_reason"] == "failed: learner (out of memory)"
    assert re.fullmatch(
        r"learner: killed by the kernel's out-of-memory killer \(oom_kill 0 -> 1\); it held \d+\.\d GiB resident "
        r"at its last step, of \d+\.\d GiB on this machine",
        failed["error"],
    ), failed["error"]
    assert str(result["raised"]) == failed["error"]
    ckpt = tmp_path / "checkpoints"
    tag = latest_tag(ckpt)
    extra = read_state(ckpt, tag)["extra"]
    counters, held_back = extra["buffer"], extra["source"]["held_back_ids"]
    kept = read_trajectories(ckpt / tag, counters["buffered_ids"], held_back)
    assert len(kept.buffered) >= 1, "nothing was buffered at the checkpoint: the test proves nothing"
    in_flight = counters["submitted"] - counters["consumed"] - sum(counters["dropped"].values()) - len(kept.buffered)
    in_flight -= len(kept.held_back)

    cfg = load_config(None, [*BASE, f'logging.run_dir="{tmp_path}"', *overrides, f'controller.resume_from="{ckpt}"'])
    resumed = run_job(cfg)
    assert resumed["state"] == "finished" and resumed["end_reason"] == "completed" and resumed["run_segment"] == 1
    assert resumed["accounting_ok"]
    assert resumed["generated"] == (
        resumed["consumed"] + sum(resumed["dropped"].values()) + resumed["buffered"] + resumed["in_flight"]
    )
    lost = resumed["dropped"].get("replayed_at_restart", 0) - counters["dropped"].get("replayed_at_restart", 0)
    assert lost == in_flight  # only what was in flight at the checkpoint, its prompts generated again
    assert "lost_at_restart" not in resumed["dropped"]

    events = lineage(read_ledger(tmp_path))
    restart = next(e for e in events if e["event"] == "resumed")
    assert restart["tag"] == tag and restart["ids"] == counters["buffered_ids"] + held_back
    assert restart["replayed_at_restart"] == in_flight
    got = fates(events)
    assert set(counters["buffered_ids"]) <= set(got)
    assert {i: f for i, f in got.items() if len(f) != 1} == {}  # exactly one fate per id
    consumed = [i for i, f in got.items() if f == ["consumed"]]
    assert len(consumed) == resumed["consumed"]
    assert sum(f == ["buffered"] for f in got.values()) == resumed["buffered"]
    by_reason: dict[str, int] = {}
    for f in got.values():
        if f[0].startswith("dropped:"):
            by_reason[f[0].removeprefix("dropped:")] = by_reason.get(f[0].removeprefix("dropped:"), 0) + 1
    for reason, n in by_reason.items():  # drops with an id never exceed the counters (the rest: in flight)
        assert n <= resumed["dropped"][reason], (reason, n, resumed["dropped"])
    sampled_after = {i for e in events if e["segment"] == 1 and e["event"] == "buffered" for i in e["ids"]}
    sampled_after -= set(held_back)  # held back in segment 0, offered in segment 1
    assert all(i.startswith("r1.") for i in sampled_after)  # a resumed segment's ids never repeat the last one's
