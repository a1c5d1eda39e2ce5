"""RolloutWorker as a Ray actor on the private test cluster: generation runs in the actor's thread
while the driver polls and pushes a weight update through the object store."""

from __future__ import annotations

import time

import pytest
import torch

from modelkit.modelhub import load_causal_lm
from modelkit.weights import pack_weights
from protocol import EnvRef, RolloutRequest, SamplingParams, WorkerStatus

pytestmark = pytest.mark.integration


def test_rollout_worker_actor_generates_and_updates_mid_generation(ray_cluster, tiny_model_path):
    ray = ray_cluster
    from rollout.worker_actor import RolloutWorker

    cfg = {
        "kind": "vllm",
        "model_path": str(tiny_model_path),
        "max_model_len": 512,
        "kv_cache_gib": 1,
        "max_num_seqs": 8,
    }
    w = RolloutWorker.remote(cfg, worker_id="rw-test")
    try:
        info = ray.get(w.ready.remote(), timeout=300)
        assert info["version"] == 0 and info["engine_start_seconds"] > 0
        env = EnvRef(path="rollout.envs.reasoning_gym_env:ReasoningGymEnv", kwargs={"level": "easy"}, seed=4)
        reqs = [
            RolloutRequest(
                request_id="rg", group_id="g0", env=env, sampling=SamplingParams(max_tokens=200, n=2, temperature=1.0)
            )
        ]
        reqs += [
            RolloutRequest(
                request_id=f"p{i}",
                group_id="g1",
                prompt="Once upon a time",
                sampling=SamplingParams(max_tokens=300, temperature=1.0),
            )
            for i in range(2)
        ]
        assert ray.get(w.submit.remote(reqs)) == 4
        deadline = time.time() + 60
        while ray.get(w.status.remote()).generated_tokens < 20 and time.time() < deadline:
            time.sleep(0.05)
        hf = load_causal_lm(tiny_model_path)
        g = torch.Generator().manual_seed(0)
        manifest, payload = pack_weights(
            ((k, v + 0.01 * torch.randn(v.shape, generator=g)) for k, v in hf.state_dict().items()), version=1
        )
        ref = ray.put(payload)  # one copy in the object store, handed to every consumer
        assert ray.get(w.update_weights.remote(manifest, ref), timeout=120) == 1
        trajs = []
        deadline = time.time() + 180
        while len(trajs) < 4 and time.time() < deadline:
            trajs += ray.get(w.poll.remote())
            time.sleep(0.1)
        assert sorted(t.trajectory_id for t in trajs) == ["p0", "p1", "rg/0", "rg/1"]
        st = ray.get(w.status.remote())
        assert isinstance(st, WorkerStatus) and st.policy_version == 1 and st.in_flight == 0 and st.errors == 0
        assert st.tokens_per_s > 0 and st.generated_trajectories == 4
        spans = [t for t in trajs if t.segments() and t.segments()[0][0] == 0 and t.segments()[-1][0] == 1]
        assert spans, "at least one sequence spans the update (versions 0 then 1)"
        for t in trajs:
            assert t.worker_id == "rw-test" and t.policy_version == 1
        rg = [t for t in trajs if t.trajectory_id.startswith("rg")]
        assert all(t.info["env"]["seed"] == 4 and 0.0 <= t.reward <= 1.0 for t in rg)
    finally:
        ray.get(w.close.remote(), timeout=60)
        ray.kill(w)
