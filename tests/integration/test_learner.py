"""The DeepSpeed learner for real on CPU (gloo, torch AdamW) with the tiny random Llama.

Rollouts are synthetic: random token ids whose behaviour log-probs (mu) are the tiny model's own
log-probs at version 0 plus a little noise (the engine/learner numerics gap), so the discrepancy
mask keeps them and the loss has gradient.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from modelkit.modelhub import load_causal_lm
from modelkit.scoring import sequence_logprobs
from modelkit.weights import unpack_weights
from protocol import Trajectory
from trainer.algorithm.batch import Batch, collate, shuffled_rows
from trainer.algorithm.loss_config import loss_config
from trainer.learner import LearnerCore, LearnerGroup, LearnerSettings, free_port

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def make_trajs(tiny_model_path):
    model = load_causal_lm(tiny_model_path)

    def make(n=4, length=12, prompt=4, seed=0, version=0, noise=0.05, lengths=None):
        rng = np.random.default_rng(seed)
        out = []
        for i in range(n):
            L = lengths[i] if lengths else length
            ids = rng.integers(3, 2000, L)
            with torch.no_grad():
                lp = sequence_logprobs(model, torch.tensor(ids)[None], torch.ones(1, L, dtype=torch.long), 1.0)[
                    0
                ].numpy()
            mask = np.zeros(L, np.int8)
            mask[prompt:] = 1
            mu = np.where(mask == 1, np.minimum(lp + rng.normal(0, noise, L), 0.0), 0.0).astype(np.float32)
            out.append(Trajectory(
                trajectory_id=f"t{seed}-{i}", group_id=f"g{i // 2}", token_ids=ids, loss_mask=mask, behav_logprobs=mu,
                versions=np.where(mask == 1, version, -1), policy_version=version, prompt_len=prompt,
                finish_reason="stop", reward=float(i % 2),
            ))  # fmt: skip
        return out

    return make


def settings(path, **kw) -> LearnerSettings:
    base = dict(model_path=str(path), lr=1e-3, micro_batch_size=4, master_port=free_port())
    base.update(kw)
    return LearnerSettings(**base)


def set_peak_lr(core: LearnerCore, lr: float) -> None:
    """Give ``core`` the peak learning rate ``lr`` that its schedule scales before every optimizer
    step (``model_copy`` does not validate, so an infinite rate gets through to the optimizer)."""
    core.settings = core.settings.model_copy(update={"lr": lr})


def weights(core: LearnerCore) -> dict[str, torch.Tensor]:
    return core.state_dict_full()


def train_step_with_grads(
    core: LearnerCore, trajs, old_logits=None
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """``core.train_step(trajs, old_logits)`` with every parameter's gradient summed over its micro-batches."""
    acc: dict[str, torch.Tensor] = {}

    def hook(name):
        return lambda g: acc.__setitem__(name, acc.get(name, 0) + g.detach().clone())

    handles = [p.register_hook(hook(n)) for n, p in core.engine.module.named_parameters()]
    try:
        return acc, core.train_step(trajs, old_logits)
    finally:
        for h in handles:
            h.remove()


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("stage,dtype", [(0, "float32"), (3, "float32"), (1, "bfloat16")])
def test_one_step_changes_weights_and_bumps_version(tiny_model_path, make_trajs, stage, dtype):
    core = LearnerCore(settings(tiny_model_path, zero_stage=stage, dtype=dtype))
    before = weights(core)
    m = core.train_step(make_trajs())
    assert m["applied"] == 1.0 and core.version == 1 and m["version"] == 1.0 and m["consumed_version"] == 0.0
    # at version 0 the EWMA weights are the current weights: the staleness ratio is exactly 1
    # (the EWMA forward uses the learner's numerics, also in bf16)
    assert m["ratio_max"] == 1.0 and m["ratio_min"] == 1.0
    assert math.isfinite(m["loss"]) and m["grad_norm"] > 0 and m["tokens"] == 32
    assert m["mask_kept_fraction"] == pytest.approx(1.0) and m["exact_token_fraction"] == 0.0
    assert m["ewma_updates"] == 1 and m["ewma_resets"] == 0 and m["ewma_beta"] == pytest.approx(0.5)
    assert max_diff(weights(core), before) > 1e-4
    # the next batch is consumed at version 1: its version-0 tokens have staleness 1
    m2 = core.train_step(make_trajs(seed=1))
    assert core.version == 2 and m2["staleness_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize("stage", [0, 2])
def test_case6_token_mean_independent_of_micro_batches(tiny_model_path, make_trajs, stage):
    """Same batch, 1 micro-batch vs 3 (unequal lengths): identical accumulated gradient."""
    trajs = make_trajs(n=3, lengths=[6, 14, 9], seed=3)
    grads = []
    for mbs in (3, 1):
        core = LearnerCore(settings(tiny_model_path, zero_stage=stage, micro_batch_size=mbs))
        acc, m = train_step_with_grads(core, trajs)
        assert m["micro_batches"] == (1 if mbs == 3 else 3) and m["applied"] == 1.0
        grads.append((acc, m["loss"], m["grad_norm"]))
    (g1, l1, n1), (g3, l3, n3) = grads
    assert l1 == pytest.approx(l3, rel=1e-5) and n1 == pytest.approx(n3, rel=1e-4)
    for k in g1:  # to float32 rounding: the output projection's matmul shapes differ with the micro-batch
        torch.testing.assert_close(g1[k], g3[k], rtol=1e-4, atol=1e-6)


def test_one_rank_at_stage_0_skips_deepspeeds_reduction_and_trains_bit_for_bit_as_with_it(
    tiny_model_path, make_trajs, monkeypatch
):
    """An average over one rank is the identity: the learner turns DeepSpeed's reduction off and
    its weights after two steps of two micro-batches each are those of a learner whose engine
    still reduces, bit for bit, as are its gradient norms. A trainable parameter the forward never
    uses gets a zero gradient either way, so weight decay (0.1, lr 1e-3) moves it alike:
    1 * (1 - 1e-4) per step in fp32."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    import modelkit.modelhub

    real_load = modelkit.modelhub.load_causal_lm

    def with_unused_parameter(*args, **kwargs):
        model = real_load(*args, **kwargs)
        model.register_parameter("unused", torch.nn.Parameter(torch.ones(3)))
        return model

    monkeypatch.setattr(modelkit.modelhub, "load_causal_lm", with_unused_parameter)
    calls = []
    real_reduce = DeepSpeedEngine.buffered_allreduce_fallback  # the flatten, all-reduce and copy back
    monkeypatch.setattr(
        DeepSpeedEngine,
        "buffered_allreduce_fallback",
        lambda self, *a, **k: calls.append(1) or real_reduce(self, *a, **k),
    )
    runs = []
    for reduce in (False, True):
        calls.clear()
        core = LearnerCore(settings(tiny_model_path, micro_batch_size=2, weight_decay=0.1))
        assert core.engine.enable_backward_allreduce is False
        core.engine.enable_backward_allreduce = reduce
        norms = [core.train_step(make_trajs(seed=s))["grad_norm"] for s in (0, 1)]
        assert len(calls) == (2 if reduce else 0)  # once per optimizer step, at its boundary micro-batch
        runs.append((weights(core), norms))
    (w_off, n_off), (w_on, n_on) = runs
    assert n_off == n_on and max_diff(w_off, w_on) == 0.0
    decay = torch.tensor(1 - 1e-4, dtype=torch.float32)
    assert w_off["unused"].tolist() == [float(decay * decay)] * 3


@pytest.mark.parametrize("stage", [0, 3])
def test_chunked_logprobs_train_as_whole_sequence_logits(tiny_model_path, make_trajs, stage):
    """The learner's chunked log-probs (here 5 positions per chunk: 8 completion positions give
    chunks of 5 and 3) against whole-sequence logits (``logprob_chunk_bytes=0``): the same loss,
    entropy, gradient norm and accumulated gradients to fp32 round-off, under ZeRO 0 and under
    ZeRO-3 (its hooks gather the output projection for every chunk and for its recomputation in
    backward). Observed on this CPU: gradients within 2e-7, losses within 4e-9."""
    trajs = make_trajs()
    runs = []
    for chunk_bytes in (5 * 4 * 49152 * 4, 0):
        core = LearnerCore(settings(tiny_model_path, zero_stage=stage, logprob_chunk_bytes=chunk_bytes))
        acc, m = train_step_with_grads(core, trajs)
        assert m["applied"] == 1.0
        runs.append((acc, m))
    (g_chunk, m_chunk), (g_full, m_full) = runs
    assert m_chunk["loss"] == pytest.approx(m_full["loss"], rel=1e-5)
    assert m_chunk["entropy"] == pytest.approx(m_full["entropy"], rel=1e-6)
    assert m_chunk["grad_norm"] == pytest.approx(m_full["grad_norm"], rel=1e-5)
    assert g_chunk.keys() == g_full.keys() and len(g_full) == len(list(core.engine.module.parameters()))
    for k in g_full:
        torch.testing.assert_close(g_chunk[k], g_full[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("stage", [0, 3])
def test_packed_sequences_train_as_the_padded_rows(tiny_model_path, make_trajs, stage):
    """``pack_sequences`` with rows of 6 .. 16 tokens (a micro-batch of 4 padded to 16 packs into
    fewer rows): the same loss, entropy, gradient norm and accumulated gradients as the padded
    forward to fp32 round-off, under ZeRO 0 and ZeRO-3, with the EWMA forward packed too."""
    trajs = make_trajs(n=8, lengths=[16, 6, 10, 7, 12, 9, 14, 8])
    runs = []
    for packed in (True, False):
        core = LearnerCore(settings(tiny_model_path, zero_stage=stage, pack_sequences=packed))
        acc, m = train_step_with_grads(core, trajs)
        assert m["applied"] == 1.0
        runs.append((acc, m))
    (g_pk, m_pk), (g_pad, m_pad) = runs
    assert m_pk["loss"] == pytest.approx(m_pad["loss"], rel=1e-5, abs=1e-7)
    assert m_pk["entropy"] == pytest.approx(m_pad["entropy"], rel=1e-5)
    assert m_pk["grad_norm"] == pytest.approx(m_pad["grad_norm"], rel=1e-5)
    assert g_pk.keys() == g_pad.keys() and len(g_pad) == len(list(core.engine.module.parameters()))
    for k in g_pad:
        torch.testing.assert_close(g_pk[k], g_pad[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize("stage", [0, 3])
def test_gradient_checkpointing_trains_as_stored_activations(tiny_model_path, make_trajs, stage):
    """``gradient_checkpointing`` recomputes each decoder layer in backward with the same kernels
    in the same order, so the step is the stored-activation step: the same loss, gradient norm,
    accumulated gradients and weights after it (observed bit for bit on this CPU), under ZeRO 0 and
    under ZeRO-3 (whose hooks gather each layer's weights again for its recomputation)."""
    trajs = make_trajs()
    runs = []
    for ckpt in (True, False):
        core = LearnerCore(settings(tiny_model_path, zero_stage=stage, gradient_checkpointing=ckpt))
        assert core.engine.module.is_gradient_checkpointing is ckpt
        acc, m = train_step_with_grads(core, trajs)
        assert m["applied"] == 1.0
        runs.append((acc, m, weights(core)))
    (g_ck, m_ck, w_ck), (g_st, m_st, w_st) = runs
    assert m_ck["loss"] == pytest.approx(m_st["loss"], rel=1e-6)
    assert m_ck["grad_norm"] == pytest.approx(m_st["grad_norm"], rel=1e-6)
    assert g_ck.keys() == g_st.keys() and len(g_st) == len(list(core.engine.module.parameters()))
    for k in g_st:
        torch.testing.assert_close(g_ck[k], g_st[k], rtol=1e-5, atol=1e-7, msg=k)
    assert max_diff(w_ck, w_st) <= 1e-7


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_nonfinite_loss_skips_step_keeps_version_and_weights(tiny_model_path, make_trajs, stage):
    core = LearnerCore(settings(tiny_model_path, zero_stage=stage))
    good = collate(make_trajs(), consuming_version=0)
    adv = good.advantages.clone()
    adv[0, 5] = float("nan")  # one sampled token: raw tensor path, a Trajectory would refuse it
    bad = Batch(**{**good.__dict__, "advantages": adv})
    before = weights(core)
    m = core.train_batch(bad)
    assert m["applied"] == 0.0 and not math.isfinite(m["loss"])
    assert core.version == 0 and m["version"] == 0.0 and core.skipped_steps == 1 and m["skipped_steps"] == 1.0
    assert max_diff(weights(core), before) == 0.0
    assert core.ewma.updates == 0
    # the learner recovers: DeepSpeed's gradient buffers were cleared, the next good step applies
    m = core.train_batch(good)
    assert m["applied"] == 1.0 and core.version == 1 and math.isfinite(m["grad_norm"])


def test_nonfinite_gradient_with_finite_loss_skips_step(tiny_model_path, make_trajs, monkeypatch):
    """The guard also looks at gradients: sqrt(|0 * logp|) adds 0 to the loss but a NaN
    gradient (inf * 0); stage 0 has no DeepSpeed overflow check to fall back on."""
    import trainer.learner.core as learner_mod

    real = learner_mod.compute_policy_loss

    def poisoned(logprobs, *args, **kwargs):
        loss, m = real(logprobs, *args, **kwargs)
        return loss + (logprobs * 0).abs().sqrt().sum() * 0, m

    core = LearnerCore(settings(tiny_model_path))
    before = weights(core)
    monkeypatch.setattr(learner_mod, "compute_policy_loss", poisoned)
    m = core.train_step(make_trajs())
    assert math.isfinite(m["loss"]) and m["applied"] == 0.0 and core.version == 0 and core.skipped_steps == 1
    assert max_diff(weights(core), before) == 0.0
    monkeypatch.setattr(learner_mod, "compute_policy_loss", real)
    assert core.train_step(make_trajs())["applied"] == 1.0 and core.version == 1


def _optimizer_state(core: LearnerCore) -> dict[tuple[int, str], torch.Tensor]:
    opt = core._optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    return {(i, k): v.clone() for i, p in enumerate(params) for k, v in opt.state.get(p, {}).items()}


@pytest.mark.parametrize("stage,dtype", [(0, "float32"), (1, "bfloat16")])
def test_nonfinite_weights_after_the_step_are_rolled_back(tiny_model_path, make_trajs, stage, dtype):
    """Finite loss and gradients, but an infinite learning rate makes every updated weight inf/NaN:
    the step is undone on weights and optimizer state, counted as skipped, and the version stays."""
    core = LearnerCore(settings(tiny_model_path, zero_stage=stage, dtype=dtype, rollback_copy="on"))
    assert core.train_step(make_trajs())["applied"] == 1.0  # optimizer state now exists
    before_w, before_s = weights(core), _optimizer_state(core)
    set_peak_lr(core, float("inf"))
    m = core.train_step(make_trajs(seed=1))
    assert math.isfinite(m["loss"]) and m["applied"] == 0.0
    assert (
        core.version == 1 and m["version"] == 1.0 and m["skipped_steps"] == 1.0 and m["nonfinite_weight_steps"] == 1.0
    )
    assert max_diff(weights(core), before_w) == 0.0
    after_s = _optimizer_state(core)
    assert after_s.keys() == before_s.keys() and all(torch.equal(after_s[k], before_s[k]) for k in before_s)
    assert core.ewma.updates == 1  # the EWMA never saw the rejected weights
    set_peak_lr(core, 1e-3)
    assert core.train_step(make_trajs(seed=2))["applied"] == 1.0 and core.version == 2


def test_first_step_rollback_leaves_no_optimizer_state(tiny_model_path, make_trajs):
    core = LearnerCore(settings(tiny_model_path, lr=1e-3, rollback_copy="on"))
    set_peak_lr(core, float("inf"))
    m = core.train_step(make_trajs())
    assert m["applied"] == 0.0 and m["nonfinite_weight_steps"] == 1.0 and core.version == 0
    assert _optimizer_state(core) == {}


def test_without_a_rollback_copy_a_nonfinite_step_fails_the_learner_naming_the_setting(tiny_model_path, make_trajs):
    """Gradient clipping on (1.0): ``auto`` keeps no copy, so an infinite learning rate (which the
    settings themselves refuse) cannot be undone: the step raises, naming ``learner.rollback_copy``."""
    from trainer.learner.guard import NonFiniteStep

    core = LearnerCore(settings(tiny_model_path))
    assert core.settings.grad_clip == 1.0 and not core.settings.keeps_rollback_copy
    assert core.train_step(make_trajs())["applied"] == 1.0
    set_peak_lr(core, float("inf"))
    with pytest.raises(NonFiniteStep, match=r"learner.rollback_copy = 'on' keeps one"):
        core.train_step(make_trajs(seed=1))


def test_case2a_nan_mu_on_sampled_token_is_neutral(tiny_model_path, make_trajs):
    core = LearnerCore(settings(tiny_model_path))
    good = collate(make_trajs(), consuming_version=0)
    mu = good.behav_logprobs.clone()
    mu[1, 6] = float("nan")
    m = core.train_batch(Batch(**{**good.__dict__, "behav_logprobs": mu}))
    assert m["applied"] == 1.0 and math.isfinite(m["loss"]) and m["nonfinite_behav_frac"] == pytest.approx(1 / 32)


def test_exact_old_logits_and_proxy_error(tiny_model_path, make_trajs):
    """Exact pi_old on some tokens (a mixed batch): exact fraction and proxy-vs-exact error reported."""
    core = LearnerCore(settings(tiny_model_path, loss=loss_config("snapshot")))
    trajs = make_trajs()
    b = collate(trajs, consuming_version=0)
    lp = core.logprobs(b).numpy()
    old = [
        np.where(np.arange(len(t.token_ids)) < 8, lp[i, : len(t.token_ids)], np.nan).astype(np.float32)
        for i, t in enumerate(trajs)
    ]
    m = core.train_step(trajs, old_logits=old)
    assert m["exact_token_fraction"] == pytest.approx(0.5) and m["proxy_err_tokens"] == 16
    assert m["proxy_abs_err"] < 1e-4  # EWMA == current weights at version 0: the proxy is exact here


@pytest.mark.parametrize("stage,dtype", [(0, "float32"), (1, "bfloat16"), (2, "bfloat16")])
def test_below_zero_3_the_ewma_forward_swaps_into_the_engines_module_as_a_scorer_copy_would(
    tiny_model_path, make_trajs, stage, dtype
):
    """No scorer copy below ZeRO-3: the EWMA weights are swapped into the trained module for the
    forward. Three steps with the PPO-EWMA proxy on every token (no exact old logits, two
    micro-batches) leave weights, losses and ratios bit for bit those of a learner that scores
    through a frozen copy (so the trained weights were back after each forward)."""
    from trainer.learner.reference import frozen_copy

    runs = []
    for copy_scorer in (False, True):
        core = LearnerCore(settings(tiny_model_path, zero_stage=stage, dtype=dtype, micro_batch_size=2))
        assert core._scorer is None
        if copy_scorer:
            core._scorer = frozen_copy(core.engine.module, core._torch_dtype)
        ms = [core.train_step(make_trajs(seed=s)) for s in range(3)]
        assert [m["ewma_forward_micro_batches"] for m in ms] == [2.0, 2.0, 2.0]
        runs.append((weights(core), [(m["loss"], m["ratio_max"], m["ratio_min"]) for m in ms]))
    (w_swap, m_swap), (w_copy, m_copy) = runs
    assert m_swap == m_copy and max_diff(w_swap, w_copy) == 0.0
    assert m_swap[1][1] != 1.0  # at version 1 the EWMA weights differ from the trained ones


def test_zero_3_scores_the_ewma_through_a_frozen_copy(tiny_model_path):
    core = LearnerCore(settings(tiny_model_path, zero_stage=3))
    assert core._scorer is not None and not any(p.requires_grad for p in core._scorer.parameters())


def test_ewma_forward_runs_only_where_a_token_needs_the_proxy(tiny_model_path, make_trajs):
    """Two micro-batches per step, probe every 2 steps. All tokens exact: the EWMA forward runs on
    the first micro-batch at versions 0 and 2 (probes) and not at all at version 1 (no reset signal:
    NaN). A batch with tokens lacking exact old logits runs it on every micro-batch."""
    from trainer.algorithm.loss_config import EwmaConfig

    core = LearnerCore(
        settings(tiny_model_path, loss=loss_config("snapshot"), micro_batch_size=2, ewma=EwmaConfig(probe_every=2))
    )

    def exact_for(trajs, missing_from=None):
        lp = core.logprobs(collate(trajs, consuming_version=core.version)).numpy()
        cut = missing_from or 10**9
        return [
            np.where(np.arange(len(t.token_ids)) < cut, lp[i, : len(t.token_ids)], np.nan).astype(np.float32)
            for i, t in enumerate(trajs)
        ]

    runs, kept = [], []
    for seed in range(3):
        trajs = make_trajs(seed=seed)
        m = core.train_step(trajs, old_logits=exact_for(trajs))
        assert m["applied"] == 1.0 and m["exact_token_fraction"] == 1.0 and math.isfinite(m["loss"])
        runs.append(m["ewma_forward_micro_batches"])
        kept.append(math.isnan(m["ewma_kept_frac"]))
    assert runs == [1.0, 0.0, 1.0] and kept == [False, True, False]
    trajs = make_trajs(seed=3)
    m = core.train_step(trajs, old_logits=exact_for(trajs, missing_from=8))  # version 3: no probe
    assert m["ewma_forward_micro_batches"] == 2.0 and m["exact_token_fraction"] == pytest.approx(0.5)


def test_checkpoint_resume_continues_versions_and_ewma(tiny_model_path, make_trajs, tmp_path):
    s = settings(tiny_model_path)
    core = LearnerCore(s)
    core.train_step(make_trajs(seed=0))
    path = core.save_checkpoint(
        str(tmp_path), extra={"buffer": {"consumed": 4, "dropped": {"stale": 1}}, "snapshots": [0, 1]}
    )
    assert path.endswith("v1")
    resumed = LearnerCore(s.model_copy(update={"seed": 123}))
    extra = resumed.load_checkpoint(str(tmp_path))
    assert extra == {"buffer": {"consumed": 4, "dropped": {"stale": 1}}, "snapshots": [0, 1]}
    assert resumed.version == 1 and max_diff(weights(resumed), weights(core)) == 0.0
    assert resumed.ewma.total == core.ewma.total and resumed.ewma.updates == 1
    assert max(float((resumed.ewma.params[k] - core.ewma.params[k]).abs().max()) for k in core.ewma.params) == 0.0
    # both continue with the same batch: same optimizer state -> same weights, version 2
    nxt = make_trajs(seed=1)
    m1, m2 = core.train_step(nxt), resumed.train_step(nxt)
    assert m1["version"] == m2["version"] == 2.0
    assert max_diff(weights(resumed), weights(core)) < 1e-6


def test_publish_roundtrip_fresh_model_identical_logprobs(tiny_model_path, make_trajs):
    core = LearnerCore(settings(tiny_model_path))
    core.train_step(make_trajs())
    manifest, payload = core.publish("float32")
    assert manifest.version == 1 and manifest.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert core.last_publish["bytes"] == manifest.total_bytes and core.last_publish["seconds"] > 0
    fresh = load_causal_lm(tiny_model_path)
    fresh.load_state_dict(unpack_weights(manifest, payload))
    b = collate(make_trajs(seed=5), consuming_version=1)
    with torch.no_grad():
        got = sequence_logprobs(fresh, b.token_ids, b.attention_mask, 1.0)
    torch.testing.assert_close(got, core.logprobs(b), rtol=0, atol=0)
    m16, p16 = core.publish("bfloat16")
    assert m16.total_bytes * 2 == manifest.total_bytes and next(iter(p16.values())).dtype == torch.bfloat16


def test_world_size_2_ray_ranks_agree(tiny_model_path, make_trajs, ray_cluster):
    """Two Ray actors (gloo, ZeRO-2) do one step; both ranks hold the same weights, and the
    gradient norm equals a single rank's on the whole batch (global token count)."""
    import ray

    trajs = make_trajs(n=6, seed=7)
    s = settings(tiny_model_path, zero_stage=2, micro_batch_size=2)
    group = LearnerGroup(s, world_size=2)
    try:
        m = group.train_step(trajs)
        assert m["applied"] == 1.0 and m["version"] == 1.0 and m["tokens"] == 48
        w0, w1 = ray.get([a.state_dict_full.remote() for a in group.actors])
        assert max_diff(w0, w1) == 0.0
        manifest, _ = group.publish()
        assert manifest.version == 1 and group.version() == 1
    finally:
        group.shutdown()
    single = LearnerCore(s.model_copy(update={"master_port": free_port()}))
    ms = single.train_step(trajs)
    assert ms["grad_norm"] == pytest.approx(m["grad_norm"], rel=1e-5) and ms["loss"] == pytest.approx(
        m["loss"], rel=1e-5
    )
    assert max_diff(weights(single), w0) < 1e-5


# ---- several optimizer steps per rollout batch -------------------------------------------------


def _params(core: LearnerCore) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in core.engine.module.named_parameters()}


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_at_staleness_0_snapshot_and_recompute_train_identically(tiny_model_path, make_trajs, mini_batches):
    """Version-0 tokens consumed at version 0: the exact old log-probs are the learner's own, and
    the recompute reference is taken under the same weights, so loss, every optimizer step's ratios
    and the weights after the step are the same to the bit, with one mini-batch or two."""
    trajs = make_trajs(n=8, seed=5)
    runs = []
    for cfg in (loss_config("snapshot"), loss_config("decoupled_ppo", discrepancy_mask=True)):
        core = LearnerCore(settings(tiny_model_path, loss=cfg, ppo_mini_batches=mini_batches, lr=1e-2))
        old = None
        if cfg.oldlogit_route != "none":
            lp = core.logprobs(collate(trajs, consuming_version=0)).numpy()
            old = [lp[i, : len(t.token_ids)].copy() for i, t in enumerate(trajs)]
        m = core.train_step(trajs, old_logits=old)
        runs.append((m, core.last_optimizer_steps, _params(core)))
    (m_s, steps_s, w_s), (m_r, steps_r, w_r) = runs
    assert m_s["exact_token_fraction"] == 1.0 and m_r["exact_token_fraction"] == 0.0
    assert m_s["optimizer_steps"] == m_r["optimizer_steps"] == mini_batches
    assert m_s["loss"] == m_r["loss"]
    for a, b in zip(steps_s, steps_r, strict=True):
        assert (a["loss"], a["ratio_max"], a["ratio_min"], a["clip_frac_high"]) == (
            b["loss"], b["ratio_max"], b["ratio_min"], b["clip_frac_high"],
        )  # fmt: skip
    assert all(torch.equal(w_s[k], w_r[k]) for k in w_s)


def test_two_mini_batches_recompute_ratio_departs_from_one_on_the_second_and_clips(tiny_model_path, make_trajs):
    """Two optimizer steps on one batch with the recompute reference (lr 1e-2): the first step's
    ratio is exactly 1; the second's is pi_after_step_1 / pi_version_0 on its rows. The expected
    ratios come from a second learner trained on the first mini-batch alone (the same first
    optimizer step) scoring the second mini-batch, compared with the version-0 log-probs."""
    trajs = make_trajs(n=8, seed=6)
    s = settings(
        tiny_model_path, loss=loss_config("decoupled_ppo"), ppo_mini_batches=2, lr=1e-2, shuffle_mini_batches=False
    )
    core = LearnerCore(s)
    batch = collate(trajs, consuming_version=0)
    first, second = batch.mini_batches(2)
    before = core.logprobs(second)
    m = core.train_batch(batch)
    assert core.version == 1 and m["version"] == 1.0 and m["optimizer_steps"] == 2.0
    one, two = core.last_optimizer_steps
    assert one["ratio_max"] == 1.0 and one["ratio_min"] == 1.0 and one["clip_frac_high"] + one["clip_frac_low"] == 0.0

    ref = LearnerCore(s.model_copy(update={"ppo_mini_batches": 1}))
    assert ref.train_batch(first)["applied"] == 1.0
    after = ref.logprobs(second)
    mask, adv = second.loss_mask, second.advantages
    r = torch.exp(after - before)[mask]
    a = adv[mask]
    expect_high = float(((r > 1.2) & (a > 0)).float().mean())
    expect_low = float(((r < 0.8) & (a < 0)).float().mean())
    assert expect_high + expect_low > 0.1  # one step at lr 1e-2 moves these tokens out of the band
    assert two["clip_frac_high"] == pytest.approx(expect_high, abs=1e-6)
    assert two["clip_frac_low"] == pytest.approx(expect_low, abs=1e-6)
    assert two["ratio_max"] == pytest.approx(float(r.max()), rel=1e-4)
    assert two["ratio_min"] == pytest.approx(float(r.min()), rel=1e-4)
    assert m["clip_frac_step_max"] == pytest.approx(expect_high + expect_low, abs=1e-6)
    assert m["clip_grad_removed_frac"] > 0 and m["recompute_forward_s"] > 0


def test_ewma_folds_in_every_optimizer_step_with_the_window_in_steps(tiny_model_path, make_trajs):
    """ppo_ewma, 2 mini-batches x 2 epochs: one version, four EWMA updates; the window of 2 versions
    (mean lag 1 version) is 1 x 4 + (4 - 1) / 2 = 5.5 optimizer steps: beta = 5.5 / 6.5 = 11/13."""
    core = LearnerCore(settings(tiny_model_path, ppo_mini_batches=2, ppo_epochs=2))
    m = core.train_step(make_trajs(n=8, seed=7))
    assert core.version == 1 and m["optimizer_steps"] == 4.0 and m["optimizer_steps_total"] == 4.0
    assert m["ewma_updates"] == 4 and m["ewma_beta"] == pytest.approx(11 / 13)
    assert m["tokens"] == 64 and m["micro_batches"] == 4.0  # one pass of 8 x 8 tokens; 1 micro-batch per step
    assert m["entropy"] > 0 and m["response_tokens_mean"] == 8.0


def test_the_learner_gives_its_own_versions_pi_old_bit_for_bit(tiny_model_path, make_trajs):
    """Snapshot route, one optimizer step per batch, version-0 tokens consumed at version 0: with no
    answer for them (the service left them unscored) the learner's own forward supplies pi_old, and
    loss, ratios and weights equal those trained with the service's exact values to the bit."""
    trajs = make_trajs(n=8, seed=7)
    runs = []
    for own in (False, True):
        core = LearnerCore(settings(tiny_model_path, loss=loss_config("snapshot"), lr=1e-2, current_from_learner=own))
        old = None
        if not own:
            lp = core.logprobs(collate(trajs, consuming_version=0)).numpy()
            old = [lp[i, : len(t.token_ids)].copy() for i, t in enumerate(trajs)]
        m = core.train_step(trajs, old_logits=old)
        runs.append((m, _params(core)))
    (m_svc, w_svc), (m_own, w_own) = runs
    assert m_svc["exact_token_fraction"] == m_own["exact_token_fraction"] == 1.0
    assert m_svc["current_exact_tokens"] == 0.0 and m_own["current_exact_tokens"] == m_own["tokens"]
    # no token needed the proxy: the EWMA forward ran only as the version-0 probe, in both
    assert m_own["ewma_forward_micro_batches"] == m_svc["ewma_forward_micro_batches"] == 1.0
    assert (m_svc["loss"], m_svc["ratio_max"], m_svc["ratio_min"]) == (
        m_own["loss"],
        m_own["ratio_max"],
        m_own["ratio_min"],
    )
    assert all(torch.equal(w_svc[k], w_own[k]) for k in w_svc)
    with pytest.raises(ValueError, match="current_from_learner: needs one optimizer step"):
        settings(tiny_model_path, loss=loss_config("snapshot"), ppo_mini_batches=2, current_from_learner=True)


def test_kl_to_the_frozen_reference_is_zero_at_version_0_and_measured_against_it_after(tiny_model_path, make_trajs):
    """With ``kl_coef`` the reference is version 0: the first step's ``kl_ref`` is 0 (policy and
    reference are the same weights, scored in the same numerics), and the second step's is the token
    mean of k3 = e^-x - 1 + x with x = log pi_v1 - log pi_v0 on the batch, computed here from a
    fresh learner (version 0) and the trained one."""
    s = settings(tiny_model_path, loss=loss_config("grpo", kl_coef=0.1, entropy_coef=0.01), lr=1e-2)
    core = LearnerCore(s)
    assert core.reference is not None and core.reference.bytes > 0
    m1 = core.train_step(make_trajs(seed=0))
    assert m1["kl_ref"] == pytest.approx(0.0, abs=1e-7) and m1["ref_forward_s"] > 0
    assert m1["entropy_loss"] == pytest.approx(m1["entropy"], rel=1e-6)
    nxt = make_trajs(seed=1, version=1)
    batch = collate(nxt, consuming_version=1)
    x = core.logprobs(batch) - LearnerCore(s.model_copy(update={"master_port": free_port()})).logprobs(batch)
    x = x[batch.loss_mask].double()
    expected = float((torch.expm1(-x) + x).mean())
    m2 = core.train_step(nxt)
    assert m2["kl_ref"] == pytest.approx(expected, rel=1e-4, abs=1e-9)
    assert m2["kl_loss"] == pytest.approx(expected, rel=1e-4, abs=1e-9)


def test_a_kl_penalty_in_the_reward_trains_as_the_rewards_lowered_by_hand(tiny_model_path, make_trajs):
    """``kl_reward_coef`` 0.5: the step's ``kl_reward`` is the batch mean of sum_t (log mu_t - log
    pi_ref_t) over each sequence's loss tokens, pi_ref being version 0 (a fresh learner's log-probs),
    and the step's gradient is the one a learner without the penalty takes on the same trajectories
    with rewards ``r - 0.5 * kl`` given by hand."""
    trajs = make_trajs(seed=3, noise=0.3)
    batch = collate(trajs, consuming_version=0)
    plain = LearnerCore(settings(tiny_model_path, lr=1e-2, loss=loss_config("grpo")))
    kl = torch.where(batch.loss_mask, batch.behav_logprobs - plain.logprobs(batch), 0.0).sum(-1)
    core = LearnerCore(settings(tiny_model_path, lr=1e-2, loss=loss_config("grpo", kl_reward_coef=0.5)))
    grads, m = train_step_with_grads(core, trajs)
    assert m["kl_reward"] == pytest.approx(float(kl.mean()), rel=1e-4)
    assert m["kl_reward_penalty"] == pytest.approx(0.5 * float(kl.mean()), rel=1e-4)
    assert m["kl_ref"] == pytest.approx(0.0, abs=1e-7)  # the loss's KL to version 0, at version 0
    by_hand = [t.model_copy(update={"reward": t.reward - 0.5 * float(k)}) for t, k in zip(trajs, kl, strict=True)]
    want, _ = train_step_with_grads(plain, by_hand)
    assert sorted(grads) == sorted(want) and max_diff(grads, want) < 1e-6


def test_reference_log_probs_brought_by_the_batch_train_as_the_learners_own(tiny_model_path, make_trajs):
    """With ``reference_in_batch`` the learner holds no frozen copy and trains on the reference
    log-probs the old-logit answer brings (here a version-0 learner's, as the service's pinned
    version 0 gives them): the same ``kl_reward`` and gradient as a learner scoring its own; an
    answer without them is refused, naming how many loss tokens lack one."""
    from protocol import OldLogitAnswer, TokenStatus

    trajs = make_trajs(seed=4, noise=0.3)
    loss = loss_config("grpo", kl_coef=0.05, kl_reward_coef=0.5)
    own = LearnerCore(settings(tiny_model_path, lr=1e-2, loss=loss))
    batch = collate(trajs, consuming_version=0)
    ref = own.logprobs(batch)
    status = [np.where(t.loss_mask == 1, TokenStatus.MISSING_NEVER_STORED, TokenStatus.CONTEXT) for t in trajs]
    answer = OldLogitAnswer(
        request_id="step-0", route="snapshot", seconds=0.0, status=status,
        old_logprobs=[np.full(len(t.token_ids), np.nan, np.float32) for t in trajs],
        ref_logprobs=[ref[i, : len(t.token_ids)].numpy() for i, t in enumerate(trajs)],
    )  # fmt: skip
    brought = LearnerCore(settings(tiny_model_path, lr=1e-2, loss=loss, reference_in_batch=True))
    assert brought.reference is None
    got, m = train_step_with_grads(brought, trajs, answer)
    want, m_own = train_step_with_grads(own, trajs)
    assert m["kl_reward"] == pytest.approx(m_own["kl_reward"], rel=1e-5)
    assert max_diff(got, want) < 1e-6
    bare = answer.model_copy(update={"ref_logprobs": None})
    n = sum(int(t.loss_mask.sum()) for t in trajs)
    with pytest.raises(ValueError, match=f"ref_logprobs: {n} loss tokens of the batch at version 1 came without"):
        brought.train_step(make_trajs(seed=5, noise=0.3, version=1), bare)


def test_the_learning_rate_follows_its_schedule_and_resumes_at_the_same_step(tiny_model_path, make_trajs, tmp_path):
    """Warm-up 2, cosine to step 4, floor 0.1, two optimizer steps per batch, lr 1e-3: the first
    batch's steps run at 1e-3 / 3 and 2e-3 / 3, the second's at 1e-3 and 0.55e-3 (half-way:
    0.1 + 0.9 * (1 + cos(pi / 2)) / 2); a learner resumed from the checkpoint after the first
    batch runs the second at the same rates."""
    s = settings(
        tiny_model_path, ppo_mini_batches=2, lr_schedule="cosine", lr_warmup_steps=2, lr_decay_steps=4, lr_min_ratio=0.1
    )
    core = LearnerCore(s)
    core.train_step(make_trajs(seed=0))
    assert [o["lr"] for o in core.last_optimizer_steps] == pytest.approx([1e-3 / 3, 2e-3 / 3], rel=1e-12)
    core.save_checkpoint(str(tmp_path))
    resumed = LearnerCore(s.model_copy(update={"master_port": free_port()}))
    resumed.load_checkpoint(str(tmp_path))
    assert resumed.optimizer_steps == core.optimizer_steps == 2
    for learner in (core, resumed):
        m = learner.train_step(make_trajs(seed=1, version=1))
        assert [o["lr"] for o in learner.last_optimizer_steps] == pytest.approx([1e-3, 0.55e-3], rel=1e-12)
        assert m["lr"] == pytest.approx(0.55e-3, rel=1e-12)


def test_adaptive_entropy_control_moves_the_coefficient_per_version_and_resumes_it(
    tiny_model_path, make_trajs, tmp_path
):
    """Target 100 nats (every step is below it), start 0, delta 0.01: the first version trains
    with the starting coefficient 0 and raises it to 0.01; the second trains with 0.01 and raises
    it to 0.02; a learner resumed from the checkpoint after the first version trains the second
    with 0.01 too. The control reads the versions' entropies smoothed (0.5): after the first version
    its entropy is that version's, after the second the mean of the two, resumed or not. Without a
    target the control is off: the settings' own coefficient stays."""
    loss = loss_config(
        "grpo", entropy_target=100.0, entropy_coef_delta=0.01, entropy_coef_backoff=0.5, entropy_smoothing=0.5
    )
    s = settings(tiny_model_path, loss=loss)
    core = LearnerCore(s)
    m = core.train_step(make_trajs(seed=0))
    assert m["entropy_coef"] == 0.0 and core.entropy_control.coef == pytest.approx(0.01)
    first = m["entropy"]
    assert core.entropy_control.entropy == first
    core.save_checkpoint(str(tmp_path))
    resumed = LearnerCore(s.model_copy(update={"master_port": free_port()}))
    resumed.load_checkpoint(str(tmp_path))
    assert resumed.entropy_control.state_dict() == core.entropy_control.state_dict()
    for learner in (core, resumed):
        m = learner.train_step(make_trajs(seed=1, version=1))
        assert m["entropy_coef"] == pytest.approx(0.01) and learner.entropy_control.coef == pytest.approx(0.02)
        assert learner.entropy_control.entropy == pytest.approx((first + m["entropy"]) / 2)
    fixed = LearnerCore(settings(tiny_model_path, loss=loss_config("grpo", entropy_coef=0.003)))
    m = fixed.train_step(make_trajs(seed=0))
    assert m["entropy_coef"] == 0.003 and fixed.entropy_control.coef == 0.003


def test_mini_batches_take_the_rows_in_the_seeded_order_of_each_epoch(tiny_model_path, make_trajs):
    """Rows of 2 .. 16 completion tokens, two mini-batches, two epochs, seed 3: each optimizer step's
    token count is the sum over the rows :func:`shuffled_rows` gives its half of that epoch."""
    lengths = [6, 8, 10, 12, 14, 16, 18, 20]
    trajs = make_trajs(n=8, seed=2, lengths=lengths)
    core = LearnerCore(settings(tiny_model_path, ppo_mini_batches=2, ppo_epochs=2, seed=3))
    core.train_step(trajs)
    tokens = [L - 4 for L in lengths]
    expected = []
    for epoch in range(2):
        order = shuffled_rows(8, 3, 0, epoch)
        expected += [sum(tokens[i] for i in order[:4]), sum(tokens[i] for i in order[4:])]
    assert [o["tokens"] for o in core.last_optimizer_steps] == expected
    assert expected != [sum(tokens[:4]), sum(tokens[4:])] * 2  # the seed's order is not the buffer's


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_services_exact_old_logits_are_the_learners_own_in_its_dtype(tiny_model_path, make_trajs, dtype):
    """The old-logit service held in the learner's dtype (the job's wiring: ``learner.dtype`` is the
    service's, and it installs the learner's publication in that dtype) scores version-1 tokens to
    the learner's own log-probs bit for bit, in bf16 as in fp32; so at staleness 0 with two
    optimizer steps the first step's ratio is exactly 1 on every token with the service's values."""
    from oldlogit_service import OldLogitService
    from protocol import OldLogitRequest

    s = settings(tiny_model_path, dtype=dtype, loss=loss_config("snapshot"), ppo_mini_batches=2, lr=1e-2)
    core = LearnerCore(s)
    svc = OldLogitService(tiny_model_path, route="snapshot", max_staleness=2, dtype=dtype)
    assert core.train_step(make_trajs(seed=0))["applied"] == 1.0
    svc.update_weights(*core.publish(dtype))
    trajs = make_trajs(n=8, seed=3, version=1)
    items = [
        {"trajectory_id": t.trajectory_id, "token_ids": t.token_ids, "loss_mask": t.loss_mask, "versions": t.versions}
        for t in trajs
    ]
    answer = svc.score(OldLogitRequest(request_id="r", temperature=1.0, items=items))
    own = core.logprobs(collate(trajs, consuming_version=1)).numpy()
    for r, t in enumerate(trajs):
        sel = t.loss_mask == 1
        assert np.array_equal(answer.old_logprobs[r][sel], own[r, : len(t.token_ids)][sel]), r
    core.train_step(trajs, old_logits=answer)
    first = core.last_optimizer_steps[0]
    assert first["ratio_max"] == 1.0 and first["ratio_min"] == 1.0
