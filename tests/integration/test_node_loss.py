"""A node lost mid-run on a two-node Ray cluster on this machine.

The test starts its own cluster with :class:`deploy.local_cluster.LocalRayHead`: a head holding the
custom resources ``learner_node`` (the learner) and one ``rollout_node``, and a second node
(``ray start --address ...`` on loopback) holding the other ``rollout_node`` and ``oldlogit_node``
(the old-logit service), both with token authentication. A tiny job on the snapshot route runs
against it as a user would (``vintage run --address``): learner and one rollout worker on the head,
the other rollout worker and the old-logit service on the second node, so every published version
crosses the node boundary through Ray's object store.

Once the second step is logged the job is paused through its control API (``POST /v1/pause``; the
loop holds after the step in progress when the request arrives, at version k: 2 or 3, or 4 on a box
slow enough that a whole step passes between the log line and the request), the second node's whole process group is killed
(SIGKILL, by the PID this test started), a new node with the same resources is started, and the job
is resumed. The worker's death is noticed, its in-flight samples are dropped as ``worker_died`` and
a replacement is placed on the new node; Ray restarts the old-logit service there, the driver's
calls wait for it (``oldlogit.restart_timeout_s``), and the restarted service holds no version until
the next publication. So, by hand: steps 1 .. k train on exact old logits. The first batch scored
after the kill holds tokens of version k or earlier, which the restarted service answers
``missing``: when no batch was taken ahead at the pause, that is the batch of step k + 1 (taken
after the resume, before version k + 1 exists: no token exact); when one was, step k + 1 trains on
the answer it got before the kill and the batch of step k + 2 holds them (taken ahead during step
k + 1, or finished during the pause). Either way one of the steps k + 1, k + 2 has an exact
fraction below 1. The job completes with the accounting identity intact and the restart counted.
Only processes this test started are signalled; the cluster and the job are stopped also when the
test run itself is ended by a signal (:mod:`trainer.driver.cluster.owned`).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deploy.local_cluster import LocalRayHead, outside_private_cluster
from trainer.driver.cluster import owned
from trainer.driver.records.metrics_log import read_metrics

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def control(run_dir: Path, action: str) -> None:
    """``POST /v1/<action>`` (pause / resume) to the job's API with its bearer token."""
    url = json.loads((run_dir / "server.json").read_text())["url"]
    token = (run_dir / "token").read_text().strip()
    httpx.post(f"{url}/v1/{action}", headers={"Authorization": f"Bearer {token}"}, timeout=10).raise_for_status()


def pause(run_dir: Path, timeout_s: float = 300.0) -> int:
    """Pause the job; returns the learner version at which its loop holds (``/v1/status``)."""
    control(run_dir, "pause")
    url = json.loads((run_dir / "server.json").read_text())["url"]
    deadline = time.monotonic() + timeout_s
    while (st := httpx.get(f"{url}/v1/status", timeout=10).json())["state"] != "paused":
        assert time.monotonic() < deadline, f"the job did not pause: {st['state']}"
        time.sleep(0.2)
    return st["learner_version"]


@pytest.mark.timeout(900)
def test_lost_node_of_a_rollout_worker_and_the_oldlogit_service_is_survived_once_a_node_is_back(
    tmp_path, tiny_model_path
):
    head = LocalRayHead.start(num_cpus=3, resources={"learner_node": 1, "rollout_node": 1}, timeout_s=180)
    second = {"rollout_node": 1, "oldlogit_node": 1}  # one rollout worker and the old-logit service
    nodes = []
    try:
        nodes.append(head.add_node(num_cpus=2, resources=second))
        run_dir = tmp_path / "run"
        overrides = [
            'model.path="tiny"', "env.eval_prompts=0", 'rollout.engine="transformers"', "rollout.num_workers=2",
            "rollout.max_num_seqs=16", "rollout.sampling.max_tokens=12", "rollout.sampling.n=4",
            "controller.batch_groups=2", "controller.max_staleness=1", "controller.total_steps=6",
            "learner.micro_batch_size=8", "server.port=0", "logging.trackers=[]", "logging.plots=false",
            'loss.method="snapshot"', "rollout.resources={rollout_node = 1}", "learner.resources={learner_node = 1}",
            "oldlogit.resources={oldlogit_node = 1}", "oldlogit.restart_timeout_s=300",
            "rollout.start_timeout_s=240", f'logging.run_dir="{run_dir}"',
        ]  # fmt: skip
        cmd = [sys.executable, "-m", "vintage_cli.main", "run", "--address", head.gcs_address]
        for o in overrides:
            cmd += ["--set", o]
        env = {**outside_private_cluster(os.environ), **head.client_env(), "PYTHONPATH": str(REPO)}
        log = open(tmp_path / "job.log", "w")
        job = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        owned.own(("job", job.pid), functools.partial(owned.stop_group, job.pid, 10.0))  # also if pytest is ended
        try:
            metrics, paused_at = run_dir / "metrics.jsonl", None
            deadline = time.monotonic() + 780
            while job.poll() is None and time.monotonic() < deadline:
                if paused_at is None and metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                    paused_at = pause(run_dir)
                    nodes[0].stop(timeout_s=10, sig=signal.SIGKILL)  # the raylet, the worker and the service
                    nodes.append(head.add_node(num_cpus=2, resources=second))
                    control(run_dir, "resume")
                time.sleep(0.5)
        finally:
            if job.poll() is None:
                job.kill()
            job.wait(timeout=60)
            owned.stop_group(job.pid, 10.0)
            owned.disown(("job", job.pid))
        out = (tmp_path / "job.log").read_text()
        assert paused_at in (2, 3, 4) and job.returncode == 0, out[-4000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        rows = read_metrics(metrics)
        assert summary["end_reason"] == "completed" and summary["steps"] == 6
        assert summary["worker_restarts"] == 1 and "worker_died" in summary["dropped"]
        assert summary["accounting_ok"]
        assert [r["version"] for r in rows] == [1, 2, 3, 4, 5, 6]
        k, exact = paused_at, [r["exact_token_fraction"] for r in rows]
        assert exact[:k] == [1.0] * k and min(exact[k : k + 2]) < 1.0  # tokens the restarted service lacks
        assert summary["tokens_exact"] < summary["tokens_total"]
        # one restart, after the second step: counted at the first status read answered by the new process
        restarts = [r["oldlogit_restarts"] for r in rows]
        assert restarts[:2] == [0, 0] and restarts[-1] == 1 and summary["oldlogit_restarts"] == 1
    finally:
        for n in nodes:
            n.stop(timeout_s=10)
        head.stop(timeout_s=10)
