"""A cluster that a process started is stopped when that process is ended by a signal.

A child Python process starts what the multi-node tests start (a :class:`deploy.local_cluster.LocalRayHead`;
its nodes are owned the same way, but a second node's start outlasts any bound on this shared,
loaded machine) or what a job starts (its private local cluster, ``ray_session``, with one actor),
then waits. This test records every process of that cluster (the process groups and their members'
descendants, from outside), sends the child the signal, waits for it to end and checks that none of
the recorded processes is left. Only the child and the processes it started are signalled.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from trainer.driver.cluster import owned

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

HEAD = """
import json, signal, time
signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the default action this test expects, whatever was inherited
from deploy.local_cluster import LocalRayHead
head = LocalRayHead.start(num_cpus=1, timeout_s=300)
print(json.dumps({"groups": [head.pid], "temp_dir": head.temp_dir}), flush=True)
time.sleep(600)
"""

JOB_SESSION = """
import json, os, signal, time, ray
signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a run started under nohup (as a CI job may be) ignores it
from trainer.driver.config.schema import load_config
from trainer.driver.cluster.session import ray_session
with ray_session(load_config(None, ['model.path="tiny"', "rollout.num_workers=1", "ray.num_cpus=2"])):
    actor = ray.remote(num_cpus=0)(type("Pid", (), {"pid": lambda self: os.getpid()})).remote()
    print(json.dumps({"groups": [], "actor": ray.get(actor.pid.remote(), timeout=300)}), flush=True)
    time.sleep(600)
"""


def start_child(script: str, tmp_path: Path) -> tuple[subprocess.Popen, dict]:
    """The child and the JSON line it prints once its cluster is up (within 700 s: a shared, loaded machine)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    err = open(tmp_path / "child.err", "w")
    child = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True
    )
    owned.own(("test_child", child.pid), lambda: owned.stop_processes([psutil.Process(child.pid)], 5.0))
    deadline = time.monotonic() + 700
    line = ""
    while not line and child.poll() is None and time.monotonic() < deadline:
        line = child.stdout.readline()  # the child prints one line, then sleeps
    assert line, (tmp_path / "child.err").read_text()[-3000:]
    return child, json.loads(line)


def cluster_processes(child: subprocess.Popen, groups: list[int]) -> list[psutil.Process]:
    """Every process of the child's cluster now: the child's descendants and the members of the
    process groups it started (with theirs)."""
    members = [m for g in groups for m in owned.group_members(g)]
    return [p for p in owned.with_descendants([psutil.Process(child.pid), *members]) if p.pid != child.pid]


def left_after(procs: list[psutil.Process], timeout_s: float) -> list[str]:
    """``name(pid)`` of the processes of ``procs`` still running (not zombies) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p in procs if owned.alive(p)]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    out = []
    for p in left:
        try:
            out.append(f"{p.name()}({p.pid})")
        except psutil.Error:
            pass
    return out


def end_child(child: subprocess.Popen, sig: int, procs: list[psutil.Process]) -> tuple[int, list[str]]:
    try:
        child.send_signal(sig)
        rc = child.wait(timeout=120)
        return rc, left_after(procs, 30.0)
    finally:
        owned.stop_processes([*procs, psutil.Process(child.pid)] if child.poll() is None else procs, 5.0)
        owned.disown(("test_child", child.pid))


@pytest.mark.timeout(900)
def test_sigterm_to_the_owner_of_a_local_head_stops_it(tmp_path):
    child, info = start_child(HEAD, tmp_path)
    procs = cluster_processes(child, info["groups"])
    # `ray start --block` leads its group, which holds the head's GCS server and the rest
    assert info["groups"][0] in {p.pid for p in procs} and "gcs_server" in {p.name() for p in procs}
    rc, left = end_child(child, signal.SIGTERM, procs)
    # the head's stop ran, then SIGTERM's default action ended the child: status -15
    assert (rc, left) == (-signal.SIGTERM, [])
    assert owned.group_members(info["groups"][0]) == [] and not Path(info["temp_dir"]).exists()


@pytest.mark.timeout(900)
def test_sighup_to_a_job_session_stops_its_private_cluster_and_actor(tmp_path):
    child, info = start_child(JOB_SESSION, tmp_path)
    procs = cluster_processes(child, [])
    names = {p.name() for p in procs}
    assert {"gcs_server", "raylet"} <= names and info["actor"] in {p.pid for p in procs}, names
    rc, left = end_child(child, signal.SIGHUP, procs)
    # Ray leaves SIGHUP alone: the session's stop ran, then SIGHUP's default action (status -1);
    # without it the raylet's agents outlive the driver, orphaned
    assert (rc, left) == (-signal.SIGHUP, [])
