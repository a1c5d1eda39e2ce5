"""vLLM on CPU serves what was published: the fingerprint read back from its model (fused qkv /
gate_up modules, linear weights repacked for the CPU GEMM kernel and read through it) equals the
learner-side fingerprint of the folder before any update and of the payload after one.

The engine runs in a child process: vLLM sets up and tears down torch.distributed's default group
in its process, which would leave the DeepSpeed learners of later tests in this process with
groups that no longer exist.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def readback(model_path: str, dtype: str) -> dict:
    """The fingerprints of one vLLM engine on ``model_path``: served before any update, the folder's
    expected one (its fp32 weights rounded to ``dtype``), and after publishing the weights x 1.01."""
    import torch

    from modelkit.fingerprint import weights_fingerprint
    from modelkit.modelhub import load_causal_lm
    from modelkit.weights import pack_weights
    from rollout.engine import EngineConfig, VllmEngine
    from rollout.worker import RolloutWorkerCore

    engine = VllmEngine(EngineConfig(model_path=model_path, max_model_len=256, max_num_seqs=4, dtype=dtype))
    try:
        core = RolloutWorkerCore(engine)
        model = load_causal_lm(model_path)
        folder = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
        out = {"served_before": core.served_fingerprint, "folder": weights_fingerprint(folder, dtype)}
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01)
        manifest, payload = pack_weights(model.state_dict().items(), version=1, dtype=dtype)
        out["applied_version"] = core.update_weights(manifest, payload)
        return {**out, "after": core.fingerprint(), "manifest": manifest.fingerprint}
    finally:
        engine.close()


READBACK = """
import json, sys
from tests.integration.test_fingerprint_vllm import readback
print(json.dumps(readback(sys.argv[1], sys.argv[2])))
"""


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_vllm_readback_matches_the_published_fingerprint(tiny_model_path, dtype):
    child = subprocess.run(
        [sys.executable, "-c", READBACK, str(tiny_model_path), dtype],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    got = json.loads(child.stdout.strip().splitlines()[-1])
    assert got["served_before"] == got["folder"]  # fp32 learner, rounded to bf16
    assert got["applied_version"] == 1
    assert got["after"] == {"version": 1, "served": got["manifest"], "applied": got["manifest"]}
    assert got["manifest"] != got["folder"]
