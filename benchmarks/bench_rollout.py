"""Rollout throughput and weight-update latency, side by side in one run.

    python -m benchmarks.bench_rollout [--model PATH] [--prompts 32] [--max-tokens 64]

1. Tokens/s of bare ``vllm.LLM.generate`` and of :class:`rollout.worker.RolloutWorkerCore` (its
   background thread, submit/poll, per-token versions and log-probs) on the same prompts, same
   engine settings (fp32, in-process, logprobs of the sampled token, no detokenisation).
2. Weight-update latency vs model bytes: ``update_weights`` on an idle worker (verify checksum +
   apply + prefix-cache reset) and in the middle of generation (interrupt + apply + resume), for
   the tiny model and the given model.

Prints a table and writes ``runs/bench/rollout.json``.

    python -m benchmarks.bench_rollout --compare-keep [--update-every 1.0] --out results/keep_requests.json

3. Only this, with ``--compare-keep``: generation of ``--prompts`` samples in groups of
   ``--group-size`` sharing a prompt, under a weight update every ``--update-every`` seconds (the
   same weights under a new version each time, so both modes sample from the same distribution),
   with the interrupted requests resumed from their prefix (the default, vLLM's prefix caching on)
   and kept in the engine (``keep_requests_on_update``, prefix caching off), one engine after the
   other: tokens/s of each, the tokens prefilled again, the updates applied and the seconds per
   update.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from modelkit.weights import pack_weights  # noqa: E402
from protocol import RolloutRequest, SamplingParams  # noqa: E402
from rollout.engine import EngineConfig, VllmEngine  # noqa: E402
from rollout.worker import RolloutWorkerCore  # noqa: E402

TEXTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
    "In 1492, Columbus",
    "The best way to learn",
    "Photosynthesis is the process",
    "My favourite recipe",
    "Dear diary, today",
]


def prompts(tok, n: int) -> list[list[int]]:
    return [tok.encode(f"{TEXTS[i % len(TEXTS)]} ({i})", add_special_tokens=False) for i in range(n)]


def bench_bare(cfg: EngineConfig, ids: list[list[int]], max_tokens: int) -> dict:
    from vllm import LLM
    from vllm import SamplingParams as VSP
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)
    llm = LLM(
        model=cfg.model_path,
        dtype=cfg.dtype,
        distributed_executor_backend="uni",
        enforce_eager=True,
        max_model_len=cfg.max_model_len,
        logprobs_mode="processed_logprobs",
        max_num_seqs=cfg.max_num_seqs,
        seed=0,
        disable_log_stats=True,
    )
    sp = VSP(temperature=1.0, max_tokens=max_tokens, logprobs=0, detokenize=False)
    llm.generate([{"prompt_token_ids": p} for p in ids[:2]], sp, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm, outs
    cleanup_dist_env_and_memory()
    return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt}


def _requests(ids, max_tokens, tag, n=1):
    """One request per prompt of ``ids``, ``n`` samples each (a group sharing the prompt)."""
    return [
        RolloutRequest(
            request_id=f"{tag}{i}",
            group_id=f"{tag}{i}",
            prompt_ids=p,
            sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, n=n),
        )
        for i, p in enumerate(ids)
    ]


def _drain(core, k, timeout=3600):
    got, end = [], time.time() + timeout
    while len(got) < k and time.time() < end:
        got += core.poll()
        time.sleep(0.002)
    return got


def bench_worker(core: RolloutWorkerCore, ids, max_tokens: int) -> dict:
    core.start()
    core.submit(_requests(ids[:2], max_tokens, "warm"))
    _drain(core, 2)
    t0 = time.perf_counter()
    core.submit(_requests(ids, max_tokens, "w"))
    got = _drain(core, len(ids))
    dt = time.perf_counter() - t0
    n = sum(t.num_generated for t in got)
    return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt}


def bench_update(core: RolloutWorkerCore, ids, max_tokens: int, repeats: int = 3) -> dict:
    from modelkit.modelhub import load_causal_lm

    hf = load_causal_lm(core.engine.config.model_path)
    named = list(hf.state_dict().items())
    idle, busy = [], []
    for _ in range(repeats):
        manifest, payload = pack_weights(named, version=core.version + 1)
        t0 = time.perf_counter()
        core.update_weights(manifest, payload)
        idle.append(time.perf_counter() - t0)
    core.submit(_requests(ids, max_tokens, f"u{core.version}-"))
    for _ in range(repeats):
        time.sleep(0.5)  # let generation run
        manifest, payload = pack_weights(named, version=core.version + 1)
        t0 = time.perf_counter()
        core.update_weights(manifest, payload)
        busy.append(time.perf_counter() - t0)
    _drain(core, len(ids))
    return {
        "model_bytes": manifest.total_bytes,
        "idle_update_s": min(idle),
        "mid_generation_update_s": min(busy),
        "apply_only_s": core.last_update_seconds,
    }


def bench_keep(cfg: EngineConfig, ids, max_tokens: int, every_s: float, n: int) -> dict:
    """Section 3 for one engine setting (``cfg.keep_requests_on_update``): the worker's background
    thread generates ``n`` samples of each prompt of ``ids`` (``max_tokens`` each) while this thread
    applies a weight update every ``every_s`` seconds until all are finished; seconds are wall time
    from the submission."""
    from modelkit.modelhub import load_causal_lm

    named = list(load_causal_lm(cfg.model_path).state_dict().items())
    core = RolloutWorkerCore(VllmEngine(cfg), max_num_seqs=cfg.max_num_seqs)
    core.start()
    core.submit(_requests(ids[:2], max_tokens, "warm"))
    _drain(core, 2)
    t0 = time.perf_counter()
    want = core.submit(_requests(ids, max_tokens, "k", n))
    got, updates, update_s = [], 0, []
    while len(got) < want:
        end = time.perf_counter() + every_s
        while len(got) < want and time.perf_counter() < end:
            got += core.poll()
            time.sleep(0.002)
        if len(got) < want:
            u0 = time.perf_counter()
            core.update_weights(*pack_weights(named, version=core.version + 1))
            update_s.append(time.perf_counter() - u0)
            updates += 1
    seconds = time.perf_counter() - t0
    n = sum(t.num_generated for t in got)
    out = {
        "keep_requests_on_update": cfg.keep_requests_on_update,
        "prompts": len(ids),
        "group_size": n,
        "tokens": n,
        "seconds": seconds,
        "tokens_per_s": n / seconds,
        "updates": updates,
        "update_s_median": sorted(update_s)[len(update_s) // 2] if update_s else None,
        "resumed_prefill_tokens": core.status().resumed_prefill_tokens,
        "resumes": sum(t.info.get("resumes", 0) for t in got),
    }
    core.close()
    return out


def compare_keep(a: argparse.Namespace, real: Path, ids) -> dict:
    """Section 3: both settings on the same prompts, one after the other; prints a table."""
    groups = max(1, a.prompts // a.group_size)
    cfg = EngineConfig(model_path=str(real), max_model_len=1024, kv_cache_gib=1, max_num_seqs=max(a.prompts, 8))
    rows = [
        bench_keep(cfg.model_copy(update={"keep_requests_on_update": k}), ids[:groups], a.max_tokens, a.update_every, a.group_size)
        for k in (False, True)
    ]  # fmt: skip
    print(
        f"{'requests':10s} {'tok/s':>8s} {'tokens':>7s} {'s':>7s} {'updates':>8s} {'update s':>9s} {'prefilled again':>16s}"
    )
    for r in rows:
        name = "kept" if r["keep_requests_on_update"] else "resumed"
        print(
            f"{name:10s} {r['tokens_per_s']:8.1f} {r['tokens']:7d} {r['seconds']:7.1f} {r['updates']:8d} "
            f"{r['update_s_median'] or 0:9.3f} {r['resumed_prefill_tokens']:16d}"
        )
    return {
        "update_every_s": a.update_every,
        "rows": rows,
        "kept_over_resumed": rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="runs/bench/rollout.json")
    ap.add_argument("--compare-keep", action="store_true", help="only section 3: resumed vs kept requests")
    ap.add_argument("--update-every", type=float, default=1.0, help="section 3: seconds between weight updates")
    ap.add_argument("--group-size", type=int, default=8, help="section 3: samples per prompt (--prompts in all)")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from modelkit.modelhub import make_tiny_model, prepare_smollm2

    real = Path(a.model) if a.model else prepare_smollm2()
    tiny = make_tiny_model(seed=0, tokenizer_from=real)
    ids = prompts(AutoTokenizer.from_pretrained(real), a.prompts)
    result: dict = {
        "model": str(real),
        "prompts": a.prompts,
        "max_tokens": a.max_tokens,
        "torch_threads": torch.get_num_threads(),
    }
    if a.compare_keep:
        result["keep"] = compare_keep(a, real, ids)
        return _write(result, Path(a.out))
    cfg = EngineConfig(model_path=str(real), max_model_len=1024, kv_cache_gib=1, max_num_seqs=max(a.prompts, 8))

    result["bare_vllm"] = bench_bare(cfg, ids, a.max_tokens)
    eng = VllmEngine(cfg)
    result["engine_start_s"] = eng.start_seconds
    core = RolloutWorkerCore(eng, max_num_seqs=cfg.max_num_seqs)
    result["rollout_worker"] = bench_worker(core, ids, a.max_tokens)
    result["throughput_ratio"] = result["rollout_worker"]["tokens_per_s"] / result["bare_vllm"]["tokens_per_s"]
    updates = [bench_update(core, ids, a.max_tokens)]
    core.close()
    tcore = RolloutWorkerCore(
        VllmEngine(cfg.model_copy(update={"model_path": str(tiny)})), max_num_seqs=cfg.max_num_seqs
    )
    tcore.start()
    updates.insert(0, bench_update(tcore, ids, a.max_tokens))
    tcore.close()
    result["weight_update"] = updates

    print(f"engine start            {result['engine_start_s']:.1f} s")
    for k in ("bare_vllm", "rollout_worker"):
        r = result[k]
        print(f"{k:22s}  {r['tokens_per_s']:8.1f} tok/s  ({r['tokens']} tokens in {r['seconds']:.1f} s)")
    print(f"throughput ratio        {result['throughput_ratio']:.3f}  (worker / bare vLLM)")
    for u in updates:
        print(
            f"update {u['model_bytes'] / 2**20:8.1f} MiB   idle {u['idle_update_s'] * 1e3:7.1f} ms   "
            f"mid-generation {u['mid_generation_update_s'] * 1e3:7.1f} ms"
        )
    _write(result, Path(a.out))


def _write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
