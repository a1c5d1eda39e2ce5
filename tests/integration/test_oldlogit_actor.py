"""OldLogitServer as a Ray actor on a real local cluster: the three exact routes with the tiny
model, errors that cross the actor boundary with their field names, and the snapshot route with
the real small model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from modelkit.modelhub import load_causal_lm
from modelkit.scoring import sequence_logprobs
from modelkit.weights import pack_weights
from protocol import OldLogitRequest, TokenStatus, Trajectory

pytestmark = pytest.mark.integration
T = 0.8


def bump(model: torch.nn.Module, seed: int) -> None:
    """One fake optimizer step (in place)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)


def forward(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        t = torch.as_tensor(ids[None], dtype=torch.long)
        return sequence_logprobs(model, t, torch.ones_like(t), T)[0].numpy()


def publish(ray, servers, model, version: int) -> None:
    man, pay = pack_weights(model.state_dict().items(), version)
    ref = ray.put(pay)  # one payload in the object store, shared by every consumer
    assert ray.get([s.update_weights.remote(man, ref) for s in servers]) == [version] * len(servers)


def test_three_routes_as_actors(ray_cluster, tiny_model_path):
    ray = ray_cluster
    from oldlogit_service.actor import OldLogitServer, start_server

    with pytest.raises(Exception, match="route"):
        start_server(str(tiny_model_path), route="snapshots")
    snap = OldLogitServer.options(num_cpus=0.25).remote(str(tiny_model_path), route="snapshot", max_staleness=1)
    olm = OldLogitServer.options(num_cpus=0.25).remote(str(tiny_model_path), route="old_logit_model")
    isync = OldLogitServer.options(num_cpus=0.25).remote(str(tiny_model_path), route="interrupt_sync")
    servers = [snap, olm, isync]
    assert ray.get([s.ready.remote() for s in servers]) == [True] * 3

    learner = load_causal_lm(tiny_model_path)
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 49152, 12)
    versions = np.array([-1] * 4 + [0, 0, 0, 1, 1, 2, 2, 2], np.int32)
    mask = (versions >= 0).astype(np.int8)
    want = np.full(12, np.nan, np.float32)
    want[versions == 0] = forward(learner, ids)[versions == 0]

    def traj(upto: int, old=None) -> Trajectory:
        return Trajectory(
            trajectory_id="t",
            group_id="g",
            token_ids=ids[:upto],
            loss_mask=mask[:upto],
            behav_logprobs=np.full(upto, -1.0, np.float32),
            versions=versions[:upto],
            policy_version=int(versions[:upto].max()),
            prompt_len=4,
            finish_reason="abort",
            old_logprobs=old,
        )

    # version 0 is live everywhere; old_logit_model scores the finished version-0 segment now,
    # interrupt_sync scores the in-flight prefix at the outgoing version 0 and then takes version 1
    (t0,) = ray.get(olm.attach_old_logprobs.remote([traj(7)], T))
    isync_prefix = isync.score_prefixes.remote([traj(7)], T)  # submitted before the update: runs first
    bump(learner, 1)
    want[versions == 1] = forward(learner, ids)[versions == 1]
    publish(ray, servers, learner, 1)
    (p0,) = ray.get(isync_prefix)
    (t1,) = ray.get(olm.attach_old_logprobs.remote([traj(9, np.concatenate([t0.old_logprobs, [np.nan] * 2]))], T))
    (p1,) = ray.get(isync.score_prefixes.remote([traj(9)], T, [p0]))
    bump(learner, 2)
    want[versions == 2] = forward(learner, ids)[versions == 2]
    publish(ray, servers, learner, 2)
    (t2,) = ray.get(olm.attach_old_logprobs.remote([traj(12, np.concatenate([t1.old_logprobs, [np.nan] * 3]))], T))
    (p2,) = ray.get(isync.score_prefixes.remote([traj(12)], T, [p1]))
    for got in (t2.old_logprobs, p2):
        assert np.allclose(got, want, atol=1e-5, rtol=0, equal_nan=True)
        assert np.isfinite(got[4:]).all()

    # snapshot at V=2, W=1: version 0 evicted, versions 1 and 2 exact, one request
    req = OldLogitRequest(
        request_id="r", temperature=T, items=[dict(trajectory_id="t", token_ids=ids, loss_mask=mask, versions=versions)]
    )
    ans = ray.get(snap.score.remote(req))
    assert ans.status[0][4:].tolist() == [TokenStatus.MISSING_EVICTED] * 3 + [TokenStatus.EXACT] * 5
    assert np.allclose(ans.old_logprobs[0][7:], want[7:], atol=1e-5, rtol=0)
    assert ans.exact_token_fraction() == pytest.approx(5 / 8)
    st = ray.get(snap.status.remote())
    assert st.versions_held == [1, 2] and st.tokens_missing == {"MISSING_EVICTED": 3} and st.tokens_exact == 5
    one_copy = sum(p.numel() for p in learner.parameters()) * 4
    assert st.bytes_held == 2 * one_copy
    for s in (olm, isync):
        st = ray.get(s.status.remote())
        assert st.versions_held == [2] and st.bytes_held == one_copy and st.tokens_missing == {}

    # malformed input crosses the actor boundary with the field named
    bad = req.model_dump()
    bad["items"][0]["token_ids"] = np.array([49152] + list(ids[1:]), np.int32)
    with pytest.raises(ValueError, match=r"items\[0\]\.token_ids"):
        ray.get(snap.score.remote(bad))
    with pytest.raises(Exception, match="temperature"):
        ray.get(snap.score.remote({"request_id": "r", "items": bad["items"]}))
    for s in servers:
        ray.kill(s)


def test_snapshot_actor_with_real_model(ray_cluster, real_model_path):
    ray = ray_cluster
    from oldlogit_service.actor import start_server

    server = start_server(str(real_model_path), route="snapshot", max_staleness=1, num_cpus=0.25)
    learner = load_causal_lm(real_model_path)
    ids = np.random.RandomState(1).randint(0, learner.config.vocab_size, 16)
    versions = np.array([-1] * 6 + [0] * 5 + [1] * 5, np.int32)
    want = np.full(16, np.nan, np.float32)
    want[versions == 0] = forward(learner, ids)[versions == 0]
    bump(learner, 7)
    want[versions == 1] = forward(learner, ids)[versions == 1]
    publish(ray, [server], learner, 1)
    req = OldLogitRequest(
        request_id="real",
        temperature=T,
        items=[dict(trajectory_id="t", token_ids=ids, loss_mask=(versions >= 0).astype(np.int8), versions=versions)],
    )
    ans = ray.get(server.score.remote(req))
    assert (ans.status[0][6:] == TokenStatus.EXACT).all()
    assert np.allclose(ans.old_logprobs[0], want, atol=1e-4, rtol=0, equal_nan=True)
    assert not np.allclose(want[11:], forward(load_causal_lm(real_model_path), ids)[11:], atol=1e-3)  # versions differ
    stats = ray.get(server.stats.remote())
    assert stats["forwards"] == 2 and stats["versions_held"] == [0, 1]
    assert stats["bytes_held"] == 2 * sum(p.numel() for p in learner.parameters()) * 4
    ray.kill(server)
