"""Weight publication phase by phase and end to end: the previous path and the current one, side by side.

    python -m benchmarks.bench_publish [--fast] [--repeats 3] [--versions 3] [--out runs/bench/publish.json]
    vintage bench publish [--fast]

For the tiny random model and SmolLM2-135M-Instruct (``--fast``: the tiny model only), fp32, one host.
Seconds are wall seconds (``time.perf_counter``), best of ``--repeats``; GB/s = payload bytes / seconds
(1 GB = 1e9 bytes; the payload is every weight once, tied ones counted once).

``before`` is the previous path, kept here for comparison (functions ``legacy_*``): a fresh copy per
tensor, a blake2b-128 digest, a dict of torch tensors through Ray (pickled with copies on both
sides), every consumer checking the digest and finiteness per tensor, the old-logit service copying
what it holds. ``after`` is the code path of :mod:`modelkit.weights` as the job uses it.

Phases (producer: the driver process; consumer: a Ray actor on the same host):

==========  ==================================================================================
reference   ``torch`` copy of the same bytes into a preallocated buffer (the ceiling)
gather      ``model.state_dict()`` (one rank; under ZeRO-3 this is where the all-gather runs)
copy/cast   before and after: a new tensor per weight (``copy=True``: e.g. under ZeRO-3
            or for another dtype); after, learner path: none (``copy=False``: ``ray.put`` copies)
checksum    before: blake2b-128; after: XXH3-128 (:func:`protocol.weights_digest`)
put         ``ray.put`` of the payload (serialise + copy into the object store)
get         ``ray.get`` in the consumer (before: tensors rebuilt by copying; after: read-only views)
verify      names, shapes, byte counts and digest at the consumer; ``verify, 2nd consumer``: a second
            consumer on the host finds the first one's record (after only)
finite      before: one check per tensor; after: one fp32 sum per tensor, one read-back
apply       vLLM (CPU: its layer-wise reload, which repacks GEMM weights) / the old-logit service's
            snapshot store (before: a copy; after: the object-store views held as they are)
==========  ==================================================================================

End to end: a producer actor packs the model and returns the payload into the object store; a
rollout worker (vLLM) and an old-logit service (snapshot route) each take it with the real code path;
seconds from the publish call until both have applied (``learner free``: until the payload is stored,
what the learner and the driver wait for now). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import ray  # noqa: E402
import torch  # noqa: E402

from modelkit.weights import (  # noqa: E402
    nonfinite_names,
    pack_weights,
    private_copy,
    raw_bytes,
    unpack_weights,
    verify_payload,
)
from protocol import ProtocolError, TensorSpec, WeightManifest, verify_weight_payload, weights_digest  # noqa: E402

# ---------------------------------------------------------------------------------------------
# the previous path, for comparison
# ---------------------------------------------------------------------------------------------


def legacy_checksum(named_bytes: list[tuple[str, Any]]) -> str:
    """The previous digest: blake2b-128 over each tensor's name, a NUL and its bytes."""
    h = hashlib.blake2b(digest_size=16)
    for name, buf in named_bytes:
        h.update(name.encode())
        h.update(b"\0")
        h.update(buf)
    return h.hexdigest()


def legacy_copy(items: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The previous copy: a fresh fp32 tensor per weight."""
    return {n: t.detach().to("cpu", torch.float32, copy=True).contiguous() for n, t in items}


def legacy_pack(named: dict[str, torch.Tensor], version: int) -> tuple[WeightManifest, dict[str, torch.Tensor]]:
    """The previous ``pack_weights`` (fp32): tied aliases, a copy per tensor, blake2b."""
    seen: dict[tuple, str] = {}
    tied: dict[str, str] = {}
    items = []
    for name, t in named.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        if key in seen:
            tied[name] = seen[key]
            continue
        seen[key] = name
        items.append((name, t))
    payload = legacy_copy(items)
    specs = [TensorSpec(name=n, shape=list(t.shape), dtype="float32") for n, t in payload.items()]
    checksum = legacy_checksum([(n, raw_bytes(t)) for n, t in payload.items()])
    return WeightManifest(version=version, tensors=specs, checksum=checksum, tied=tied), payload


def legacy_verify(manifest: WeightManifest, payload: dict[str, torch.Tensor]) -> None:
    """The previous consumer check: shapes, byte counts, then blake2b over all bytes."""
    for spec in manifest.tensors:
        t = payload[spec.name]
        if list(t.shape) != spec.shape or t.numel() * t.element_size() != spec.nbytes:
            raise ProtocolError(f"payload[{spec.name!r}]: shape or size differs")
    if legacy_checksum([(s.name, raw_bytes(payload[s.name])) for s in manifest.tensors]) != manifest.checksum:
        raise ProtocolError("checksum: payload digest differs")


def legacy_finite(payload: dict[str, torch.Tensor]) -> list[str]:
    """The previous finite check: one stacked sum per tensor, called once per tensor."""
    bad = []
    for n, t in payload.items():
        if not bool(torch.isfinite(torch.sum(t, dtype=torch.float32))) and not bool(torch.isfinite(t).all()):
            bad.append(n)
    return bad


def legacy_unpack(manifest: WeightManifest, payload: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    legacy_verify(manifest, payload)
    if legacy_finite(payload):
        raise ProtocolError("payload: holds a non-finite value")
    out = dict(payload)
    for alias, src in manifest.tied.items():
        out[alias] = out[src]
    return out


# ---------------------------------------------------------------------------------------------
# timing helpers and actors
# ---------------------------------------------------------------------------------------------


def best(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Best wall seconds of ``repeats`` calls, and the last result."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


class Producer:
    """Stand-in learner: an HF model whose state dict is published (``num_returns=2``)."""

    def __init__(self, model_path: str):
        from modelkit.modelhub import load_causal_lm

        torch.set_num_threads(1)
        self.model = load_causal_lm(model_path)

    def publish(self, impl: str, version: int):
        named = self.model.state_dict()
        if impl == "before":
            return legacy_pack(named, version)
        return pack_weights(named.items(), version, copy=False)  # what LearnerGroup.async_publish asks for


class Consumer:
    """One consumer process: a rollout worker core on vLLM, or an old-logit service (snapshot)."""

    def __init__(self, kind: str, model_path: str):
        torch.set_num_threads(1)
        self.kind = kind
        if kind == "vllm":
            from transformers import AutoTokenizer

            from rollout.agent import TemplateChatFormat
            from rollout.engine import EngineConfig, VllmEngine
            from rollout.worker import RolloutWorkerCore

            cfg = EngineConfig(model_path=model_path, max_model_len=512, kv_cache_gib=1, max_num_seqs=8)
            chat = TemplateChatFormat(AutoTokenizer.from_pretrained(model_path))
            self.core = RolloutWorkerCore(VllmEngine(cfg), chat=chat)
        else:
            from oldlogit_service import OldLogitService

            self.svc = OldLogitService(model_path, route="snapshot", max_staleness=1, initial_version=0)

    def version(self) -> int:
        return self.core.version if self.kind == "vllm" else int(self.svc.latest_version)

    def _apply(self, impl: str, manifest: WeightManifest, named: dict, payload: Any) -> None:
        if self.kind == "vllm":
            self.core.engine.update_weights(named, manifest.version)
        elif impl == "before":  # a plain dict: the service copies what it holds
            self.svc.update_weights(manifest, {s.name: named[s.name] for s in manifest.tensors}, verify=False)
        else:
            self.svc.update_weights(manifest, payload, verify=False)

    def phases(self, impl: str, manifest: WeightManifest, refs: list) -> dict[str, float]:
        """Seconds of each consumer phase for one publication (``refs[0]``: the payload, not yet fetched)."""
        out: dict[str, float] = {}
        t0 = time.perf_counter()
        payload = ray.get(refs[0])
        out["get"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if impl == "before":
            legacy_verify(manifest, payload)
        else:
            verify_weight_payload(manifest, {n: (list(t.shape), raw_bytes(t)) for n, t in payload.items()})
        out["verify"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        bad = legacy_finite(payload) if impl == "before" else nonfinite_names(payload)
        out["finite"] = time.perf_counter() - t0
        assert not bad
        if impl == "after":
            verify_payload(manifest, payload)  # writes this host's record ...
            t0 = time.perf_counter()
            verify_payload(manifest, payload)  # ... which the next consumer on the host finds
            out["verify, 2nd consumer"] = time.perf_counter() - t0
        named = unpack_weights(manifest, payload, verify=False)
        t0 = time.perf_counter()
        self._apply(impl, manifest, named, payload)
        out["apply"] = time.perf_counter() - t0
        return out

    def apply(self, impl: str, manifest: WeightManifest, payload: Any) -> float:
        """One publication through the real path (``payload`` resolved by Ray, as for the job's actors)."""
        if impl == "before":
            self._apply(impl, manifest, legacy_unpack(manifest, payload), payload)
        elif self.kind == "vllm":
            self.core.update_weights(manifest, payload)
        else:
            self.svc.update_weights(manifest, payload)
        return time.perf_counter()


# ---------------------------------------------------------------------------------------------
# one model
# ---------------------------------------------------------------------------------------------


def reference_copy(nbytes: int, repeats: int) -> float:
    """Best seconds of a torch copy of ``nbytes`` into a preallocated (already touched) buffer."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    return best(lambda: dst.copy_(src), repeats)[0]


def checksums(items: list[tuple[str, torch.Tensor]], repeats: int) -> dict[str, float]:
    """Best seconds of the previous and the current digest over the same private copy."""
    private = private_copy(items, torch.float32)
    bufs = [raw_bytes(t) for t in private.values()]
    return {
        "before": best(lambda: legacy_checksum(list(zip(private, bufs, strict=True))), repeats)[0],
        "after": best(lambda: weights_digest(list(private), bufs), repeats)[0],
    }


def bench_model(label: str, model_path: str, repeats: int, versions: int) -> dict[str, Any]:
    from modelkit.modelhub import load_causal_lm

    model = load_causal_lm(model_path)
    named = model.state_dict()
    manifest, _ = pack_weights(named.items(), 0)
    nbytes = manifest.total_bytes
    items = [(n, named[n]) for n in (s.name for s in manifest.tensors)]
    rows: dict[str, dict[str, float]] = {}

    rows["reference"] = {"memcpy": reference_copy(nbytes, repeats)}
    rows["gather"] = {"before": best(model.state_dict, repeats)[0]}
    rows["gather"]["after"] = rows["gather"]["before"]
    rows["copy/cast"] = {
        "before": best(lambda: legacy_copy(items), repeats)[0],
        "after": best(lambda: private_copy(items, torch.float32), repeats)[0],
        "after, learner path": best(lambda: private_copy(items, torch.float32, copy=False), repeats)[0],
    }
    rows["checksum"] = checksums(items, repeats)
    rows["pack total"] = {
        "before": best(lambda: legacy_pack(named, 1), repeats)[0],
        "after": best(lambda: pack_weights(named.items(), 1), repeats)[0],
        "after, learner path": best(lambda: pack_weights(named.items(), 1, copy=False), repeats)[0],
    }

    consumers = {kind: ray.remote(num_cpus=1)(Consumer).remote(kind, model_path) for kind in ("vllm", "oldlogit")}
    version = ray.get(consumers["vllm"].version.remote())
    per_consumer: dict[str, dict[str, dict[str, list[float]]]] = {}
    for impl in ("before", "after"):
        for kind in consumers:
            per_consumer.setdefault(kind, {}).setdefault(impl, {})
        puts = []
        for _ in range(repeats):
            version += 1
            manifest, payload = (
                pack_weights(named.items(), version, copy=False) if impl == "after" else legacy_pack(named, version)
            )
            t0 = time.perf_counter()
            ref = ray.put(payload)
            puts.append(time.perf_counter() - t0)
            for kind, c in consumers.items():  # one consumer at a time: each phase alone on the host
                got = ray.get(c.phases.remote(impl, manifest, [ref]))
                for k, v in got.items():
                    per_consumer[kind][impl].setdefault(k, []).append(v)
            del ref
        rows.setdefault("put", {})[impl] = min(puts)
    for phase in ("get", "verify", "verify, 2nd consumer", "finite", "apply"):
        for kind in consumers:
            name = phase if phase != "apply" else f"apply ({'vLLM' if kind == 'vllm' else 'old-logit service'})"
            if phase != "apply" and kind != "vllm":
                continue  # the same work in both consumers: shown once
            for impl in ("before", "after"):
                vals = per_consumer[kind][impl].get(phase)
                if vals:
                    rows.setdefault(name, {})[impl] = min(vals)

    producer = ray.remote(num_cpus=1)(Producer).remote(model_path)
    e2e: dict[str, dict[str, Any]] = {}
    for impl in ("before", "after"):
        totals, free, each = [], [], {k: [] for k in consumers}
        for _ in range(versions):
            version += 1
            t0 = time.perf_counter()
            man_ref, pay_ref = producer.publish.options(num_returns=2).remote(impl, version)
            man = ray.get(man_ref)  # the payload is stored when the task has returned
            t_free = time.perf_counter()
            ends = ray.get([c.apply.remote(impl, man, pay_ref) for c in consumers.values()])
            totals.append(max(ends) - t0)
            free.append(t_free - t0)
            for k, end in zip(consumers, ends, strict=True):
                each[k].append(end - t0)
            del pay_ref
        e2e[impl] = {
            "seconds_best": min(totals),
            "seconds_median": statistics.median(totals),
            "gbps_best": nbytes / min(totals) / 1e9,
            "learner_free_s": min(free),
            "applied_by_s": {k: min(v) for k, v in each.items()},
        }
    for a in (*consumers.values(), producer):
        ray.kill(a)
    table = {
        phase: {impl: {"seconds": s, "gbps": nbytes / s / 1e9 if s > 0 else None} for impl, s in r.items()}
        for phase, r in rows.items()
    }
    return {"model": label, "path": model_path, "bytes": nbytes, "phases": table, "end_to_end": e2e}


def print_table(res: dict[str, Any]) -> None:
    print(f"\n{res['model']}: {res['bytes'] / 1e6:.1f} MB fp32 payload")
    print(f"{'phase':34s} {'before s':>9s} {'GB/s':>7s}   {'after s':>9s} {'GB/s':>7s}")
    for phase, r in res["phases"].items():
        if phase == "reference":
            m = r["memcpy"]
            print(f"{'reference: torch memory copy':34s} {'':>9s} {'':>7s}   {m['seconds']:9.4f} {m['gbps']:7.2f}")
            continue
        b, a = r.get("before"), r.get("after")
        fmt = lambda x: f"{x['seconds']:9.4f} {x['gbps'] or 0:7.2f}" if x else f"{'-':>9s} {'-':>7s}"  # noqa: E731
        print(f"{phase:34s} {fmt(b)}   {fmt(a)}")
        if "after, learner path" in r:
            print(f"{phase + ', learner path (copy=False)':34s} {'':>9s} {'':>7s}   {fmt(r['after, learner path'])}")
    for impl, e in res["end_to_end"].items():
        by = ", ".join(f"{k} {s:.3f} s ({res['bytes'] / s / 1e9:.2f} GB/s)" for k, s in e["applied_by_s"].items())
        print(
            f"end to end {impl:6s}: {e['seconds_best']:.3f} s best, {e['seconds_median']:.3f} s median "
            f"({e['gbps_best']:.2f} GB/s); learner free after {e['learner_free_s']:.3f} s; applied by: {by}"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fast", action="store_true", help="the tiny model only")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--versions", type=int, default=3, help="end-to-end publications per path")
    ap.add_argument("--out", default="runs/bench/publish.json")
    a = ap.parse_args(argv)
    from modelkit.modelhub import make_tiny_model, prepare_smollm2
    from trainer.driver.cluster.environment import ENV_VARS, defaults_env

    defaults_env()
    real = prepare_smollm2(log=lambda *x, **k: None)
    models = [("tiny", str(make_tiny_model(seed=0, tokenizer_from=real)))]
    if not a.fast:
        models.append(("SmolLM2-135M", str(real)))
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        _temp_dir=tempfile.mkdtemp(prefix="vintage-ray-"),
        object_store_memory=4 * 10**9,
        runtime_env={"env_vars": {k: os.environ[k] for k in ENV_VARS if k in os.environ}},
        log_to_driver=False,
    )
    try:
        results = [bench_model(label, path, a.repeats, a.versions) for label, path in models]
    finally:
        ray.shutdown()
    for r in results:
        print_table(r)
    out = {"torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(), "models": results}
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
