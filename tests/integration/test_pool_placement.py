"""A worker the cluster cannot place is abandoned after ``start_timeout_s``; the pool goes on."""

from __future__ import annotations

import pytest

from rollout.engine import EngineConfig
from trainer.pool import WorkerPool

pytestmark = pytest.mark.integration


def test_unplaceable_worker_times_out_and_pool_stays_empty(ray_cluster, tiny_model_path):
    # a custom resource no node of the test cluster has: Ray can never place the actor
    pool = WorkerPool(
        EngineConfig(kind="transformers", model_path=str(tiny_model_path)),
        actor_options={"num_cpus": 0.1, "resources": {"no_such_node": 1}},
        start_timeout_s=2.0,
    )
    added, removed = pool.scale_to(2)
    assert (added, removed, len(pool)) == ([], {}, 0)
