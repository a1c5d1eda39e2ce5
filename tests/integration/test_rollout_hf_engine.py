"""The transformers fallback engine keeps the same token-level contract as vLLM."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from modelkit.modelhub import load_causal_lm
from modelkit.scoring import sequence_logprobs
from modelkit.weights import pack_weights
from protocol import RolloutRequest, SamplingParams
from rollout.engine import EngineConfig, EngineRequest, TransformersEngine
from rollout.worker import RolloutWorkerCore
from tests.kept_cache import kept_cache_logprobs

pytestmark = pytest.mark.integration


def _lp(model, prompt, toks, t):
    ids = torch.tensor([prompt + toks])
    with torch.no_grad():
        return sequence_logprobs(model, ids, torch.ones_like(ids), t)[0, len(prompt) :].numpy()


def test_hf_engine_logprobs_update_and_resume(tiny_model_path):
    eng = TransformersEngine(EngineConfig(kind="transformers", model_path=str(tiny_model_path), max_model_len=256))
    hf = load_causal_lm(tiny_model_path)
    toks, mu, fin = eng.generate([EngineRequest("a", [1, 2, 3], 12, 0.7, seed=0)])["a"]
    assert fin == "length" and len(toks) == 12
    assert np.abs(_lp(hf, [1, 2, 3], toks, 0.7) - np.asarray(mu)).max() < 1e-4
    again = eng.generate([EngineRequest("b", [1, 2, 3], 12, 0.7, seed=0)])["b"]
    assert again[0] == toks  # per-request seed is reproducible

    w1 = {k: v + 0.05 * torch.randn_like(v) for k, v in hf.state_dict().items()}
    w1["lm_head.weight"] = w1["model.embed_tokens.weight"]
    core = RolloutWorkerCore(eng)
    core.submit(
        RolloutRequest(
            request_id="p", group_id="g", prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=6, temperature=0.9)
        )
    )
    core.step(), core.step()
    core.update_weights(*pack_weights(w1.items(), version=1))
    (t,) = core.run_until_idle()
    out = t.token_ids[3:].tolist()
    assert t.versions[3:].tolist() == [0, 0, 1, 1, 1, 1]
    assert core.status().resumed_prefill_tokens == 5  # the prompt and 2 tokens, prefilled again under W1
    hf.load_state_dict(w1, strict=False)
    np.testing.assert_allclose(_lp(hf, [1, 2, 3], out, 0.9)[2:], t.behav_logprobs[5:], atol=1e-4)


def test_hf_engine_keeps_a_request_across_an_update_with_its_cache(tiny_model_path):
    """keep_requests_on_update: a request sampled 2 tokens under W0, then W1 is applied while it
    runs; it goes on as the same request (no abort, nothing prefilled again) and its next tokens'
    mu is what the learner computes with the prefix's KV cache from W0 and the new tokens under W1
    (not W1 over the whole sequence)."""
    cfg = EngineConfig(kind="transformers", model_path=str(tiny_model_path), max_model_len=256)
    eng = TransformersEngine(cfg.model_copy(update={"keep_requests_on_update": True}))
    hf = load_causal_lm(tiny_model_path)
    w0 = {k: v.clone() for k, v in hf.state_dict().items()}
    w1 = {k: v + 0.05 * torch.randn_like(v) for k, v in w0.items()}
    w1["lm_head.weight"] = w1["model.embed_tokens.weight"]
    core = RolloutWorkerCore(eng)
    sampling = SamplingParams(max_tokens=6, temperature=0.9)
    core.submit(RolloutRequest(request_id="p", group_id="g", prompt_ids=[1, 2, 3], sampling=sampling))
    core.step(), core.step()
    core.update_weights(*pack_weights(w1.items(), version=1))
    (t,) = core.run_until_idle()
    out = t.token_ids[3:].tolist()
    assert t.versions[3:].tolist() == [0, 0, 1, 1, 1, 1] and t.info["resumes"] == 0
    assert core.status().resumed_prefill_tokens == 0
    kept = kept_cache_logprobs(hf, w0, w1, [1, 2, 3], out, 2, 0.9)
    np.testing.assert_allclose(kept, t.behav_logprobs[5:], atol=1e-4)
    assert np.abs(_lp(hf, [1, 2, 3], out, 0.9)[2:] - kept).max() > 1e-3  # not W1 over the whole sequence
