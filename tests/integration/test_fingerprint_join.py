"""A rollout worker that joins after a publication is fingerprint-checked like one that took it.

Real rollout workers (Ray actors on the private test cluster, the transformers engine on the tiny
model) in the driver's real :class:`trainer.driver.workers.pool.WorkerPool`: version 1 (every weight x 1.25)
is published to the first worker; a second joins with the test hook that makes its engine skip the
catch-up load, so it serves the folder's weights under version 1. The job's controls find it,
kill it as ``fingerprint_mismatch`` (counted once), replace it, and the replacement, which loads
its catch-up, passes. The pool's other route to a publication, a late worker's update or
catch-up taken in by a poll, is handed over for the same check.
"""

from __future__ import annotations

import time

import pytest
import torch
from rich.console import Console

from modelkit.modelhub import load_causal_lm
from modelkit.weights import pack_weights
from trainer.driver.cluster.server import StatusBoard
from trainer.driver.config.schema import load_config
from trainer.driver.loop.supervision import WorkerSupervisor
from trainer.driver.publication.fingerprint_check import FingerprintCheck
from trainer.driver.publication.fingerprints import FINGERPRINT_MISMATCH
from trainer.driver.publication.routes import Route
from trainer.driver.sources.buffer import TrajectoryBuffer
from trainer.driver.sources.source import EnvSource

pytestmark = pytest.mark.integration


def _admit_all(j: WorkerSupervisor, board: StatusBoard, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while j.pool.starting and time.monotonic() < deadline:
        j.admit_started(board)
        time.sleep(0.2)
    assert not j.pool.starting, "a worker did not start in time"


def test_a_joiner_that_skips_its_catch_up_load_is_killed_replaced_and_counted(ray_cluster, tiny_model_path):
    ray = ray_cluster
    from rollout.engine import EngineConfig
    from trainer.driver.workers.pool import WorkerPool

    engine = EngineConfig(kind="transformers", model_path=str(tiny_model_path))
    pool = WorkerPool(engine)
    cfg, console = load_config(None, ["rollout.num_workers=2", "rollout.max_restarts=2"]), Console(quiet=True)
    source = EnvSource(cfg, pool, TrajectoryBuffer(capacity=16, max_staleness=1), lambda: 1)
    j = WorkerSupervisor(cfg, console, pool, source, FingerprintCheck(cfg, console, pool, Route()))  # the pool is real
    board = StatusBoard()
    try:
        assert pool.scale_to(1)[0] == ["rollout-0"]
        model = load_causal_lm(tiny_model_path)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.25)
        manifest, payload = pack_weights(model.state_dict().items(), version=1)
        assert pool.update_weights(manifest, ray.put(payload)) == [1]
        j.fingerprints.check_fingerprints(manifest, None)  # the publication's own check: rollout-0 serves it
        assert j.fingerprints.mismatches == 0 and pool.take_unverified() == {}

        pool.engine_config = engine.model_copy(update={"test_skip_weight_loads": True})
        pool.request(2)  # a scale-up: rollout-1 starts in the background, then catches up to v1
        _admit_all(j, board)
        assert j.fingerprints.mismatches == 1 and pool.worker_ids() == ["rollout-0"]
        assert pool._died == {"rollout-1": (0, FINGERPRINT_MISMATCH)}  # reported to the next controls

        pool.engine_config = engine  # the replacement loads what it is sent
        j.replace_dead(board)
        assert board.status().scale_note == (
            "rollout worker(s) rollout-1 served other weights than its version's (fingerprint mismatch) "
            "(0 samples lost); 1 of 2 running, 1 starting, 1 of 2 restarts used"
        )
        _admit_all(j, board)
        assert j.fingerprints.mismatches == 1 and pool.worker_ids() == ["rollout-0", "rollout-2"]
        reports = pool.fingerprints()
        want = {"version": 1, "served": manifest.fingerprint, "applied": manifest.fingerprint}
        assert reports == {"rollout-0": want, "rollout-2": want}
        assert (
            sum(source.buffer.dropped.values()) == 0 and source.buffer.accounting_ok()
        )  # no sample was in flight on it
    finally:
        pool.shutdown()


class _Method:
    """``actor.<method>.remote(...)``: a ready reference to ``value`` (nothing runs)."""

    def __init__(self, ray, value):
        self.ray, self.value = ray, value

    def remote(self, *args):
        return self.ray.put(self.value)


def test_a_late_workers_update_and_catch_up_are_handed_over_for_checking(ray_cluster):
    """The pool's other route to a publication: rollout-0's update to v2 is answered late (taken
    in by a poll), then it misses a publication while late and is caught up once its late calls
    are in. Each time it is handed over (``take_unverified``) with the manifest it applied, once."""
    ray = ray_cluster
    from types import SimpleNamespace

    from rollout.engine import EngineConfig
    from trainer.driver.workers.pool import WorkerPool

    pool = WorkerPool(EngineConfig(kind="transformers", model_path="unused"), hang_timeout_s=600.0)
    manifest = SimpleNamespace(version=2)
    actor = SimpleNamespace(poll=_Method(ray, []), update_weights=_Method(ray, 2))
    pool.workers["rollout-0"], pool.in_flight["rollout-0"] = actor, 0
    pool._latest = (manifest, None)
    pool._late["rollout-0"] = [("update_weights", ray.put(2), 0)]
    assert pool.take_unverified() == {}
    pool.poll()
    assert pool.take_unverified() == {"rollout-0": manifest} and pool.take_unverified() == {}
    pool._late["rollout-0"], pool._behind = [("poll", ray.put([]), 0)], {"rollout-0"}
    pool.poll()  # the late poll is in: the catch-up goes out (a late call of its own)
    assert pool._late["rollout-0"][0][0] == "update_weights" and pool.take_unverified() == {}
    pool.poll()  # its answer
    assert pool.take_unverified() == {"rollout-0": manifest} and "rollout-0" not in pool._late
