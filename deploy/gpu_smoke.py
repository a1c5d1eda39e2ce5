"""GPU smoke checks: vLLM on CUDA, DeepSpeed on GPU, and a few vintage steps on SmolLM2.

Run by ``deploy/gpu_smoke.sh`` after ``make install ENGINE=gpu`` and ``vintage model prepare``::

    python -m deploy.gpu_smoke all --out runs/gpu_smoke.json

Each check runs in its own child process (``python -m deploy.gpu_smoke <check> --out part.json``)
so the GPU memory one check holds is released before the next starts, and a crash in one is
recorded without hiding the others. The result is one JSON file: per check ``ok``, the numbers
(tokens/s, step times), and the error text when it failed. Exit status 0 iff every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECKS = ("env", "vllm", "deepspeed0", "deepspeed3", "publish", "run")


def _model_path() -> Path:
    from modelkit.modelhub import prepare_smollm2

    return prepare_smollm2(log=lambda *a, **k: None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_env(_: argparse.Namespace) -> dict:
    """Versions and the devices torch sees; fails when CUDA is not available."""
    import torch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device_count": torch.cuda.device_count(),
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    for mod in ("vllm", "deepspeed", "ray", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # recorded, not fatal here: the check that needs it fails
            out[mod] = f"import failed: {e}"
    if shutil.which("nvidia-smi"):
        out["nvidia_smi"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()
    if not out["cuda_available"]:
        raise RuntimeError(f"torch {torch.__version__} sees no CUDA device (install with `make install ENGINE=gpu`)")
    return out


def check_vllm(a: argparse.Namespace) -> dict:
    """vLLM on CUDA in bfloat16: generate with per-token log-probs, measure decode throughput."""
    import math

    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        raise RuntimeError(f"vLLM platform is {current_platform.device_type!r}, not cuda")
    t0 = time.perf_counter()
    llm = LLM(
        model=str(_model_path()),
        dtype="bfloat16",
        gpu_memory_utilization=a.gpu_memory_utilization,
        max_model_len=1024,
        enforce_eager=True,
        seed=0,
    )
    load_s = time.perf_counter() - t0
    prompts = [f"Calculate {i % 10} + {(3 * i) % 10}. Answer:" for i in range(a.num_prompts)]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=a.max_tokens, logprobs=0)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)  # returns when every sequence is done
    gen_s = time.perf_counter() - t0
    tokens, lps = 0, []
    for o in outs:
        c = o.outputs[0]
        tokens += len(c.token_ids)
        lps += [c.logprobs[i][tid].logprob for i, tid in enumerate(c.token_ids)] if c.logprobs else []
    if len(lps) != tokens or not all(math.isfinite(x) and x <= 0 for x in lps):
        raise RuntimeError(f"vLLM log-probs missing or invalid: {len(lps)} for {tokens} tokens")
    return {
        "device": current_platform.device_name if hasattr(current_platform, "device_name") else "cuda",
        "load_s": round(load_s, 2),
        "prompts": len(prompts),
        "generated_tokens": tokens,
        "generate_s": round(gen_s, 3),
        "tokens_per_s": round(tokens / gen_s, 1),
        "mean_logprob": round(sum(lps) / max(len(lps), 1), 4),
    }


def check_deepspeed(a: argparse.Namespace, stage: int) -> dict:
    """DeepSpeed on one GPU (NCCL, bf16, ZeRO ``stage``): a few optimizer steps on SmolLM2."""
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM

    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
        }
    )
    deepspeed.init_distributed(dist_backend="nccl")
    torch.cuda.set_device(0)
    model = AutoModelForCausalLM.from_pretrained(str(_model_path()), dtype=torch.float32)
    config = {
        "train_micro_batch_size_per_gpu": a.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (a.batch, a.seq_len), generator=g).to(engine.device)
    times, losses = [], []
    for _ in range(a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    if not all(x == x for x in losses):
        raise RuntimeError(f"non-finite loss: {losses}")
    steady = times[1:] or times
    step_s = sum(steady) / len(steady)
    return {
        "zero_stage": stage,
        "device": str(engine.device),
        "batch": a.batch,
        "seq_len": a.seq_len,
        "step_s": [round(t, 4) for t in times],
        "mean_step_s_after_first": round(step_s, 4),
        "train_tokens_per_s": round(a.batch * a.seq_len / step_s, 1),
        "loss_first_last": [round(losses[0], 4), round(losses[-1], 4)],
        "max_memory_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }


def check_publish(a: argparse.Namespace) -> dict:
    """Weight publication on the GPU: SmolLM2 packed in bf16 for CUDA IPC and for the host (seconds,
    GB/s), then the GPU tests of ``tests/integration/test_publish.py`` (IPC into another process,
    vLLM's in-place load on CUDA)."""
    import torch

    from modelkit.modelhub import load_causal_lm
    from modelkit.weights import pack_weights

    named = load_causal_lm(_model_path()).cuda().state_dict()
    out: dict = {}
    for transport in ("cuda_ipc", "host"):
        pack_weights(named.items(), 0, "bfloat16", transport=transport)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        manifest, _ = pack_weights(named.items(), 1, "bfloat16", transport=transport)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        out[f"pack_{transport}_s"] = round(dt, 4)
        out[f"pack_{transport}_gbps"] = round(manifest.total_bytes / dt / 1e9, 2)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "tests/integration/test_publish.py", "-k", "cuda"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=a.run_timeout_s)
    out["tests"] = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode != 0 or "skipped" in out["tests"]:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}; tail:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return out


def check_run(a: argparse.Namespace) -> dict:
    """``vintage run <config>`` end to end; numbers from its metrics.jsonl."""
    run_dir = Path(a.run_dir).resolve()
    if run_dir.exists():
        shutil.rmtree(run_dir)
    vintage = shutil.which("vintage", path=str(Path(sys.executable).parent)) or "vintage"
    cmd = [vintage, "run", str(a.config), "--set", f'logging.run_dir="{run_dir}"']
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, timeout=a.run_timeout_s, capture_output=True, text=True)
    wall_s = time.perf_counter() - t0
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "vintage-run.log").write_text(proc.stdout + proc.stderr)
    out: dict = {
        "cmd": " ".join(cmd),
        "returncode": proc.returncode,
        "wall_s": round(wall_s, 1),
        "run_dir": str(run_dir),
    }
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    rows = [r for r in rows if "step" in r and r.get("kind", "step") == "step"]  # not the evaluations' records
    out["steps_logged"] = len(rows)
    if rows:
        times = [r["time"] for r in rows if "time" in r]
        out["step_wall_s"] = [round(b - a_, 2) for a_, b in zip(times, times[1:], strict=False)]
        last = rows[-1]
        out["last_step"] = {k: v for k, v in last.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for key in ("tokens_per_s", "train_s", "generate_s", "oldlogit_s", "step_s"):
            vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
            if vals:
                out[f"mean_{key}"] = round(sum(vals) / len(vals), 3)
    summary = run_dir / "summary.json"
    if summary.exists():
        out["summary"] = json.loads(summary.read_text())
    if proc.returncode != 0:
        raise RuntimeError(
            f"vintage run exited {proc.returncode}; tail:\n{(proc.stdout + proc.stderr)[-3000:]}\n{json.dumps(out)}"
        )
    if len(rows) < 1:
        raise RuntimeError(f"no step metrics in {metrics}")
    return out


def run_one(a: argparse.Namespace) -> int:
    fn = {
        "env": check_env,
        "vllm": check_vllm,
        "deepspeed0": lambda x: check_deepspeed(x, 0),
        "deepspeed3": lambda x: check_deepspeed(x, 3),
        "publish": check_publish,
        "run": check_run,
    }[a.check]
    t0 = time.perf_counter()
    try:
        res = {"ok": True, **fn(a)}
    except Exception as e:
        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    res["check_s"] = round(time.perf_counter() - t0, 1)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0 if res["ok"] else 1


def run_all(a: argparse.Namespace) -> int:
    out = Path(a.out).resolve()
    parts = out.parent / (out.stem + ".parts")
    parts.mkdir(parents=True, exist_ok=True)
    result: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": str(a.config)}
    passthrough = ["--config", str(a.config), "--run-dir", a.run_dir, "--run-timeout-s", str(a.run_timeout_s)]
    for check in CHECKS:
        part = parts / f"{check}.json"
        part.unlink(missing_ok=True)
        print(f"[gpu_smoke] {check} ...", flush=True)
        cmd = [sys.executable, "-m", "deploy.gpu_smoke", check, "--out", str(part), *passthrough]
        try:
            subprocess.run(cmd, cwd=REPO, timeout=a.run_timeout_s + 300)
        except subprocess.TimeoutExpired:
            pass
        res = (
            json.loads(part.read_text())
            if part.exists()
            else {"ok": False, "error": "no result (crashed or timed out)"}
        )
        result[check] = res
        status = "ok" if res.get("ok") else f"FAILED: {res.get('error', '')[:300]}"
        print(f"[gpu_smoke] {check}: {status}", flush=True)
        if check == "env" and not res.get("ok"):
            break  # no GPU: nothing else can pass
    result["ok"] = all(result.get(c, {}).get("ok") for c in CHECKS)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(_headline(result), indent=1))
    print(f"[gpu_smoke] full result: {out}")
    return 0 if result["ok"] else 1


def _headline(r: dict) -> dict:
    """The numbers worth reading at a glance."""
    g = lambda c, k: r.get(c, {}).get(k)  # noqa: E731
    return {
        "ok": r["ok"],
        "devices": g("env", "devices"),
        "vllm_tokens_per_s": g("vllm", "tokens_per_s"),
        "deepspeed_zero0_step_s": g("deepspeed0", "mean_step_s_after_first"),
        "deepspeed_zero0_train_tokens_per_s": g("deepspeed0", "train_tokens_per_s"),
        "deepspeed_zero3_step_s": g("deepspeed3", "mean_step_s_after_first"),
        "publish_pack_cuda_ipc_gbps": g("publish", "pack_cuda_ipc_gbps"),
        "publish_tests": g("publish", "tests"),
        "vintage_run_wall_s": g("run", "wall_s"),
        "vintage_step_wall_s": g("run", "step_wall_s"),
        "vintage_steps_logged": g("run", "steps_logged"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("check", choices=("all", *CHECKS))
    default_out = (
        Path(os.environ["OUT"]) / "gpu_smoke.json" if os.environ.get("OUT") else REPO / "runs" / "gpu_smoke.json"
    )
    ap.add_argument(
        "--out", default=str(default_out), help="result JSON (default $OUT/gpu_smoke.json or runs/gpu_smoke.json)"
    )
    ap.add_argument("--config", default=str(REPO / "deploy" / "configs" / "gpu-smoke.toml"))
    ap.add_argument("--run-dir", default=str(REPO / "runs" / "gpu-smoke"))
    ap.add_argument("--run-timeout-s", type=float, default=900.0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args(argv)
    return run_all(a) if a.check == "all" else run_one(a)


if __name__ == "__main__":
    sys.exit(main())
