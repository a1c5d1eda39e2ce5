"""Resident memory by part: a process tree's sum, and the parts of a job's step."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from modelkit.procmem import tree_rss_bytes
from protocol import OldLogitServiceStatus, WorkerStatus
from trainer.driver.loop.report import part_memory

HOLD = "import sys, time; b = bytearray(256 << 20); b[::4096] = b'x' * len(b[::4096]); print('ok', flush=True); time.sleep(60)"


def test_a_child_holding_256_mib_adds_at_least_that_to_its_parents_tree():
    """A child that wrote every page of 256 MiB is resident with them: the tree of this process
    grows by at least 256 MiB while it lives, and a process that is gone counts 0."""
    child = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ok"
        own = psutil.Process().memory_info().rss
        assert tree_rss_bytes() - own >= 256 << 20
        assert tree_rss_bytes(child.pid) >= 256 << 20
    finally:
        child.kill()
        child.wait()
    time.sleep(0.1)
    assert tree_rss_bytes(child.pid) == 0


def test_part_memory_sums_the_workers_and_reads_the_learner_and_the_service():
    workers = [
        WorkerStatus(worker_id="rollout-0", policy_version=1, in_flight=0, rss_bytes=3 << 30),
        WorkerStatus(worker_id="rollout-1", policy_version=1, in_flight=0, rss_bytes=1 << 30),
    ]
    service = OldLogitServiceStatus(route="snapshot", rss_bytes=2 << 30)
    parts = part_memory({"rss_bytes": float(5 << 30)}, workers, service)
    assert (parts["learner"], parts["workers"], parts["oldlogit"]) == (5 << 30, 4 << 30, 2 << 30)
    assert parts["job"] >= parts["driver"] > 0  # this process is part of its own tree
    assert part_memory({}, [], None)["oldlogit"] == 0.0 and part_memory({}, [], None)["learner"] == 0.0
