"""Real vLLM (in-process, CPU, fp32) on the tiny random model: log-probs, weight updates, partial
rollouts, finish reasons and a multi-turn episode. vLLM is started once for the module."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from modelkit.modelhub import load_causal_lm
from modelkit.scoring import sequence_logprobs
from modelkit.weights import pack_weights
from protocol import EnvRef, RolloutRequest, SamplingParams
from rollout.engine import EngineConfig, EngineRequest, VllmEngine
from rollout.worker import RolloutWorkerCore

pytestmark = pytest.mark.integration
TOL = 1e-3  # fp32 engine vs fp32 learner (measured ~1e-6 here)


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    eng = VllmEngine(EngineConfig(model_path=str(tiny_model_path), max_model_len=512, kv_cache_gib=1, max_num_seqs=16))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    return load_causal_lm(tiny_model_path)


@pytest.fixture(scope="module")
def weights(hf):
    """(W0 = the checkpoint, W1 = a perturbed copy) as HF-named state dicts."""
    w0 = {k: v.clone() for k, v in hf.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    w1 = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in w0.items()}
    w1["lm_head.weight"] = w1["model.embed_tokens.weight"]  # keep them tied, as the learner does
    return w0, w1


def _learner_logprobs(model, prompt, tokens, temperature):
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        return sequence_logprobs(model, ids, torch.ones_like(ids), temperature)[0, len(prompt) :].numpy()


def _with_weights(hf, named):
    hf.load_state_dict({k: v for k, v in named.items()}, strict=False)
    return hf


def _to(engine, named, version=None):
    engine.update_weights(named, engine.version + 1 if version is None else version)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_logprobs_match_transformers_at_same_weights_and_temperature(engine, hf, weights, temperature):
    """64 tokens at temperature T from the engine: mu == learner log_softmax(logits/T) per token."""
    _with_weights(hf, weights[0])
    if engine.version:  # make sure the engine serves W0
        _to(engine, weights[0])
    prompts = {"a": [1, 9690, 198, 2683], "b": [1, 4093, 198, 6004, 2, 198]}
    out = engine.generate([EngineRequest(k, p, 64, temperature, seed=i) for i, (k, p) in enumerate(prompts.items())])
    for k, p in prompts.items():
        toks, mu, fin = out[k]
        assert len(toks) == 64 and fin == "length"
        pi = _learner_logprobs(hf, p, toks, temperature)
        assert np.abs(pi - np.asarray(mu)).max() < TOL
        raw = _learner_logprobs(hf, p, toks, 1.0)  # the failure signature: temperature skipped
        assert np.abs(raw - np.asarray(mu)).mean() > 10 * TOL


def test_weight_update_changes_output_and_restore_is_exact(engine, hf, weights):
    w0, w1 = weights
    _to(engine, w0)
    req = lambda rid: EngineRequest(rid, [1, 2683, 359, 253], 24, 1.0, seed=7)  # noqa: E731
    before = engine.generate([req("w0")])["w0"]
    v = engine.version
    _to(engine, w1)
    assert engine.version == v + 1
    after = engine.generate([req("w1")])["w1"]
    assert after[0] != before[0]
    # the update really reached every layer: log-probs match the learner at W1
    pi = _learner_logprobs(_with_weights(hf, w1), [1, 2683, 359, 253], after[0], 1.0)
    assert np.abs(pi - np.asarray(after[1])).max() < TOL
    _to(engine, w0)
    again = engine.generate([req("w0b")])["w0b"]
    assert again[0] == before[0] and again[1] == before[1]  # exact, token ids and log-probs
    _with_weights(hf, w0)


def test_failed_update_keeps_old_version_serving(engine, weights):
    w0 = weights[0]
    v = engine.version
    bad = dict(w0)
    bad["model.norm.weight"] = torch.ones(7)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape"):
        engine.update_weights(bad, v + 1)
    missing = {k: t for k, t in w0.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="missing tensors"):
        engine.update_weights(missing, v + 1)
    with pytest.raises(ValueError, match="not newer"):
        engine.update_weights(w0, v)
    assert engine.version == v and not engine.failed
    assert len(engine.generate([EngineRequest("ok", [1, 2, 3], 3, 1.0)])["ok"][0]) == 3


def test_partial_rollout_boundary_at_exact_token_case5(engine, hf, weights):
    """Abort after 3 tokens at version v (>= 3), update to v+1, resume: boundary at output offset 3, each
    token's mu is that of its own version (checked against the learner at W0 and at W1)."""
    w0, w1 = weights
    while engine.version < 3:
        _to(engine, w0)
    _to(engine, w0)  # serve W0 at some version v >= 3 (3 when this test runs first)
    v = engine.version
    seen = []

    def scorer(items, temperature, known):  # the interrupt_sync route's scorer, still at the outgoing version
        seen.append((items, engine.version))
        return [np.full(len(i.token_ids), np.nan) for i in items]

    core = RolloutWorkerCore(engine, max_num_seqs=1, score_prefixes=scorer)
    prompt = [1, 4093, 198, 6004, 2]
    sp = SamplingParams(temperature=0.8, max_tokens=10, seed=3)
    core.submit(
        [
            RolloutRequest(request_id="p", group_id="g", prompt_ids=prompt, sampling=sp),
            RolloutRequest(request_id="q", group_id="g", prompt_ids=prompt, sampling=sp, admitted_version=v),
        ]
    )
    for _ in range(3):
        assert core.step() == 1
    manifest, payload = pack_weights(w1.items(), version=v + 1)
    assert core.update_weights(manifest, payload) == v + 1
    trajs = {t.trajectory_id: t for t in core.run_until_idle()}
    p, q = trajs["p"], trajs["q"]
    out = p.token_ids[p.prompt_len :].tolist()
    assert p.versions[p.prompt_len :].tolist() == [v, v, v] + [v + 1] * (len(out) - 3)
    assert p.segments() == [(v, 5), (v + 1, 8)] and p.info["resumes"] == 1
    mu = p.behav_logprobs[p.prompt_len :]
    old = _learner_logprobs(_with_weights(hf, w0), prompt, out, 0.8)
    new = _learner_logprobs(_with_weights(hf, w1), prompt, out, 0.8)
    assert np.abs(old[:3] - mu[:3]).max() < TOL and np.abs(new[3:] - mu[3:]).max() < TOL
    # q waited in the queue across the update: stamped with the version of its first token
    assert set(q.versions[q.prompt_len :].tolist()) == {v + 1} and q.info["admitted_version"] == v
    ((items, outgoing),) = seen
    assert outgoing == v and [i.trajectory_id for i in items] == ["p"]
    assert items[0].versions.tolist() == [-1] * 5 + [v] * 3 and items[0].loss_mask.sum() == 3
    _with_weights(hf, w0)


def test_finish_reasons_come_from_the_engine_case9(engine):
    core = RolloutWorkerCore(engine)
    eos = engine.eos_token_ids
    stop_ids = [i for i in range(3, 49152) if i not in eos]  # almost any token ends the turn
    core.submit(
        [
            RolloutRequest(request_id="len", group_id="g", prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4)),
            RolloutRequest(
                request_id="stop",
                group_id="g",
                prompt_ids=[1, 2, 3],
                sampling=SamplingParams(max_tokens=4, stop_token_ids=stop_ids, seed=0),
            ),
        ]
    )
    t = {x.trajectory_id: x for x in core.run_until_idle()}
    assert t["len"].finish_reason == "length" and t["len"].truncated and t["len"].num_generated == 4
    s = t["stop"]
    assert s.finish_reason == "stop" and not s.truncated
    assert int(s.token_ids[-1]) in stop_ids and int(s.token_ids[-1]) not in eos  # stop id != tokenizer EOS
    assert s.loss_mask[-1] == 1  # the sampled stop token is the model's and trains
    # an interrupted worker emits its unfinished samples as "abort", tokens kept
    core.submit(
        RolloutRequest(request_id="ab", group_id="g", prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=50))
    )
    core.step(), core.step()
    core.stop(abort_in_flight=True)
    (a,) = core.poll()
    assert a.finish_reason == "abort" and a.num_generated == 2 and a.info["error"] == "worker stopped"


def test_multiturn_episode_on_real_engine(engine):
    core = RolloutWorkerCore(engine)
    env = EnvRef(path="rollout.envs.scripted:ScriptedEnv", kwargs={"turns": 3, "tool_text": "result 42"})
    core.submit(RolloutRequest(request_id="m", group_id="g", env=env, sampling=SamplingParams(max_tokens=6, n=2)))
    trajs = core.run_until_idle()
    assert sorted(t.trajectory_id for t in trajs) == ["m/0", "m/1"]
    tok = core.chat.tok
    for t in trajs:
        assert len(t.turn_boundaries) == 3 and t.reward == 1.0
        mask = t.loss_mask.astype(bool)
        assert t.num_generated == sum(e - s for s, e in t.turn_boundaries)
        assert (t.versions[~mask] == -1).all() and (t.versions[mask] == engine.version).all()
        for (s0, e0), (s1, _) in zip(t.turn_boundaries, t.turn_boundaries[1:], strict=False):
            assert mask[s0:e0].all() and not mask[e0:s1].any()
            assert "<|im_start|>tool\nresult 42<|im_end|>" in tok.decode(t.token_ids[e0:s1].tolist())
