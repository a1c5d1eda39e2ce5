"""Parts that cannot start: a rollout worker is abandoned after ``start_timeout_s`` (the pool goes
on); a learner that cannot start raises naming the part instead of waiting silently."""

from __future__ import annotations

import time

import pytest

from rollout.engine import EngineConfig
from trainer.driver.workers.pool import WorkerPool

pytestmark = pytest.mark.integration


def test_unplaceable_worker_times_out_and_pool_stays_empty(ray_cluster, tiny_model_path):
    # a custom resource no node of the test cluster has: Ray can never place the actor
    pool = WorkerPool(
        EngineConfig(kind="transformers", model_path=str(tiny_model_path)),
        actor_options={"num_cpus": 0.1, "resources": {"no_such_node": 1}},
        start_timeout_s=2.0,
    )
    added, removed = pool.scale_to(2)
    assert (added, removed, len(pool), pool.starting) == ([], {}, 0, {})


def test_a_worker_started_in_the_background_is_given_up_without_anyone_waiting(ray_cluster, tiny_model_path):
    pool = WorkerPool(
        EngineConfig(kind="transformers", model_path=str(tiny_model_path)),
        actor_options={"num_cpus": 0.1, "resources": {"no_such_node": 1}},
        start_timeout_s=2.0,
    )
    assert pool.request(1) == {} and list(pool.starting) == ["rollout-0"]  # launched, not waited for
    assert pool.admit_started() == ([], [])  # not ready, deadline not reached: nothing happens
    deadline = time.monotonic() + 60
    while (got := pool.admit_started()) == ([], []):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert got == ([], ["rollout-0"]) and (len(pool), pool.starting) == (0, {})


def test_learner_that_cannot_start_raises_naming_the_part(ray_cluster, tiny_model_path):
    from trainer.driver.loop.report import failed_part
    from trainer.learner import LearnerGroup, LearnerSettings

    with pytest.raises(RuntimeError) as ei:  # rank 0 is pinned to the driver's node, which lacks the resource
        LearnerGroup(
            LearnerSettings(model_path=str(tiny_model_path)), resources={"no_such_node": 1}, start_timeout_s=2.0
        )
    assert str(ei.value).startswith("learner: cannot be placed (The actor is not schedulable")
    assert failed_part(ei.value) == "learner"
