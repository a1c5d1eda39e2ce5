"""The DeepSpeed learner with LoRA, for real on CPU (gloo, torch AdamW), on the tiny random Llama.

Rank 4, alpha 8 on every attention and MLP projection of the tiny model (2 layers, hidden 128,
kv 64, intermediate 256): per layer 4 * ((128+128) + (128+64) * 2 + (128+128) + (128+256) * 3) =
8192 elements, 16384 in all, so one fp32 adapter is 65536 bytes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from modelkit.modelhub import load_causal_lm
from modelkit.scoring import sequence_logprobs
from oldlogit_service import OldLogitService
from protocol import OldLogitRequest, TokenStatus, Trajectory
from trainer.algorithm.batch import collate
from trainer.algorithm.loss_config import loss_config
from trainer.learner import LearnerCore, LearnerSettings, free_port
from trainer.learner.lora_config import LoraSettings

pytestmark = pytest.mark.integration

ADAPTER_BYTES = 65536
LORA = LoraSettings(enabled=True, rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def make_trajs(tiny_model_path):
    model = load_causal_lm(tiny_model_path)

    def make(n=4, length=12, prompt=4, seed=0, versions=None):
        rng = np.random.default_rng(seed)
        out = []
        for i in range(n):
            ids = rng.integers(3, 2000, length)
            with torch.no_grad():
                lp = sequence_logprobs(model, torch.tensor(ids)[None], torch.ones(1, length, dtype=torch.long), 1.0)
            mask = np.zeros(length, np.int8)
            mask[prompt:] = 1
            mu = np.where(mask == 1, np.minimum(lp[0].numpy() + rng.normal(0, 0.05, length), 0.0), 0.0)
            ver = np.where(mask == 1, 0, -1) if versions is None else np.asarray(versions[i])
            out.append(Trajectory(
                trajectory_id=f"t{seed}-{i}", group_id=f"g{i // 2}", token_ids=ids, loss_mask=mask,
                behav_logprobs=mu.astype(np.float32), versions=ver, policy_version=int(ver.max()), prompt_len=prompt,
                finish_reason="stop", reward=float(i % 2),
            ))  # fmt: skip
        return out

    return make


def settings(path, **kw) -> LearnerSettings:
    base = dict(model_path=str(path), lr=1e-2, micro_batch_size=2, master_port=free_port(), lora=LORA)
    base.update(kw)
    return LearnerSettings(**base)


def set_peak_lr(core: LearnerCore, lr: float) -> None:
    """Give ``core`` the peak learning rate ``lr`` that its schedule scales before every optimizer
    step (``model_copy`` does not validate, so an infinite rate gets through to the optimizer)."""
    core.settings = core.settings.model_copy(update={"lr": lr})


def _frozen(core: LearnerCore) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in core.engine.module.named_parameters() if not p.requires_grad}


@pytest.mark.parametrize("stage,dtype", [(0, "float32"), (1, "bfloat16"), (2, "float32")])
def test_only_the_adapter_trains_and_is_published(tiny_model_path, make_trajs, stage, dtype):
    core = LearnerCore(settings(tiny_model_path, zero_stage=stage, dtype=dtype))
    opt_params = [p for g in core._optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in opt_params) == ADAPTER_BYTES // 4 and all(p.requires_grad for p in opt_params)
    frozen, before = _frozen(core), core.adapter_state()
    m = core.train_step(make_trajs())
    assert m["applied"] == 1.0 and core.version == 1 and math.isfinite(m["loss"])
    assert m["ewma_bytes_held"] == ADAPTER_BYTES  # the EWMA averages the adapter only (fp32)
    after = core.adapter_state()
    assert all(torch.equal(p, frozen[n]) for n, p in _frozen(core).items())  # the base never moves
    # B starts at 0, so the first gradient of every A is B^T (...) = 0 and A stays put, while every
    # B moves by one Adam step (|update| <= lr = 1e-2)
    for k in after:
        if ".lora_A." in k:
            assert torch.equal(after[k], before[k]), k
        else:
            assert torch.equal(before[k], torch.zeros_like(before[k])) and 0 < float(after[k].abs().max()) <= 1.01e-2
    manifest, payload = core.publish("float32")
    assert manifest.adapter is not None and manifest.adapter.rank == 4 and manifest.adapter.alpha == 8.0
    assert manifest.total_bytes == ADAPTER_BYTES == core.last_publish["bytes"] and len(payload) == 28
    assert manifest.version == 1 and manifest.tied == {}


def test_exact_old_logits_from_adapter_snapshots_equal_the_learner(tiny_model_path, make_trajs):
    """The required exactness check: a real LearnerCore trains two LoRA steps and publishes each
    adapter to an adapter-snapshot service; a batch mixing versions 0, 1 and 2 (every sequence
    spans two of them) is scored, and each token equals the learner's own forward at that
    version (fp32, within 1e-5 nats)."""
    core = LearnerCore(settings(tiny_model_path, loss=loss_config("snapshot")))
    svc = OldLogitService(tiny_model_path, route="snapshot", max_staleness=2, adapter=LORA.spec())
    mixed = [[-1] * 4 + [0] * 4 + [1] * 4, [-1] * 4 + [1] * 5 + [2] * 3, [-1] * 4 + [0] * 2 + [2] * 6]
    probe = make_trajs(n=3, seed=9, versions=mixed)
    b = collate(probe, consuming_version=2)
    ref = {0: core.logprobs(b)}
    for v in (1, 2):
        assert core.train_step(make_trajs(seed=v))["applied"] == 1.0 and core.version == v
        svc.update_weights(*core.publish("float32"))
        ref[v] = core.logprobs(b)
    assert svc.versions_held == [0, 1, 2]
    assert float((ref[2] - ref[0]).abs().max()) > 1e-3  # the versions really differ
    items = [
        {"trajectory_id": t.trajectory_id, "token_ids": t.token_ids, "loss_mask": t.loss_mask, "versions": t.versions}
        for t in probe
    ]
    ans = svc.score(OldLogitRequest(request_id="r", temperature=1.0, items=items))
    for r, t in enumerate(probe):
        assert (ans.status[r][4:] == TokenStatus.EXACT).all()
        for v in (0, 1, 2):
            sel = t.versions == v
            if sel.any():
                got, want = ans.old_logprobs[r][sel], ref[v][r].numpy()[sel]
                assert np.abs(got - want).max() <= 1e-5, (r, v)
    # held: the base once and three adapters
    base = sum(p.numel() for p in load_causal_lm(tiny_model_path).parameters()) * 4
    assert svc.bytes_held == base + 3 * ADAPTER_BYTES


def test_checkpoint_holds_the_adapter_and_resumes(tiny_model_path, make_trajs, tmp_path):
    s = settings(tiny_model_path)
    core = LearnerCore(s)
    core.train_step(make_trajs(seed=0))
    path = core.save_checkpoint(str(tmp_path), extra={"k": 1})
    model_file = next(p for p in (tmp_path / "v1").iterdir() if "model_states" in p.name)
    # the base (6.6M parameters, 26 MB) is not in it; the adapter (65 KB) is
    assert model_file.stat().st_size < 10 * ADAPTER_BYTES
    resumed = LearnerCore(s.model_copy(update={"seed": 123, "master_port": free_port()}))
    assert path.endswith("v1") and resumed.load_checkpoint(str(tmp_path)) == {"k": 1} and resumed.version == 1
    a, b = core.adapter_state(), resumed.adapter_state()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(resumed.ewma.params[k], core.ewma.params[k]) for k in core.ewma.params)
    nxt = make_trajs(seed=1)
    m1, m2 = core.train_step(nxt), resumed.train_step(nxt)
    assert m1["version"] == m2["version"] == 2.0
    a, b = core.adapter_state(), resumed.adapter_state()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6  # same optimizer state, same step
    other = LearnerCore(s.model_copy(update={"lora": LORA.model_copy(update={"rank": 2}), "master_port": free_port()}))
    with pytest.raises(ValueError, match=r"lora.rank: checkpoint 'v1' was saved with 4, this learner has 2"):
        other.load_checkpoint(str(tmp_path))


def test_nonfinite_update_rolls_back_the_adapter_only(tiny_model_path, make_trajs):
    core = LearnerCore(settings(tiny_model_path, rollback_copy="on"))
    assert core.train_step(make_trajs())["applied"] == 1.0
    frozen, before = _frozen(core), core.adapter_state()
    set_peak_lr(core, float("inf"))
    m = core.train_step(make_trajs(seed=1))
    assert m["applied"] == 0.0 and m["nonfinite_weight_steps"] == 1.0 and core.version == 1
    after = core.adapter_state()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert all(torch.equal(p, frozen[n]) for n, p in _frozen(core).items())


def test_the_kl_reference_is_the_base_with_the_adapter_off_and_costs_no_copy(tiny_model_path, make_trajs):
    """With LoRA the frozen reference is the base model (the adapter disabled): nothing is copied,
    the first step's ``kl_ref`` is 0 (B = 0: version 0 is the base), and after a step that moved the
    adapter the trained model's own log-probs with the adapter switched off equal the base's."""
    core = LearnerCore(settings(tiny_model_path, loss=loss_config("grpo", kl_coef=0.1), lr=1e-2))
    assert core.reference is not None and core.reference.bytes == 0
    m = core.train_step(make_trajs(seed=0))
    assert m["kl_ref"] == pytest.approx(0.0, abs=1e-7)
    batch = collate(make_trajs(seed=1), consuming_version=1)
    ref = core.reference.logprobs(
        core.engine.module, batch.token_ids, batch.attention_mask, 1.0, 1, core.settings.logprob_chunk_bytes
    )
    base = sequence_logprobs(load_causal_lm(tiny_model_path), batch.token_ids, batch.attention_mask, 1.0)
    assert float((ref - base)[batch.loss_mask].abs().max()) < 1e-5
    assert float((core.logprobs(batch) - base)[batch.loss_mask].abs().max()) > 1e-4  # the adapter moved
