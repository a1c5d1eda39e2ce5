"""LoRA vs full weights: memory of exact old logits, publication cost, old-logit seconds per step.

One run on SmolLM2-135M-Instruct (fp32, CPU), a rank-r adapter (default 8, alpha 16) on every
attention and MLP projection, side by side for every staleness window W:

* memory held for old logits: full-weight snapshots (``OldLogitService``, W+1 full copies) vs
  adapter snapshots (the same service with ``adapter=``: one base + W+1 adapters) vs the PPO-EWMA
  proxy (``trainer.algorithm.ewma.EwmaProximal``: the full-weight average, or the adapter-only average);
  every number is ``bytes_held`` / ``nbytes`` of the real objects after W+1 publications;
* publication, full vs adapter: bytes, and wall seconds of the learner's pack (cast + private copy
  + blake2b checksum, ``pack_weights`` / ``pack_adapter``), the transfer (pickle round trip of the
  payload: what Ray's object store does with it) and the consumer's verification
  (``unpack_weights``); the worker side is reported apart: the adapter merge into the kept base
  (``merged_weights``) and the in-place apply (``load_state_dict`` into an HF model, the same
  full copy on both paths);
* extra old-logit seconds per training step: the service takes one publication (``update_weights``)
  and scores a fixed batch of B partial rollouts whose tokens span versions [V - W, V] (one forward
  per version) - full snapshots vs adapter snapshots (peft forward: base + adapter).

Goals checked and printed: adapter-snapshot memory at W=4 <= 1.1x PPO-EWMA's (full-weight EWMA,
the paper's proxy), and adapter publication >= 10x faster than full.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_lora [--windows 1 2 4 8] [--rank 8]

Writes ``runs/bench/lora.json`` (``--out``) and prints a table. Seconds are medians of wall seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.machine import machine_facts  # noqa: E402
from modelkit.lora import adapter_state, merged_weights, pack_adapter, wrap_lora  # noqa: E402
from modelkit.modelhub import load_causal_lm, make_tiny_model, prepare_smollm2  # noqa: E402
from modelkit.weights import pack_weights, unpack_weights  # noqa: E402
from oldlogit_service import OldLogitService  # noqa: E402
from protocol import AdapterSpec, OldLogitItem, OldLogitRequest  # noqa: E402
from trainer.algorithm.ewma import EwmaProximal  # noqa: E402
from trainer.learner.lora_config import DEFAULT_TARGET_MODULES  # noqa: E402

TEMPERATURE = 1.0
GOALS = {"adapter_snapshot_vs_ewma_at_W4_max": 1.1, "publication_speedup_min": 10.0}


def _median_seconds(fn, reps: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def make_batch(vocab: int, batch: int, prompt: int, gen: int, V: int, W: int, seed: int) -> list[OldLogitItem]:
    """B partial rollouts consumed at version V: sequence i started at version V - floor(i W / (B-1))
    (so the starts cover [V - W, V] and every version of the window is present for any B >= 2) and
    its generated tokens are split evenly over the versions from its start to V."""
    rng = np.random.RandomState(seed)
    items = []
    for i in range(batch):
        span = np.arange(max(0, V - (i * W) // max(batch - 1, 1)), V + 1)
        vers = span[np.minimum((np.arange(gen) * len(span)) // gen, len(span) - 1)]
        items.append(
            OldLogitItem(
                trajectory_id=f"s{i}",
                token_ids=rng.randint(0, vocab, prompt + gen),
                loss_mask=[0] * prompt + [1] * gen,
                versions=np.concatenate([np.full(prompt, -1), vers]),
            )
        )
    return items


def publication(kind: str, pack, base: dict[str, torch.Tensor] | None, spec: AdapterSpec, reps: int) -> dict:
    """Bytes and seconds of one publication: pack, transfer (pickle round trip), verify; worker merge + apply."""
    pack_s, (manifest, payload) = _median_seconds(pack, reps)
    blob = pickle.dumps(payload, protocol=5)
    transfer_s, received = _median_seconds(lambda: pickle.loads(pickle.dumps(payload, protocol=5)), reps)
    verify_s, named = _median_seconds(lambda: unpack_weights(manifest, received), reps)
    merge_s = 0.0
    if manifest.adapter is not None:
        merge_s, named = _median_seconds(lambda: merged_weights(base, named, spec), reps)
    return {
        "kind": kind,
        "bytes": manifest.total_bytes,
        "pickled_bytes": len(blob),
        "tensors": len(manifest.tensors),
        "pack_s": pack_s,
        "transfer_s": transfer_s,
        "verify_s": verify_s,
        "publication_s": pack_s + transfer_s + verify_s,
        "worker_merge_s": merge_s,
        "named": named,
    }


def route_cost(
    path: Path, spec: AdapterSpec | None, publish, W: int, steps: int, batch: int, prompt: int, gen: int, vocab: int
) -> dict:
    """Bytes held after W+1 publications and per-step (update + score) seconds of one snapshot store."""
    svc = OldLogitService(path, route="snapshot", max_staleness=W, adapter=spec)
    for v in range(1, W + 2):
        svc.update_weights(*publish(v))
    held = svc.bytes_held
    versions = list(svc.versions_held)
    upd, score, exact = [], [], []
    for k in range(steps):
        V = W + 2 + k
        pub = publish(V)  # the learner's pack is not the service's cost (it is in the publication table)
        request = OldLogitRequest(
            request_id=f"s{V}", temperature=TEMPERATURE, items=make_batch(vocab, batch, prompt, gen, V, W, seed=V)
        )
        t0 = time.perf_counter()
        svc.update_weights(*pub)
        t1 = time.perf_counter()
        ans = svc.score(request)
        t2 = time.perf_counter()
        upd.append(t1 - t0)
        score.append(t2 - t1)
        exact.append(ans.exact_token_fraction())
    out = {
        "bytes_held": held,
        "versions_held": versions,
        "base_bytes": svc.stats()["base_bytes"],
        "update_s": float(np.median(upd)),
        "score_s": float(np.median(score)),
        "old_logit_s_per_step": float(np.median(np.add(upd, score))),
        "exact_token_fraction": float(np.mean(exact)),
        "forwards_per_step": svc.forwards / steps,
    }
    del svc
    return out


def bench(
    path: Path, windows: list[int], rank: int, alpha: float, steps: int, batch: int, prompt: int, gen: int, reps: int
) -> dict:
    torch.manual_seed(0)
    model = load_causal_lm(path)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    full_state = model.state_dict()
    base = {k: v for k, v in full_state.items()}
    spec = AdapterSpec(rank=rank, alpha=alpha, target_modules=list(DEFAULT_TARGET_MODULES))
    peft_model = wrap_lora(load_causal_lm(path), spec)
    with torch.no_grad():  # a trained-looking adapter: B away from its zero init
        for name, p in adapter_state(peft_model).items():
            if "lora_B" in name:
                p.normal_(0.0, 0.01)
    adapter = {k: v.detach() for k, v in adapter_state(peft_model).items()}

    def pub_full(v: int):
        return pack_weights(full_state.items(), v)

    def pub_adapter(v: int):
        return pack_adapter(adapter.items(), v, spec)

    pubs = {
        "full": publication("full", lambda: pub_full(1), base, spec, reps),
        "adapter": publication("adapter", lambda: pub_adapter(1), base, spec, reps),
    }
    apply_model = load_causal_lm(path)
    for p in pubs.values():  # the in-place apply a worker does on both paths (a full copy)
        named = p.pop("named")
        p["worker_apply_s"], _ = _median_seconds(
            lambda named=named, m=apply_model: m.load_state_dict(named, strict=False), reps
        )
        p["to_worker_s"] = p["publication_s"] + p["worker_merge_s"] + p["worker_apply_s"]
    apply_model = None
    ewma = {
        "full": EwmaProximal(model).nbytes,
        "adapter": EwmaProximal(peft_model, trainable_only=True).nbytes,
    }
    rows = []
    for W in windows:
        full = route_cost(path, None, pub_full, W, steps, batch, prompt, gen, vocab)
        lora = route_cost(path, spec, pub_adapter, W, steps, batch, prompt, gen, vocab)
        rows.append(
            {
                "W": W,
                "full_snapshot_bytes": full["bytes_held"],
                "adapter_snapshot_bytes": lora["bytes_held"],
                "ewma_full_bytes": ewma["full"],
                "ewma_adapter_bytes": ewma["adapter"],
                "adapter_snapshot_vs_ewma_full": lora["bytes_held"] / ewma["full"],
                "full_snapshot_vs_ewma_full": full["bytes_held"] / ewma["full"],
                "full": full,
                "adapter": lora,
                "extra_old_logit_s_adapter_minus_full": lora["old_logit_s_per_step"] - full["old_logit_s_per_step"],
            }
        )
        print(
            f"  W={W}: full {full['bytes_held'] / 2**20:.0f} MiB, adapter {lora['bytes_held'] / 2**20:.0f} MiB",
            flush=True,
        )
    params = sum(p.numel() for p in model.parameters())
    return {
        "model": "SmolLM2-135M-Instruct" if "SmolLM2" in str(path) else path.name,
        "params": params,
        "rank": rank,
        "alpha": alpha,
        "target_modules": list(DEFAULT_TARGET_MODULES),
        "adapter_params": sum(t.numel() for t in adapter.values()),
        "publication": pubs,
        "publication_speedup": pubs["full"]["publication_s"] / pubs["adapter"]["publication_s"],
        "to_worker_speedup": pubs["full"]["to_worker_s"] / pubs["adapter"]["to_worker_s"],
        "ewma_bytes": ewma,
        "windows": rows,
        "batch": {"sequences": batch, "prompt": prompt, "gen": gen, "steps": steps},
    }


def goals(res: dict) -> dict:
    at4 = next((r for r in res["windows"] if r["W"] == 4), None)
    ratio = at4["adapter_snapshot_vs_ewma_full"] if at4 else None
    return {
        "adapter_snapshot_vs_ewma_at_W4": ratio,
        "adapter_snapshot_vs_ewma_at_W4_ok": ratio is not None and ratio <= GOALS["adapter_snapshot_vs_ewma_at_W4_max"],
        "publication_speedup": res["publication_speedup"],
        "publication_speedup_ok": res["publication_speedup"] >= GOALS["publication_speedup_min"],
    }


def print_table(res: dict, g: dict) -> None:
    mib = 2**20
    print(
        f"\nLoRA vs full weights on {res['model']} ({res['params'] / 1e6:.1f}M params, fp32), rank {res['rank']} "
        f"alpha {res['alpha']:g} on {', '.join(res['target_modules'])} ({res['adapter_params'] / 1e6:.2f}M adapter params)"
    )
    print("memory held for old logits, MiB (x = vs PPO-EWMA of the full weights)")
    print(
        f"{'W':>3} {'full snapshots':>16} {'adapter snapshots':>19} {'EWMA full':>10} {'EWMA adapter':>13}   old-logit s/step full  adapter"
    )
    for r in res["windows"]:
        print(
            f"{r['W']:>3} {r['full_snapshot_bytes'] / mib:9.1f} ({r['full_snapshot_vs_ewma_full']:4.2f}x) "
            f"{r['adapter_snapshot_bytes'] / mib:11.1f} ({r['adapter_snapshot_vs_ewma_full']:4.2f}x) "
            f"{r['ewma_full_bytes'] / mib:10.1f} {r['ewma_adapter_bytes'] / mib:13.2f}   "
            f"{r['full']['old_logit_s_per_step']:20.3f} {r['adapter']['old_logit_s_per_step']:8.3f}"
        )
    print("publication (learner pack + transfer + consumer verify; worker merge and apply apart), seconds")
    print(
        f"{'':8} {'bytes':>12} {'pack':>7} {'xfer':>7} {'verify':>7} {'total':>7} {'merge':>7} {'apply':>7} {'to worker':>9}"
    )
    for k, p in res["publication"].items():
        print(
            f"{k:8} {p['bytes']:12,d} {p['pack_s']:7.3f} {p['transfer_s']:7.3f} {p['verify_s']:7.3f} {p['publication_s']:7.3f} "
            f"{p['worker_merge_s']:7.3f} {p['worker_apply_s']:7.3f} {p['to_worker_s']:9.3f}"
        )
    print(
        f"publication speedup {res['publication_speedup']:.1f}x (goal >= {GOALS['publication_speedup_min']:g}x: "
        f"{'met' if g['publication_speedup_ok'] else 'NOT met'}); to a worker incl. merge + apply {res['to_worker_speedup']:.1f}x"
    )
    if g["adapter_snapshot_vs_ewma_at_W4"] is not None:
        print(
            f"adapter snapshots at W=4: {g['adapter_snapshot_vs_ewma_at_W4']:.3f}x PPO-EWMA's memory "
            f"(goal <= {GOALS['adapter_snapshot_vs_ewma_at_W4_max']:g}x: {'met' if g['adapter_snapshot_vs_ewma_at_W4_ok'] else 'NOT met'})\n"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model", choices=["smollm2", "tiny"], default="smollm2", help="tiny: a quick check of the bench itself"
    )
    ap.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--steps", type=int, default=3, help="measured steps per window and route")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each publication measurement")
    ap.add_argument("--batch", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--gen", type=int, default=40)
    ap.add_argument("--out", type=Path, default=Path("runs/bench/lora.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    t0 = time.perf_counter()
    path = prepare_smollm2() if args.model == "smollm2" else make_tiny_model(0, tokenizer_from=prepare_smollm2())
    res = bench(path, args.windows, args.rank, args.alpha, args.steps, args.batch, args.prompt, args.gen, args.reps)
    g = goals(res)
    print_table(res, g)
    out = {
        "bench": "lora",
        "goals": {**GOALS, **g},
        "result": res,
        "env": machine_facts(t0),
        "notes": "bytes = bytes_held of the real OldLogitService / EwmaProximal after W+1 publications (tied tensors once); "
        "seconds = medians of wall seconds; transfer = pickle round trip of the payload; old-logit s/step = "
        "update_weights of one publication + scoring a batch whose tokens span versions [V-W, V]",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
