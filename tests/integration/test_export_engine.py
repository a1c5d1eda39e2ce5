"""An exported folder served by the rollout engines: the behaviour log-probs an engine samples with
from the folder equal the learner's log-probs of the same tokens at the exported version.

``vllm`` starts the real vLLM engine on CPU (about 1-2 minutes and ~2 GiB here) in a child process:
vLLM sets up and tears down torch.distributed's default group in its process, which would leave
the DeepSpeed learners of later tests in this process with groups that no longer exist.
``transformers`` is the engine fallback (seconds), in process. Tolerance ``TOL`` as for the engine's own log-probs (``test_rollout_vllm.py``):
fp32 engine vs fp32 learner, different kernels and an incremental KV cache.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from protocol import Trajectory
from rollout.engine import EngineConfig, EngineRequest, make_engine
from tests.export_run import TEMPERATURE, trained_run, trajectory_maker
from trainer.algorithm.batch import collate
from trainer.driver.records.export import export_run

pytestmark = pytest.mark.integration
TOL = 1e-3


def generate(kind: str, folder: str, prompts: dict[str, list[int]]) -> dict[str, tuple]:
    """``{prompt id: (sampled ids, their behaviour log-probs, finish reason)}`` from engine ``kind`` on ``folder``."""
    engine = make_engine(EngineConfig(kind=kind, model_path=folder, max_model_len=512, max_num_seqs=4))
    try:
        return engine.generate(
            [EngineRequest(k, p, 32, TEMPERATURE, seed=i) for i, (k, p) in enumerate(prompts.items())]
        )
    finally:
        engine.close()


GENERATE = """
import json, sys
from tests.integration.test_export_engine import generate
got = generate(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
print(json.dumps({k: [list(t), [float(x) for x in mu], fin] for k, (t, mu, fin) in got.items()}))
"""


@pytest.mark.parametrize("kind", ["transformers", "vllm"])
def test_exported_folder_serves_with_the_learners_logprobs(tiny_model_path, tmp_path, kind):
    run_dir, core, _ = trained_run(tmp_path, trajectory_maker(tiny_model_path), "learner.lr=1e-3")
    out = tmp_path / "export"
    assert export_run(run_dir, out).version == core.version == 2
    prompts = {"a": [1, 9690, 198, 2683], "b": [1, 4093, 198, 6004, 2, 198]}
    if kind == "vllm":
        child = subprocess.run(
            [sys.executable, "-c", GENERATE, kind, str(out), json.dumps(prompts)],
            capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
        assert child.returncode == 0, child.stderr[-3000:]
        got = {k: tuple(v) for k, v in json.loads(child.stdout.strip().splitlines()[-1]).items()}
    else:
        got = generate(kind, str(out), prompts)
    rows = []
    for k, p in prompts.items():
        toks, mu, fin = got[k]
        assert toks and len(mu) == len(toks)
        rows.append(Trajectory(
            trajectory_id=k, group_id="g", token_ids=np.array(p + toks), loss_mask=np.r_[np.zeros(len(p)), np.ones(len(toks))].astype(np.int8),
            behav_logprobs=np.r_[np.zeros(len(p)), mu].astype(np.float32), versions=np.r_[np.full(len(p), -1), np.full(len(toks), 2)],
            policy_version=2, prompt_len=len(p), finish_reason=fin, reward=0.0,
        ))  # fmt: skip
    b = collate(rows, consuming_version=core.version, temperature=TEMPERATURE, pad_token_id=2)
    learner = core.logprobs(b).numpy()
    for i, k in enumerate(prompts):
        p, (toks, mu, _) = prompts[k], got[k]
        diff = np.abs(learner[i, len(p) : len(p) + len(toks)] - np.asarray(mu)).max()
        assert diff < TOL, f"{kind}: max abs log-prob difference {diff}"
