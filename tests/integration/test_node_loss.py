"""A node lost mid-run on a two-node Ray cluster on this machine.

The test starts its own cluster with :class:`deploy.local_cluster.LocalRayHead`: a head holding the
custom resource ``learner_node`` (the learner and the old-logit service) and a second node (``ray start --address ...`` on loopback) holding
``rollout_node``, both with token authentication. A tiny job runs against it as a user would
(``vintage run --address``), learner on the head, its one rollout worker on the second node, so every
published version crosses the node boundary through Ray's object store. After the second step the
second node's whole process group is killed (SIGKILL, by the PID this test started) and a new node
with the same resources is started: the worker's death is noticed, its in-flight samples are dropped
as ``worker_died``, a replacement is placed on the new node, and the job completes with the
accounting identity intact. Only processes this test started are signalled.
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

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_lost_rollout_node_is_survived_once_a_node_with_its_resources_is_back(tmp_path, tiny_model_path):
    head = LocalRayHead.start(num_cpus=3, resources={"learner_node": 2}, timeout_s=180)
    nodes = []
    try:
        nodes.append(head.add_node(num_cpus=2, resources={"rollout_node": 2}))
        run_dir = tmp_path / "run"
        overrides = [
            'model.path="tiny"', "env.eval_prompts=0", 'rollout.engine="transformers"', "rollout.num_workers=1",
            "rollout.max_batch=16", "rollout.sampling.max_tokens=12", "rollout.sampling.n=4",
            "controller.batch_groups=2", "controller.max_staleness=1", "controller.total_steps=5",
            "learner.micro_batch_size=8", "server.enabled=false", "logging.tensorboard=false", "logging.plots=false",
            "rollout.resources={rollout_node = 1}", "learner.resources={learner_node = 1}",
            "oldlogit.resources={learner_node = 1}",
            "rollout.start_timeout_s=240", f'logging.run_dir="{run_dir}"',
        ]  # fmt: skip
        cmd = [sys.executable, "-m", "vintage_cli.main", "run", "--address", head.gcs_address]
        for o in overrides:
            cmd += ["--set", o]
        env = {**os.environ, **head.client_env(), "PYTHONPATH": str(REPO)}
        log = open(tmp_path / "job.log", "w")
        job = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            metrics, lost = run_dir / "metrics.jsonl", False
            deadline = time.monotonic() + 780
            while job.poll() is None and time.monotonic() < deadline:
                if not lost and metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                    nodes[0].stop(timeout_s=10, sig=signal.SIGKILL)  # the node's raylet and its worker
                    nodes.append(head.add_node(num_cpus=2, resources={"rollout_node": 2}))
                    lost = True
                time.sleep(0.5)
        finally:
            if job.poll() is None:
                job.kill()
            job.wait(timeout=60)
        out = (tmp_path / "job.log").read_text()
        assert lost and job.returncode == 0, out[-4000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["end_reason"] == "completed" and summary["steps"] == 5
        assert summary["worker_restarts"] == 1 and "worker_died" in summary["dropped"]
        assert summary["accounting_ok"]
    finally:
        for n in nodes:
            n.stop(timeout_s=10)
        head.stop(timeout_s=10)
