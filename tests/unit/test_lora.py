"""LoRA without DeepSpeed: the merge rule on hand-computed values, adapter manifests, the config
refusals, the adapter-only EWMA, adapter snapshots in the old-logit service, and a worker's merge."""

from __future__ import annotations

import numpy as np
import pydantic
import pytest
import torch

from modelkit.lora import (
    adapter_bytes,
    adapter_state,
    adapter_to_peft,
    base_state,
    merged_weights,
    pack_adapter,
    peft_to_adapter,
    peft_to_hf,
    wrap_lora,
)
from modelkit.modelhub import load_causal_lm
from modelkit.scoring import sequence_logprobs
from modelkit.weights import pack_weights
from oldlogit_service import OldLogitService
from protocol import AdapterSpec, OldLogitRequest, ProtocolError, TokenStatus, WeightManifest, adapter_key
from trainer.algorithm.ewma import EwmaProximal
from trainer.algorithm.loss_config import EwmaConfig
from trainer.driver.config.schema import load_config, one_line

T = 0.8
Q = "model.layers.0.self_attn.q_proj"


def spec(rank: int = 1, alpha: float = 2.0, targets=("q_proj",)) -> AdapterSpec:
    return AdapterSpec(rank=rank, alpha=alpha, target_modules=list(targets))


# -- merge math ---------------------------------------------------------------------------------


def test_merged_weights_hand_computed():
    """W' = W + (alpha / r) * B @ A. r=1, alpha=2 (scaling 2): B @ A = [[2, 0], [1, 0]], so
    [[1, 2], [3, 4]] + 2 * that = [[5, 2], [5, 4]]."""
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    other = torch.tensor([7.0])
    base = {f"{Q}.weight": w, "model.norm.weight": other}
    adapter = {adapter_key(Q, "A"): torch.tensor([[1.0, 0.0]]), adapter_key(Q, "B"): torch.tensor([[2.0], [1.0]])}
    out = merged_weights(base, adapter, spec(rank=1, alpha=2.0))
    assert out[f"{Q}.weight"].tolist() == [[5.0, 2.0], [5.0, 4.0]]
    assert out["model.norm.weight"] is other  # untouched tensors are the base's own, not copies
    assert w.tolist() == [[1.0, 2.0], [3.0, 4.0]]  # the base is never modified
    # merging twice from the base gives the same answer (never cumulative)
    assert merged_weights(base, adapter, spec(rank=1, alpha=2.0))[f"{Q}.weight"].tolist() == [[5.0, 2.0], [5.0, 4.0]]


def test_merged_weights_rank2_scaling_and_dtype():
    """r=2, alpha=1 (scaling 0.5): B @ A = [[1, 1], [0, 2]] -> W' = 0 + [[0.5, 0.5], [0, 1]]; a bf16 base stays bf16."""
    a = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    b = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    base = {f"{Q}.weight": torch.zeros(2, 2, dtype=torch.bfloat16)}
    out = merged_weights(base, {adapter_key(Q, "A"): a, adapter_key(Q, "B"): b}, spec(rank=2, alpha=1.0))
    assert out[f"{Q}.weight"].dtype == torch.bfloat16
    assert out[f"{Q}.weight"].float().tolist() == [[0.5, 0.5], [0.0, 1.0]]


def test_merged_weights_refusals_name_the_module():
    base = {f"{Q}.weight": torch.zeros(3, 2)}
    a, b = torch.zeros(1, 2), torch.zeros(3, 1)
    with pytest.raises(ValueError, match=r"lora_A without its pair"):
        merged_weights(base, {adapter_key(Q, "A"): a}, spec())
    with pytest.raises(ValueError, match=r"not \[2, in\] and \[out, 2\]"):
        merged_weights(base, {adapter_key(Q, "A"): a, adapter_key(Q, "B"): b}, spec(rank=2))
    with pytest.raises(ValueError, match=r"B @ A is \[3, 4\], base .* is \[3, 2\]"):
        merged_weights(base, {adapter_key(Q, "A"): torch.zeros(1, 4), adapter_key(Q, "B"): b}, spec())
    other = "model.layers.1.self_attn.q_proj"
    with pytest.raises(
        ValueError, match=r"adapts 'model.layers.1.self_attn.q_proj.weight', which the base does not have"
    ):
        merged_weights(base, {adapter_key(other, "A"): a, adapter_key(other, "B"): b}, spec())
    with pytest.raises(ValueError, match=r"not a LoRA factor name"):
        merged_weights(base, {"model.norm.weight": a}, spec())


def test_adapter_bytes_and_names():
    # q_proj 128 -> 128 and k_proj 128 -> 64 at rank 4, fp32: 4 * (256 + 192) * 4 bytes
    assert adapter_bytes([(128, 128), (64, 128)], rank=4) == 7168
    assert spec(rank=4, alpha=8.0).scaling == 2.0
    peft = f"base_model.model.{Q}.lora_B.default.weight"
    assert peft_to_adapter(peft) == adapter_key(Q, "B") == f"base_model.model.{Q}.lora_B.weight"
    assert adapter_to_peft(adapter_key(Q, "B")) == peft
    assert peft_to_hf(f"base_model.model.{Q}.base_layer.weight") == f"{Q}.weight"
    assert peft_to_hf("base_model.model.model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert peft_to_hf(peft) is None and peft_to_adapter("base_model.model.model.norm.weight") is None


# -- manifests ----------------------------------------------------------------------------------


def _manifest(tensors: list[tuple[str, list[int]]], adapter: AdapterSpec | None, tied=None) -> WeightManifest:
    return WeightManifest(
        version=1,
        tensors=[{"name": n, "shape": s, "dtype": "float32"} for n, s in tensors],
        checksum="0" * 32,
        tied=tied or {},
        adapter=adapter,
    )


def test_adapter_manifest_validation_names_the_field():
    ok = [(adapter_key(Q, "A"), [2, 8]), (adapter_key(Q, "B"), [16, 2])]
    m = _manifest(ok, spec(rank=2))
    assert m.adapter.rank == 2 and m.total_bytes == (16 + 32) * 4
    assert _manifest([("model.norm.weight", [8])], None).adapter is None  # full weights: unchanged rule
    bad = {
        "without its pair": [ok[0]],
        "not rank adapter.rank=3": ok,
        "is not a LoRA factor name": [*ok, ("model.norm.weight", [8])],
        "not in adapter.target_modules": [
            (adapter_key("model.layers.0.mlp.up_proj", w), s) for (_, s), w in zip(ok, "AB", strict=True)
        ],
        "a LoRA factor is 2-D": [(adapter_key(Q, "A"), [2, 8, 1]), ok[1]],
    }
    for msg, tensors in bad.items():
        with pytest.raises(pydantic.ValidationError, match=msg):
            _manifest(tensors, spec(rank=3 if "rank" in msg else 2))
    with pytest.raises(pydantic.ValidationError, match="an adapter publication ties nothing"):
        _manifest(ok, spec(rank=2), tied={"x": ok[0][0]})
    with pytest.raises(pydantic.ValidationError, match="rank"):
        AdapterSpec(rank=0, alpha=1.0, target_modules=["q_proj"])
    with pytest.raises(pydantic.ValidationError, match="target_modules"):
        AdapterSpec(rank=1, alpha=1.0, target_modules=[])
    # the JSON round trip keeps the adapter
    assert WeightManifest.model_validate_json(m.model_dump_json()) == m


# -- config -------------------------------------------------------------------------------------


def _refusal(*overrides: str) -> str:
    with pytest.raises(pydantic.ValidationError) as e:
        load_config(None, list(overrides))
    return one_line(e.value)


def test_config_refusals_are_one_line_naming_field_and_value():
    assert (
        _refusal("lora.enabled=true", "learner.zero_stage=3")
        == "learner.zero_stage: 3 is not supported with lora.enabled (supported: 0, 1, 2)"
    )
    assert _refusal("lora.enabled=true", "rollout.inject_mismatch_std=0.1").startswith(
        "rollout.inject_mismatch_std: 0.1 is not supported with lora.enabled"
    )
    assert _refusal("lora.rank=0").startswith("lora.rank: Input should be greater than or equal to 1 (got 0)")
    assert _refusal("lora.dropout=1.0").startswith("lora.dropout: Input should be less than 1 (got 1.0)")
    assert (
        _refusal('lora.target_modules=["q_proj", "q-proj"]')
        == "lora.target_modules: 'q-proj' is not a module name (letters, digits, underscores)"
    )
    cfg = load_config(None, ["lora.enabled=true", "learner.zero_stage=2", "lora.rank=4"])
    assert cfg.lora.spec() == AdapterSpec(
        rank=4, alpha=16.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert load_config(None, ["learner.zero_stage=3"]).lora.enabled is False  # off: every stage as before


def test_learner_settings_refuse_zero3_with_lora():
    from trainer.learner import LearnerSettings
    from trainer.learner.lora_config import LoraSettings

    with pytest.raises(pydantic.ValidationError, match=r"learner.zero_stage: 3 is not supported with lora.enabled"):
        LearnerSettings(model_path="x", zero_stage=3, lora=LoraSettings(enabled=True))
    assert LearnerSettings(model_path="x", zero_stage=2, lora=LoraSettings(enabled=True)).lora.rank == 8


# -- EWMA over the adapter ----------------------------------------------------------------------


def test_ewma_trainable_only_averages_the_adapter():
    """beta 0.5 (window 2): from 0, steps to 1 then 2 -> 0.666667 then 1.428571 (module docstring);
    the frozen layer is not held, and a swap leaves it alone."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 1, bias=False))
    model[0].requires_grad_(False)
    with torch.no_grad():
        model[1].weight.zero_()
    ewma = EwmaProximal(model, EwmaConfig(beta_source="window", window=2), trainable_only=True)
    assert list(ewma.params) == ["1.weight"] and ewma.nbytes == 2 * 4 and ewma.status()["bytes_held"] == 8
    for value in (1.0, 2.0):
        with torch.no_grad():
            model[1].weight.fill_(value)
        ewma.update(model)
    assert ewma.params["1.weight"][0].tolist() == pytest.approx([1.428571, 1.428571], abs=1e-6)
    frozen = model[0].weight.clone()
    scorer = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 1, bias=False))
    scorer.requires_grad_(False)  # a copy with nothing trainable is read by the EWMA's names
    kept = scorer[1].weight.detach().clone()
    with ewma.swapped_into(scorer):
        assert scorer[1].weight[0].tolist() == pytest.approx([1.428571, 1.428571], abs=1e-6)
    assert torch.equal(scorer[1].weight, kept) and torch.equal(model[0].weight, frozen)
    with pytest.raises(ValueError, match="no parameter requires a gradient"):
        EwmaProximal(scorer, trainable_only=True)


# -- adapter snapshots --------------------------------------------------------------------------


class AdapterLearner:
    """A stand-in LoRA learner (peft, no DeepSpeed): version v moves every A and B by small random steps."""

    def __init__(self, folder, spec: AdapterSpec):
        torch.manual_seed(0)
        self.spec = spec
        self.model = wrap_lora(load_causal_lm(folder), spec).eval()
        self.states = {0: {k: v.detach().clone() for k, v in adapter_state(self.model).items()}}

    def _load(self, version: int) -> None:
        with torch.no_grad():
            for k, p in adapter_state(self.model).items():
                p.copy_(self.states[version][k])

    def step_to(self, version: int) -> None:
        while max(self.states) < version:
            v = max(self.states) + 1
            g = torch.Generator().manual_seed(2000 + v)
            self._load(v - 1)
            with torch.no_grad():
                for p in adapter_state(self.model).values():
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
            self.states[v] = {k: t.detach().clone() for k, t in adapter_state(self.model).items()}

    def publish(self, svc: OldLogitService, version: int) -> WeightManifest:
        self.step_to(version)
        manifest, payload = pack_adapter(self.states[version].items(), version, self.spec)
        svc.update_weights(manifest, payload)
        return manifest

    @torch.no_grad()
    def logprobs(self, version: int, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.step_to(version)
        self._load(version)
        return sequence_logprobs(self.model, ids, mask, T)


@pytest.fixture(scope="module")
def lora_learner(tiny_model_path):
    return AdapterLearner(
        tiny_model_path, AdapterSpec(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
    )


def _items(rows: list[list[int]], seed: int = 0, n_prompt: int = 3) -> list[dict]:
    rng = np.random.RandomState(seed)
    return [
        dict(
            trajectory_id=f"t{i}",
            token_ids=rng.randint(0, 49152, n_prompt + len(v)),
            loss_mask=[0] * n_prompt + [1] * len(v),
            versions=[-1] * n_prompt + v,
        )
        for i, v in enumerate(rows)
    ]


def test_adapter_snapshots_exact_per_version_and_memory(tiny_model_path, lora_learner):
    """W = 2: the service holds the base once + adapters of versions [1, 3]; each token of a mixed
    batch equals the peft learner's forward at its own version (same layout: bit for bit)."""
    svc = OldLogitService(tiny_model_path, route="snapshot", max_staleness=2, adapter=lora_learner.spec)
    base_bytes = svc.bytes_held - svc.store.held_bytes[0]
    # the tiny model's parameters (tied embedding once), fp32
    assert base_bytes == sum(p.numel() for p in load_causal_lm(tiny_model_path).parameters()) * 4
    # per layer: q 128->128, v 128->64, down 256->128 at rank 4: 4 * (256 + 192 + 384) elements; 2 layers
    one = adapter_bytes([(128, 128), (64, 128), (128, 256)] * 2, rank=4)
    assert one == 26624 and svc.store.held_bytes[0] == one  # the folder's version: a zero adapter
    for v in (1, 2, 3):
        assert lora_learner.publish(svc, v).total_bytes == one
    assert svc.versions_held == [1, 2, 3] and svc.evicted == {0: "staleness"}
    assert svc.bytes_held == base_bytes + 3 * one == svc.status().bytes_held
    assert svc.stats()["base_bytes"] == base_bytes
    items = _items([[1, 1, 2, 3], [3, 3, 3], [2, 2]], seed=1)
    ans = svc.score(OldLogitRequest(request_id="r", temperature=T, items=items))
    seq = max(len(it["token_ids"]) for it in items)
    ids = torch.zeros(len(items), seq, dtype=torch.long)
    mask = torch.zeros(len(items), seq, dtype=torch.long)
    for r, it in enumerate(items):
        ids[r, : len(it["token_ids"])] = torch.as_tensor(it["token_ids"])
        mask[r, : len(it["token_ids"])] = 1
    for r, it in enumerate(items):
        v = np.asarray(it["versions"])
        assert (ans.status[r] == np.where(v >= 0, TokenStatus.EXACT, TokenStatus.CONTEXT)).all()
        for ver in set(v[v >= 0].tolist()):
            rows = [q for q, other in enumerate(items) if ver in other["versions"]]
            end = max(int(np.flatnonzero(np.asarray(items[q]["versions"]) == ver).max()) for q in rows) + 1
            ref = lora_learner.logprobs(ver, ids[rows, :end], mask[rows, :end])[rows.index(r)].numpy()
            sel = v == ver
            assert np.array_equal(ans.old_logprobs[r][sel], ref[: len(sel)][sel[:end]]), (r, ver)
    # the versions differ (the adapter matters), and version 0 of the service is the base model
    lp1 = lora_learner.logprobs(1, ids, mask)
    assert float((lp1 - lora_learner.logprobs(3, ids, mask)).abs().max()) > 1e-3
    fresh = OldLogitService(tiny_model_path, route="snapshot", adapter=lora_learner.spec)
    with torch.no_grad():
        base_lp = sequence_logprobs(load_causal_lm(tiny_model_path), ids[:1], mask[:1], T)[0].numpy()
    got = fresh.score(OldLogitRequest(request_id="z", temperature=T, items=_items([[0, 0, 0, 0]], seed=1)))
    assert np.allclose(got.old_logprobs[0][3:7], base_lp[3:7], atol=1e-5, rtol=0)


def test_adapter_service_refuses_the_other_kind(tiny_model_path, lora_learner):
    svc = OldLogitService(tiny_model_path, route="snapshot", adapter=lora_learner.spec)
    full = pack_weights(load_causal_lm(tiny_model_path).state_dict().items(), 1)
    with pytest.raises(
        ProtocolError, match=r"manifest.adapter: full weights \(None\), but this service holds adapters"
    ):
        svc.update_weights(*full)
    other = AdapterSpec(rank=4, alpha=4.0, target_modules=["q_proj", "v_proj", "down_proj"])
    lora_learner.step_to(1)
    with pytest.raises(ProtocolError, match=r"manifest.adapter: .*'alpha': 4.0.*, but this service holds adapters"):
        svc.update_weights(*pack_adapter(lora_learner.states[1].items(), 1, other))
    plain = OldLogitService(tiny_model_path, route="snapshot")
    with pytest.raises(ProtocolError, match=r"manifest.adapter: .*, but this service holds full weights"):
        plain.update_weights(*pack_adapter(lora_learner.states[1].items(), 1, lora_learner.spec))
    assert svc.versions_held == [0] and plain.versions_held == [0]  # nothing changed


def test_single_replica_route_scores_the_loaded_adapter(tiny_model_path, lora_learner):
    svc = OldLogitService(tiny_model_path, route="old_logit_model", adapter=lora_learner.spec)
    lora_learner.publish(svc, 2)
    assert svc.versions_held == [2] and svc.evicted == {0: "superseded"}
    items = _items([[2, 2, 2]], seed=3)
    ids = torch.as_tensor(items[0]["token_ids"])[None]
    out = svc.score_prefixes(items, T)[0]
    ref = lora_learner.logprobs(2, ids, torch.ones_like(ids)).numpy()[0]
    assert np.array_equal(out[3:], ref[3:])


# -- rollout worker: merge from the kept base ---------------------------------------------------


def test_worker_merges_each_version_from_the_pristine_base(tiny_model_path, lora_learner):
    """A worker on the transformers engine applies adapter versions 1 then 2: its weights are the
    merge of each version with the folder's base (never cumulative), and its log-probs match the
    peft learner's to fp32 round-off."""
    from rollout.engine import EngineConfig, TransformersEngine
    from rollout.worker import RolloutWorkerCore

    engine = TransformersEngine(EngineConfig(kind="transformers", model_path=str(tiny_model_path)))
    worker = RolloutWorkerCore(engine)
    base = {k: v.clone() for k, v in load_causal_lm(tiny_model_path).state_dict().items()}
    ids = torch.as_tensor(_items([[0] * 6], seed=4)[0]["token_ids"])[None]
    for v in (1, 2):
        lora_learner.step_to(v)
        assert worker.update_weights(*pack_adapter(lora_learner.states[v].items(), v, lora_learner.spec)) == v
        want = merged_weights(base, lora_learner.states[v], lora_learner.spec)
        got = engine.model.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)
        with torch.no_grad():
            lp = sequence_logprobs(engine.model, ids, torch.ones_like(ids), T)
        ref = lora_learner.logprobs(v, ids, torch.ones_like(ids))
        assert float((lp - ref).abs().max()) < 1e-5
    # the kept base is the folder's, untouched by two merges
    assert all(torch.equal(worker.weights.base[k], base[k]) for k in worker.weights.base)
    # base_state of a wrapped model names the HF weights (tied embedding under both names)
    assert set(base_state(lora_learner.model)) == set(base)
