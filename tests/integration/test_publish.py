"""Weight publication through real Ray on one host (CPU), and the CUDA path on a GPU machine.

CPU: the learner-side pack (``copy=False``) goes into the object store; two consumers on the host
read it as read-only shared memory, exactly one of them runs the check, and both see the
producer's weights bit for bit.
GPU (skipped without CUDA): a CUDA IPC payload is opened in another process on the same GPU and
checked there; vLLM on CUDA copies a version into its parameters in place.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modelkit.modelhub import load_causal_lm
from modelkit.weights import pack_weights, raw_bytes, unpack_weights, verify_payload
from protocol import weights_digest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC and vLLM on CUDA need an NVIDIA GPU")


def test_object_store_payload_is_shared_and_checked_once_on_the_host(ray_cluster, tiny_model_path):
    ray = ray_cluster

    # defined here so that Ray ships them by value (the test module is not importable in workers)
    class _Producer:
        def __init__(self, path: str):
            self.model = load_causal_lm(path)

        def publish(self, version: int):
            return pack_weights(self.model.state_dict().items(), version, copy=False)  # the learner's path

    class _Consumer:
        def take(self, manifest, payload) -> dict:
            ran_check = verify_payload(manifest, payload)
            named = unpack_weights(manifest, payload, verify=False)
            return {
                "readonly": payload.readonly,
                "ran_check": ran_check,
                "digest": weights_digest(
                    [s.name for s in manifest.tensors], [named[s.name].numpy().tobytes() for s in manifest.tensors]
                ),
                "tied_same": named["lm_head.weight"] is named["model.embed_tokens.weight"],
            }

    producer = ray.remote(num_cpus=0.5)(_Producer).remote(str(tiny_model_path))
    consumers = [ray.remote(num_cpus=0.5)(_Consumer).remote() for _ in range(2)]
    man_ref, pay_ref = producer.publish.options(num_returns=2).remote(3)
    manifest = ray.get(man_ref)
    got = ray.get([c.take.remote(manifest, pay_ref) for c in consumers])
    assert sorted(g["ran_check"] for g in got) == [False, True]  # one check on the host, one record found
    assert all(g["readonly"] and g["tied_same"] for g in got)
    # the bytes each consumer reads are the producer's weights: same digest as a fresh packing here
    ref_manifest, _ = pack_weights(load_causal_lm(tiny_model_path).state_dict().items(), 3)
    assert manifest.checksum == ref_manifest.checksum and {g["digest"] for g in got} == {ref_manifest.checksum}
    for a in (producer, *consumers):
        ray.kill(a)


_CHILD = """
import json, pickle, sys, torch
from modelkit.weights import unpack_weights
manifest, payload = pickle.loads(sys.stdin.buffer.read())
from modelkit.weights import raw_bytes
from protocol import weights_digest
named = unpack_weights(manifest, payload)  # opens the handle, checks names, digest, finiteness on the GPU
names = [s.name for s in manifest.tensors]
print(json.dumps({"devices": sorted({str(t.device) for t in named.values()}),
                  "bytes_digest": weights_digest(names, [raw_bytes(named[n].cpu()) for n in names])}))
"""


@needs_cuda
def test_cuda_ipc_payload_opens_in_another_process(tiny_model_path):
    model = load_causal_lm(tiny_model_path).cuda()
    manifest, payload = pack_weights(model.state_dict().items(), version=1, dtype="bfloat16")  # auto: CUDA IPC
    assert type(payload).__name__ == "CudaIpcWeights" and manifest.tied == {
        "lm_head.weight": "model.embed_tokens.weight"
    }
    names = [s.name for s in manifest.tensors]
    want = weights_digest(names, [raw_bytes(payload[n].cpu()) for n in names])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=pickle.dumps((manifest, payload)),
        capture_output=True,
        env=env,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    got = json.loads(child.stdout.decode().strip().splitlines()[-1])
    assert got["devices"] == ["cuda:0"] and got["bytes_digest"] == want  # the producer's bytes, read in place


@needs_cuda
def test_vllm_on_cuda_copies_a_version_into_its_parameters_in_place(tiny_model_path):
    from rollout.engine import EngineConfig, VllmEngine
    from rollout.worker import RolloutWorkerCore

    engine = VllmEngine(
        EngineConfig(model_path=str(tiny_model_path), max_model_len=512, gpu_memory_utilization=0.2, max_num_seqs=4)
    )
    try:
        assert engine.inplace_updates
        core = RolloutWorkerCore(engine)
        model = load_causal_lm(tiny_model_path).cuda()
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(1.5)
        manifest, payload = pack_weights(model.state_dict().items(), version=1)  # CUDA IPC, same process
        assert core.update_weights(manifest, payload) == 1
        got = engine.param("model.embed_tokens.weight")
        assert torch.equal(got, model.model.embed_tokens.weight.detach().cpu())
    finally:
        engine.close()
