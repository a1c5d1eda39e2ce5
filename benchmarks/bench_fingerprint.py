"""Cost of the served-weights fingerprint on a SmolLM2-135M-sized state (random tensors, same shapes).

    python -m benchmarks.bench_fingerprint [--repeats 5] [--out runs/bench/fingerprint.json]

Measures :func:`modelkit.fingerprint.weights_fingerprint` over the 272 tensors of SmolLM2-135M's
layout (30 layers, hidden 576, MLP 1536, 9 heads of 64 with 3 KV heads, vocabulary 49,152; the
output projection tied, so left out as a publication leaves it out): fp32 values, and fp32 values
rounded to bf16. Prints the median and the range of ``repeats`` runs and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from modelkit.fingerprint import weights_fingerprint


def smollm2_shapes(layers: int = 30, hidden: int = 576, mlp: int = 1536, kv: int = 192, vocab: int = 49152):
    """``{hf_name: shape}`` of SmolLM2-135M's checkpoint (tied ``lm_head`` left out)."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (mlp, hidden),
            p + "mlp.up_proj.weight": (mlp, hidden),
            p + "mlp.down_proj.weight": (hidden, mlp),
        }
    return shapes


def _time(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="runs/bench/fingerprint.json")
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    named = {n: torch.randn(s, generator=g) for n, s in smollm2_shapes().items()}
    params = sum(t.numel() for t in named.values())
    out: dict[str, Any] = {"tensors": len(named), "parameters": params, "repeats": args.repeats}
    for label, dtype in (("float32", None), ("float32_rounded_to_bfloat16", torch.bfloat16)):
        s = _time(lambda d=dtype: weights_fingerprint(named, d), args.repeats)
        out[label] = {"median_s": statistics.median(s), "min_s": min(s), "max_s": max(s)}
        print(
            f"{label}: {len(named)} tensors, {params / 1e6:.1f}M parameters: median {statistics.median(s) * 1e3:.1f} ms"
        )
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
