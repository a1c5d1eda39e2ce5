"""vLLM on CPU serves what was published: the fingerprint read back from its model (fused qkv /
gate_up modules, linear weights repacked for the CPU GEMM kernel and read through it) equals the
learner-side fingerprint of the folder before any update and of the payload after one."""

from __future__ import annotations

import pytest
import torch

from modelkit.fingerprint import weights_fingerprint
from modelkit.modelhub import load_causal_lm
from modelkit.weights import pack_weights

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_vllm_readback_matches_the_published_fingerprint(tiny_model_path, dtype):
    from rollout.engine import EngineConfig, VllmEngine
    from rollout.worker import RolloutWorkerCore

    engine = VllmEngine(EngineConfig(model_path=str(tiny_model_path), max_model_len=256, max_num_seqs=4, dtype=dtype))
    try:
        core = RolloutWorkerCore(engine)
        model = load_causal_lm(tiny_model_path)
        folder = {
            k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"
        }  # tied: not in the folder
        assert core.served_fingerprint == weights_fingerprint(folder, dtype)  # fp32 learner, rounded to bf16
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01)
        manifest, payload = pack_weights(model.state_dict().items(), version=1, dtype=dtype)
        assert core.update_weights(manifest, payload) == 1
        assert core.fingerprint() == {"version": 1, "served": manifest.fingerprint, "applied": manifest.fingerprint}
        assert manifest.fingerprint != weights_fingerprint(folder, dtype)
    finally:
        engine.close()
