"""Served-weights fingerprints: the digest rule on hand-worked values, fp32 vs bf16 rounding, a
real worker core (transformers engine on the tiny model) reading its weights back, with full
weights and with LoRA adapters, the test hook that skips loading, and the driver's judgement."""

from __future__ import annotations

import hashlib
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from rich.console import Console

from modelkit.fingerprint import (
    SAMPLES,
    fingerprint_components,
    sample_positions,
    sampled_values,
    weights_fingerprint,
)
from modelkit.lora import pack_adapter
from modelkit.modelhub import load_causal_lm
from modelkit.weights import pack_weights
from protocol import AdapterSpec, adapter_key
from tests.fingerprint_fakes import FakeCalls as _Calls
from tests.fingerprint_fakes import FakePool as _Pool
from trainer.driver.publication.fingerprints import FINGERPRINT_MISMATCH, is_mismatch, mismatched_workers


def _blake(lines: str) -> str:
    return hashlib.blake2b(lines.encode(), digest_size=8).hexdigest()


def test_two_tensor_digest_by_hand():
    """Both tensors have <= 64 elements, so every element is sampled once:
    a = [1.0, 2.5, -0.75]: sum 2.75 = 1.375 * 2**1 -> float.hex '0x1.6000000000000p+1';
    b = [[0.5, 0.25], [1.0, 3.0]]: sum 4.75 = 1.1875 * 2**2 -> '0x1.3000000000000p+2'.
    The fingerprint is BLAKE2b-64 of the two lines in name order."""
    named = {"b": torch.tensor([[0.5, 0.25], [1.0, 3.0]]), "a": torch.tensor([1.0, 2.5, -0.75])}
    samples = {n: sampled_values(n, t) for n, t in named.items()}
    assert fingerprint_components(samples) == {"a": 2.75, "b": 4.75}
    assert weights_fingerprint(named) == _blake("a=0x1.6000000000000p+1\nb=0x1.3000000000000p+2\n")
    # the order of the mapping does not matter; a change of one element does
    assert weights_fingerprint(dict(reversed(named.items()))) == weights_fingerprint(named)
    changed = {**named, "a": torch.tensor([1.0, 2.5, -0.5])}  # sum 3.0 = '0x1.8000000000000p+1'
    assert weights_fingerprint(changed) == _blake("a=0x1.8000000000000p+1\nb=0x1.3000000000000p+2\n")


def test_fp32_values_rounded_to_bf16_give_the_bf16_engines_digest():
    """w = [1 + 2**-8, 1 + 3 * 2**-9] in fp32 sums to 2.009765625. bf16 keeps 7 mantissa bits
    (spacing 2**-7 = 0.0078125 in [1, 2)): 1.00390625 is half way between 1.0 and 1.0078125 and
    rounds to the even 1.0; 1.005859375 is nearer 1.0078125. Rounded sum: 2.0078125."""
    w32 = {"w": torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-9], dtype=torch.float32)}
    w16 = {"w": w32["w"].to(torch.bfloat16)}
    assert w16["w"].float().tolist() == [1.0, 1.0078125]
    assert fingerprint_components({"w": sampled_values("w", w32["w"])}) == {"w": 2.009765625}
    assert fingerprint_components({"w": sampled_values("w", w32["w"], torch.bfloat16)}) == {"w": 2.0078125}
    assert weights_fingerprint(w32, "bfloat16") == weights_fingerprint(w16) == _blake(f"w={(2.0078125).hex()}\n")
    assert weights_fingerprint(w32) != weights_fingerprint(w16)


def test_a_large_tensor_samples_64_seeded_positions():
    """1000 elements 0, 1, ..., 999: the component is the sum of the 64 sampled indices themselves."""
    pos = sample_positions("x", 1000)
    assert pos.shape == (SAMPLES,) and pos.min() >= 0 and pos.max() < 1000
    assert np.array_equal(pos, sample_positions("x", 1000))  # fixed for a name and a size
    t = torch.arange(1000, dtype=torch.float32)
    assert fingerprint_components({"x": sampled_values("x", t)}) == {"x": float(pos.sum())}
    assert fingerprint_components({"n": [1.0, math.inf, -math.inf]})["n"] != fingerprint_components({"n": [0.0]})["n"]


def _core(path, skip: bool = False):
    from rollout.engine import EngineConfig, TransformersEngine
    from rollout.worker import RolloutWorkerCore

    engine = TransformersEngine(EngineConfig(kind="transformers", model_path=str(path), test_skip_weight_loads=skip))
    return RolloutWorkerCore(engine)


def _scaled_state(path, factor: float) -> dict[str, torch.Tensor]:
    model = load_causal_lm(path)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor)
    return model.state_dict()


def test_worker_reads_back_full_weights_and_the_skip_hook_is_caught(tiny_model_path):
    """A real worker core reports the fingerprint of its engine's weights: after version 1 it equals
    the manifest's (the learner's side); with the test hook that skips loading it is still the
    folder's, so the driver's rule calls it a mismatch."""
    manifest, payload = pack_weights(_scaled_state(tiny_model_path, 1.25).items(), version=1)
    good, bad = _core(tiny_model_path), _core(tiny_model_path, skip=True)
    folder_fp = good.served_fingerprint
    assert folder_fp == bad.served_fingerprint
    for core in (good, bad):
        assert core.update_weights(manifest, payload) == 1
    rg, rb = good.fingerprint(), bad.fingerprint()
    assert rg == {"version": 1, "served": manifest.fingerprint, "applied": manifest.fingerprint}
    assert rb == {"version": 1, "served": folder_fp, "applied": manifest.fingerprint}
    assert mismatched_workers(manifest, {"rollout-0": rg, "rollout-1": rb}) == ["rollout-1"]
    assert good.status().served_fingerprint == manifest.fingerprint
    # a report for another version (the worker did not take this publication) is not judged
    assert not is_mismatch(manifest, {**rb, "version": 0}, merges_adapters=True)


def test_lora_worker_serves_the_merge_it_applied(tiny_model_path):
    """With adapters the worker serves base + (alpha / r) B A: the expected value is the fingerprint
    of the merged tensors it handed to the engine, not the adapter's (the service's expectation)."""
    spec = AdapterSpec(rank=2, alpha=4.0, target_modules=["q_proj"])
    g = torch.Generator().manual_seed(3)
    adapter = {}
    for layer in range(2):
        module = f"model.layers.{layer}.self_attn.q_proj"
        adapter[adapter_key(module, "A")] = torch.randn(2, 128, generator=g)
        adapter[adapter_key(module, "B")] = torch.randn(128, 2, generator=g)
    manifest, payload = pack_adapter(adapter.items(), 1, spec)
    good, bad = _core(tiny_model_path), _core(tiny_model_path, skip=True)
    for core in (good, bad):
        core.update_weights(manifest, payload)
    rg, rb = good.fingerprint(), bad.fingerprint()
    assert rg["served"] == rg["applied"] != manifest.fingerprint
    assert rb["applied"] == rg["applied"] and rb["served"] != rb["applied"]
    assert mismatched_workers(manifest, {"w0": rg, "w1": rb}) == ["w1"]
    # the old-logit service holds the adapter itself: its expected value is the manifest's
    assert not is_mismatch(manifest, {"version": 1, "served": manifest.fingerprint}, merges_adapters=False)


@pytest.mark.parametrize("max_restarts", [0, 2])
def test_driver_restarts_and_counts_mismatched_consumers(monkeypatch, max_restarts):
    """Worker w1 and the service serve the folder's weights after version 1: 2 mismatches. w1 is
    killed with reason fingerprint_mismatch (then replaced like a dead worker); the service is killed
    for Ray to restart it and given the publication again, unless oldlogit.max_restarts is 0."""
    import ray

    from trainer.driver.config.schema import load_config
    from trainer.driver.publication.fingerprint_check import FingerprintCheck

    killed = []
    monkeypatch.setattr(ray, "kill", lambda h, no_restart=True: killed.append((h, no_restart)))
    manifest = SimpleNamespace(version=1, adapter=None, fingerprint="a" * 16)
    cfg = load_config(None, [f"oldlogit.max_restarts={max_restarts}"])
    pool = _Pool({"w0": {"version": 1, "served": "a" * 16}, "w1": {"version": 1, "served": "b" * 16}})
    calls = _Calls({"version": 1, "served": "c" * 16})
    f = FingerprintCheck(cfg, Console(quiet=True), pool, SimpleNamespace(calls=calls, oldlogit="service-handle"))
    f.check_fingerprints(manifest, (manifest, "ref"))
    assert pool.killed == [(["w1"], FINGERPRINT_MISMATCH)] and f.mismatches == 2
    if max_restarts:
        assert killed == [("service-handle", False)] and calls.calls == ["fingerprint", "update_weights"]
    else:
        assert killed == [] and calls.calls == ["fingerprint"]


def test_service_reports_the_weights_it_holds(tiny_model_path):
    """The old-logit service's fingerprint is of the tensors its forwards use: after version 1 the
    manifest's; one held element changed in place (a consumer whose copy went wrong) changes it."""
    from oldlogit_service import OldLogitService

    svc = OldLogitService(tiny_model_path, route="snapshot", max_staleness=1)
    assert svc.fingerprint() == {"version": 0, "served": None}  # the folder's version: no publication
    manifest, payload = pack_weights(_scaled_state(tiny_model_path, 0.5).items(), version=1)
    svc.update_weights(manifest, payload)
    assert svc.fingerprint() == {"version": 1, "served": manifest.fingerprint}
    name = manifest.tensors[0].name
    held = svc.store.held[1][name]
    svc.store.held[1][name] = held.clone().fill_(7.0)
    assert svc.fingerprint()["served"] != manifest.fingerprint
