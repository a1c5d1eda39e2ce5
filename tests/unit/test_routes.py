"""Route objects: which hooks do what for each old-logit route kind (no Ray: hooks that only order
calls are checked with a recording handle)."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.driver.publication.routes import Route, ScorerRoute, SnapshotRoute, make_route

SERVICE = object()  # stands in for the old-logit service's actor handle


@pytest.mark.parametrize(
    "name, kind, worker_scorer",
    [
        ("none", Route, None),
        ("snapshot", SnapshotRoute, None),
        ("old_logit_model", ScorerRoute, None),
        ("interrupt_sync", ScorerRoute, SERVICE),
    ],
)
def test_make_route_kinds(name, kind, worker_scorer):
    route = make_route(name, None if name == "none" else SERVICE)
    assert type(route) is kind and route.name == name and route.worker_scorer is worker_scorer


@pytest.mark.parametrize(
    "name, collects", [("none", 0), ("snapshot", 0), ("old_logit_model", 1), ("interrupt_sync", 1)]
)
def test_only_scorer_routes_collect_before_publish(name, collects):
    calls = []
    make_route(name, SERVICE).before_publish(lambda: calls.append("collect"))
    assert calls == ["collect"] * collects


def test_routes_without_a_per_batch_answer_pass_trajectories_through():
    got = ["t0", "t1"]
    for route in (make_route("none", None), make_route("snapshot", SERVICE)):
        assert route.attach(got, 1.0) is got
    assert make_route("none", None).async_old_logits(got, 3, 1.0) is None
    assert make_route("interrupt_sync", SERVICE).async_old_logits(got, 3, 1.0) is None
    assert make_route("old_logit_model", SERVICE).attach([], 1.0) == []


def test_no_route_publishes_to_the_workers_only():
    calls = []
    make_route("none", None).publish(lambda: calls.append("workers"), None)
    assert calls == ["workers"]


def test_make_route_names_a_bad_route():
    with pytest.raises(ValueError, match="oldlogit_route: 'exact'"):
        make_route("exact", SERVICE)
    with pytest.raises(ValueError, match="oldlogit_route: 'snapshot' needs a running old-logit service"):
        make_route("snapshot", None)


def test_the_snapshot_route_asks_only_for_older_versions_when_the_learner_gives_its_own():
    from protocol import Trajectory
    from trainer.algorithm.batch import learner_gives_current

    class Calls:
        def __init__(self):
            self.sent = []

        def submit(self, method, req):
            self.sent.append((method, req))

    t = Trajectory(
        trajectory_id="t", group_id="g", token_ids=np.arange(5), loss_mask=np.array([0, 1, 1, 1, 1], np.int8),
        behav_logprobs=np.full(5, -0.5, np.float32), versions=np.array([-1, 2, 3, 3, 3]), prompt_len=1,
        policy_version=3, finish_reason="stop", reward=1.0,
    )  # fmt: skip
    masks = []
    for steps in (1, 2):  # one optimizer step per batch: the learner gives version 3's tokens
        route = make_route("snapshot", SERVICE, current_from_learner=learner_gives_current("snapshot", steps))
        route.calls = Calls()
        route.async_old_logits([t], 3, 1.0)
        ((method, req),) = route.calls.sent
        masks.append(req.items[0].loss_mask.tolist())
    assert method == "score" and masks == [[0, 1, 0, 0, 0], [0, 1, 1, 1, 1]]


def test_the_scorer_installs_the_rollout_publication_only_when_it_is_in_the_learners_dtype_and_unperturbed():
    own = []

    def publish(dtype):
        own.append(dtype)
        return ("manifest-fp32", "ref-fp32")

    rollout = ("manifest", "ref")
    assert make_route("none", None).scorer_publication(rollout, "bfloat16", publish, perturbed=False) is None
    snap = make_route("snapshot", SERVICE)
    assert snap.scorer_publication(rollout, "float32", publish, perturbed=False) == rollout and own == []
    assert snap.scorer_publication(rollout, "bfloat16", publish, perturbed=False) == ("manifest-fp32", "ref-fp32")
    assert snap.scorer_publication(rollout, "float32", publish, perturbed=True) == ("manifest-fp32", "ref-fp32")
    assert own == ["float32", "float32"]
    bf16 = make_route("snapshot", SERVICE, scorer_dtype="bfloat16")  # a bf16 learner: the service scores in bf16
    assert bf16.scorer_publication(rollout, "bfloat16", publish, perturbed=False) == rollout
    assert bf16.scorer_publication(rollout, "float32", publish, perturbed=False) == ("manifest-fp32", "ref-fp32")
    assert own == ["float32", "float32", "bfloat16"]
