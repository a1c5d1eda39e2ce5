"""A short async job with LoRA on the tiny model, for real: Ray, DeepSpeed on CPU, vLLM, the
adapter-snapshot old-logit service, rollout workers merging adapters into their kept base.

Rank 4, alpha 8 on every attention and MLP projection of the tiny model (2 layers, hidden 128,
kv 64, intermediate 256): per layer 4 * ((128+128) + (128+64) * 2 + (128+128) + (128+256) * 3) =
8192 elements, so one fp32 adapter publication is 2 * 8192 * 4 = 65536 bytes.
"""

from __future__ import annotations

import pytest

from tests.tiny_job import TINY_JOB
from trainer.driver.config.schema import load_config
from trainer.driver.loop.job import run_job
from trainer.driver.records.metrics_log import read_metrics

pytestmark = pytest.mark.integration

ADAPTER_BYTES = 65536


def test_lora_job_publishes_adapters_and_every_token_is_exact(tmp_path, tiny_model_path, ray_cluster):
    cfg = load_config(
        None,
        [
            *TINY_JOB,
            "controller.total_steps=3",
            "learner.lr=1e-3",
            "lora.enabled=true",
            "lora.rank=4",
            "lora.alpha=8.0",
            'loss.method="snapshot"',
            "server.enabled=false",
            f'logging.run_dir="{tmp_path}"',
        ],
    )
    summary = run_job(cfg)
    assert summary["state"] == "finished" and summary["end_reason"] == "completed" and summary["steps"] == 3
    assert summary["accounting_ok"] and summary["skipped_steps"] == 0
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [int(r["version"]) for r in rows] == [1, 2, 3]
    # the snapshot route holds base + adapters of [V-1, V]: every consumed token has exact old logits
    assert [r["exact_token_fraction"] for r in rows] == [1.0, 1.0, 1.0] and summary["exact_token_fraction"] == 1.0
    # each publication is the adapter only, and the EWMA holds one adapter
    assert [r["publish_bytes"] for r in rows] == [ADAPTER_BYTES] * 3
    assert {r["ewma_bytes_held"] for r in rows} == {ADAPTER_BYTES}
    # held-out evaluation ran through workers serving merged adapter versions
    assert summary["reward_before"]["episodes"] == 2 and summary["reward_after"]["episodes"] == 2
    ckpt = tmp_path / "checkpoints" / "v3"
    assert (ckpt / "vintage_state.pt").is_file()
