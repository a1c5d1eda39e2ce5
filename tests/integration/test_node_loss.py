"""A node lost mid-run on a two-node Ray cluster on this machine.

The test starts its own cluster with :class:`deploy.local_cluster.LocalRayHead`: a head holding the
custom resources ``learner_node`` (the learner) and one ``rollout_node``, and a second node
(``ray start --address ...`` on loopback) holding the other ``rollout_node`` and ``oldlogit_node``
(the old-logit service), both with token authentication. A tiny job on the snapshot route runs
against it as a user would (``vintage run --address``): learner and one rollout worker on the head,
the other rollout worker and the old-logit service on the second node, so every published version
crosses the node boundary through Ray's object store. After the second step the second node's whole
process group is killed (SIGKILL, by the PID this test started) and a new node with the same
resources is started. The worker's death is noticed, its in-flight samples are dropped as
``worker_died`` and a replacement is placed on the new node; Ray restarts the old-logit service
there, the driver's calls wait for it (``oldlogit.restart_timeout_s``), and the restarted service
holds no version until the next publication. The job completes with the accounting identity intact,
every token exact before the loss, and the restart counted. Whether a batch after the loss holds
tokens of a version only the lost service had (answered ``missing``, exact fraction below 1) depends
on whether the batch taken ahead right after the second step was scored before the kill, so it is
not asserted. Only processes this test started are signalled.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.local_cluster import LocalRayHead
from trainer.metrics_log import read_metrics

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


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
            "rollout.max_batch=16", "rollout.sampling.max_tokens=12", "rollout.sampling.n=4",
            "controller.batch_groups=2", "controller.max_staleness=1", "controller.total_steps=5",
            "learner.micro_batch_size=8", "server.enabled=false", "logging.tensorboard=false", "logging.plots=false",
            'loss.method="snapshot"', "rollout.resources={rollout_node = 1}", "learner.resources={learner_node = 1}",
            "oldlogit.resources={oldlogit_node = 1}", "oldlogit.restart_timeout_s=300",
            "rollout.start_timeout_s=240", f'logging.run_dir="{run_dir}"',
        ]  # fmt: skip
        cmd = [sys.executable, "-m", "vintage_cli.main", "run", "--address", head.gcs_address]
        for o in overrides:
            cmd += ["--set", o]
        env = {**os.environ, **head.client_env(), "PYTHONPATH": str(REPO)}
        log = open(tmp_path / "job.log", "w")
        job = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            metrics, lost = run_dir / "metrics.jsonl", None
            deadline = time.monotonic() + 780
            while job.poll() is None and time.monotonic() < deadline:
                if lost is None and metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                    lost = time.time()
                    nodes[0].stop(timeout_s=10, sig=signal.SIGKILL)  # the raylet, the worker and the service
                    nodes.append(head.add_node(num_cpus=2, resources=second))
                time.sleep(0.5)
        finally:
            if job.poll() is None:
                job.kill()
            job.wait(timeout=60)
        out = (tmp_path / "job.log").read_text()
        assert lost is not None and job.returncode == 0, out[-4000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        rows = read_metrics(metrics)
        assert summary["end_reason"] == "completed" and summary["steps"] == 5
        assert summary["worker_restarts"] == 1 and "worker_died" in summary["dropped"]
        assert summary["accounting_ok"]
        assert [r["version"] for r in rows] == [1, 2, 3, 4, 5]
        assert [r["exact_token_fraction"] for r in rows][:2] == [1.0, 1.0]  # before the loss
        # one restart, after the second step: counted at the first status read answered by the new process
        restarts = [r["oldlogit_restarts"] for r in rows]
        assert restarts[:2] == [0, 0] and restarts[-1] == 1 and summary["oldlogit_restarts"] == 1
    finally:
        for n in nodes:
            n.stop(timeout_s=10)
        head.stop(timeout_s=10)
