"""Real vLLM (in-process, CPU, fp32, the tiny random model) keeping its running requests across a
weight update (``keep_requests_on_update``): the request goes on, nothing is prefilled again, and
its tokens after the update are sampled with the prefix's KV cache from the old weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from modelkit.modelhub import load_causal_lm
from modelkit.weights import pack_weights
from protocol import RolloutRequest, SamplingParams
from rollout.engine import EngineConfig, VllmEngine
from rollout.worker import RolloutWorkerCore
from tests.kept_cache import kept_cache_logprobs

pytestmark = pytest.mark.integration
TOL = 1e-3  # fp32 engine vs fp32 learner, as in test_rollout_vllm


def test_a_kept_request_goes_on_under_the_new_weights_with_its_old_cache(tiny_model_path):
    """3 tokens under W0, then W1 applied while the request runs: tokens 4.. carry version 1, the
    request is not resumed (one engine request, nothing prefilled again), their mu is the learner's
    with the KV cache of the prompt and the first 2 tokens from W0 (not W1 over the whole
    sequence), and prefix caching is off."""
    cfg = EngineConfig(
        model_path=str(tiny_model_path), max_model_len=512, kv_cache_gib=1, max_num_seqs=4, keep_requests_on_update=True
    )
    engine = VllmEngine(cfg)
    try:
        assert engine._llm.vllm_config.cache_config.enable_prefix_caching is False
        hf = load_causal_lm(tiny_model_path)
        w0 = {k: v.clone() for k, v in hf.state_dict().items()}
        g = torch.Generator().manual_seed(1)
        w1 = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in w0.items()}
        w1["lm_head.weight"] = w1["model.embed_tokens.weight"]  # tied, as the learner keeps them
        core = RolloutWorkerCore(engine, max_num_seqs=1)
        prompt = [1, 4093, 198, 6004, 2]
        sampling = SamplingParams(temperature=0.8, max_tokens=10, seed=3)
        core.submit(RolloutRequest(request_id="p", group_id="g", prompt_ids=prompt, sampling=sampling))
        for _ in range(3):
            assert core.step() == 1
        assert core.update_weights(*pack_weights(w1.items(), version=1)) == 1
        (p,) = core.run_until_idle()
        out = p.token_ids[p.prompt_len :].tolist()
        assert p.versions[p.prompt_len :].tolist() == [0, 0, 0] + [1] * (len(out) - 3)
        assert p.info["resumes"] == 0 and core.status().resumed_prefill_tokens == 0
        kept = kept_cache_logprobs(hf, w0, w1, prompt, out, 3, 0.8)
        mu = p.behav_logprobs[p.prompt_len :]
        assert np.abs(kept - mu[3:]).max() < TOL
    finally:
        engine.close()
