"""GPU check that fits a borrowed machine: vintage's plain classes on one GPU, in one process.

The borrowed machine has Python, torch, transformers and their dependencies, but no vLLM, Ray,
DeepSpeed or pydantic, no package registry and no model hub. The packages it lacks travel as wheels
in the working tree (``python -m deploy.gpu_wheels`` fills ``deploy/gpu/``); this check installs
them into a temporary folder (``pip install --no-index --no-deps --target``), runs itself again with
that folder on ``PYTHONPATH``, builds the tiny random model from its config and the carried
tokenizer (``modelkit.modelhub.make_tiny_model``), and runs, without Ray, vLLM or HTTP servers:

* ``learner``: :class:`trainer.learner.LearnerCore` (a real DeepSpeed engine, ZeRO 0, torch
  AdamW) on the device, two optimizer steps per batch; losses finite, per-step ratios (the first
  step's recompute ratio is 1 by construction), the weights move by no more than Adam allows;
* ``chunked``: :func:`modelkit.scoring.sequence_logprobs` chunked against the full-logit path,
  forward and backward: largest log-prob difference against a bound, seconds and peak memory;
* ``oldlogit``: :class:`oldlogit_service.OldLogitService` scoring on the device; its log-probs equal
  the learner's at that version within the same bound, and it serves the published fingerprint;
* ``ipc``: a publication (:func:`modelkit.weights.pack_weights`, CUDA IPC on a GPU, shared memory
  on CPU) read by a second process, whose fingerprint of what it reads must equal the manifest's;
* ``loop``: three versions of sample (:class:`rollout.engine.TransformersEngine` on the device,
  :class:`rollout.envs.toy.AlphabetEnv` rewards), train, publish, load; the engine serves each
  published fingerprint and every sampled token carries the version that sampled it.

Run::

    python -m deploy.gpu_check --out result.json [--device cuda|cpu] [--wheels DIR]

A failure in one check is recorded (error text and traceback) and the others still run. The result
is one JSON file: per check ``ok``, ``seconds``, its numbers and ``error``; machine facts. Exit
status 0 iff every check passed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from deploy.gpu_bounds import BF16_REL, adam_step_bound, logprob_tolerance, weight_change_excess
from deploy.gpu_wheels import SITE_ENV, missing_modules, rerun_with_wheels

REPO = Path(__file__).resolve().parents[1]
CHECKS = ("learner", "chunked", "oldlogit", "ipc", "loop")
STEP_KEYS = ("loss", "applied", "grad_norm", "ratio_mean", "ratio_min", "ratio_max", "clip_frac_low")
STEP_KEYS += ("clip_frac_high", "tokens")
"""The per-optimizer-step metrics the ``learner`` check reports (``LearnerCore.last_optimizer_steps``)."""


# -- helpers ----------------------------------------------------------------------------------


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _finite(values: list[float]) -> bool:
    return all(math.isfinite(v) for v in values)


# -- shared parts ---------------------------------------------------------------------------


class Parts:
    """What several checks share: the device, dtype, tiny model folder, and the learner of
    ``learner`` (made again by a later check when that one failed before having it)."""

    def __init__(self, a: argparse.Namespace, model_path: Path) -> None:
        self.device, self.dtype, self.model_path = a.device, a.dtype, model_path
        self.lr = 1e-3
        self._learner = None

    def new_learner(self, **kw: Any) -> Any:
        """A fresh :class:`LearnerCore` on the tiny model (ZeRO 0, torch AdamW, ``self.dtype``)."""
        from trainer.learner import LearnerCore, LearnerSettings, free_port

        base = dict(model_path=str(self.model_path), dtype=self.dtype, lr=self.lr, micro_batch_size=4)
        return LearnerCore(LearnerSettings(**{**base, "master_port": free_port(), **kw}))

    def learner(self) -> Any:
        """The learner of check ``learner`` (version >= 1), or a fresh one trained one step."""
        if self._learner is None or self._learner.version < 1:
            core = self.new_learner()
            core.train_step(synthetic_trajectories(core, n=4, length=24, prompt=8, seed=1))
            self._learner = core
        return self._learner


def synthetic_trajectories(core: Any, n: int, length: int, prompt: int, seed: int) -> list[Any]:
    """``n`` trajectories of random ids (``[length]``, the first ``prompt`` are context) sampled
    "by" the learner's current version: mu is the learner's own log-prob, so the discrepancy ratio
    is 1; rewards 0, 1, 0, 1 ... in groups of two."""
    import numpy as np
    import torch

    from protocol import Trajectory
    from trainer.algorithm.batch import Batch

    rng = np.random.default_rng(seed)
    ids = torch.as_tensor(rng.integers(3, 2000, (n, length)), dtype=torch.long)
    mask = torch.zeros(n, length, dtype=torch.bool)
    mask[:, prompt:] = True
    z = torch.zeros(n, length)
    lp = core.logprobs(Batch(ids, torch.ones_like(ids), mask, z, z, consuming_version=core.version)).numpy()
    out = []
    for i in range(n):
        m = mask[i].numpy().astype(np.int8)
        out.append(Trajectory(
            trajectory_id=f"s{seed}-{i}", group_id=f"g{seed}-{i // 2}", token_ids=ids[i].numpy(), loss_mask=m,
            behav_logprobs=np.where(m == 1, np.minimum(lp[i], 0.0), 0.0).astype(np.float32),
            versions=np.where(m == 1, core.version, -1), policy_version=core.version, prompt_len=prompt,
            finish_reason="length", reward=float(i % 2),
        ))  # fmt: skip
    return out


def _max_abs_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# -- the checks -------------------------------------------------------------------------------


def check_learner(parts: Parts) -> dict:
    """DeepSpeed learner, ZeRO 0, ``ppo_mini_batches = 2``, recompute reference (``decoupled_ppo``)."""
    from trainer.algorithm.loss_config import loss_config

    core = parts.new_learner(ppo_mini_batches=2, loss=loss_config("decoupled_ppo"))
    trajs = synthetic_trajectories(core, n=8, length=64, prompt=16, seed=0)
    before = core.state_dict_full()
    _sync(parts.device)
    t0 = time.perf_counter()
    m = core.train_step(trajs)
    _sync(parts.device)
    step_s = time.perf_counter() - t0
    after = core.state_dict_full()
    steps = [{k: s[k] for k in STEP_KEYS if k in s} for s in core.last_optimizer_steps]
    moved = _max_abs_diff(after, before)
    # Adam's per-step bound, plus a few fp32 roundings (2^-24 each) in computing the update itself
    bound = parts.lr * sum(adam_step_bound(t) for t in range(1, len(steps) + 1)) * (1 + 2.0**-20)
    # each fp32 step rounds the weight (<= 2^-24 relative); bf16 readings are the module's rounded
    # copies of the fp32 master weights (<= 2^-8 relative each, before and after)
    rel = len(steps) * 2.0**-24 + (2 * BF16_REL if parts.dtype == "bfloat16" else 0.0)
    excess = weight_change_excess(before, after, rel)
    out = {
        "engine_device": str(core.engine.device), "dtype": parts.dtype, "zero_stage": core.settings.zero_stage,
        "version": core.version, "optimizer_steps": len(steps), "steps": steps, "step_s": round(step_s, 4),
        "loss": m["loss"], "max_abs_weight_change": moved, "weight_change_less_rounding": excess, "adam_bound": bound,
    }  # fmt: skip
    problems = []
    if core.version != 1 or len(steps) != 2 or not all(s["applied"] == 1.0 for s in steps):
        problems.append(f"expected version 1 after 2 applied steps, got {core.version} after {steps}")
    if not _finite([s["loss"] for s in steps] + [m["loss"]]):
        problems.append(f"non-finite loss: {[s['loss'] for s in steps]}")
    if steps and steps[0].get("ratio_mean") != 1.0:
        problems.append(f"step 1 ratio_mean {steps[0].get('ratio_mean')} != 1 (its own forward is the reference)")
    if not (moved > 0.0 and excess <= bound):
        problems.append(f"weights: max |change| {moved:.4g}, less rounding {excess:.4g}, Adam bound {bound:.4g}")
    if problems:
        raise AssertionError("; ".join(problems) + f" | {json.dumps(out, default=str)}")
    parts._learner = core
    return out


def _fwd_bwd(model: Any, ids: Any, chunk_bytes: int, device: str, reps: int) -> tuple[float, int | None]:
    """Mean seconds of forward + backward of the log-probs' sum and the peak bytes it added (CUDA only)."""
    import torch

    from modelkit.scoring import sequence_logprobs

    mask = torch.ones_like(ids)
    secs = []
    peak = None
    for r in range(reps + 1):  # the first is a warm-up
        model.zero_grad(set_to_none=True)
        _sync(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        sequence_logprobs(model, ids, mask, 1.0, chunk_bytes=chunk_bytes).sum().backward()
        _sync(device)
        if r:
            secs.append(time.perf_counter() - t0)
        if device == "cuda":
            peak = torch.cuda.max_memory_allocated() - base
    model.zero_grad(set_to_none=True)
    return sum(secs) / len(secs), peak


def check_chunked(parts: Parts, batch: int, seq: int, reps: int) -> dict:
    """Chunked against full-logit log-probs on the tiny model in ``parts.dtype``."""
    import torch

    from modelkit.modelhub import load_causal_lm
    from modelkit.scoring import DEFAULT_CHUNK_BYTES, sequence_logprobs

    model = load_causal_lm(parts.model_path, parts.dtype).to(parts.device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, int(model.config.vocab_size), (batch, seq), generator=g).to(parts.device)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        max_logit = float(model(input_ids=ids, attention_mask=mask).logits.float().abs().max())
        full = sequence_logprobs(model, ids, mask, 1.0, chunk_bytes=0)
        chunked = sequence_logprobs(model, ids, mask, 1.0, chunk_bytes=DEFAULT_CHUNK_BYTES)
    diff = float((full - chunked).abs().max())
    tol = logprob_tolerance(parts.dtype, max_logit)
    model.train()
    full_s, full_peak = _fwd_bwd(model, ids, 0, parts.device, reps)
    chunk_s, chunk_peak = _fwd_bwd(model, ids, DEFAULT_CHUNK_BYTES, parts.device, reps)
    mib = lambda b: None if b is None else round(b / 2**20, 1)  # noqa: E731
    out = {
        "batch": batch, "seq": seq, "vocab": int(model.config.vocab_size), "dtype": parts.dtype, "timed_reps": reps,
        "max_abs_diff": diff, "tolerance": tol, "max_abs_logit": max_logit, "finite": bool(torch.isfinite(full).all()),
        "full_fwd_bwd_s": round(full_s, 4), "chunked_fwd_bwd_s": round(chunk_s, 4),
        "full_peak_mib": mib(full_peak), "chunked_peak_mib": mib(chunk_peak),
        "peak_memory": "torch.cuda.max_memory_allocated above the step's start" if parts.device == "cuda"
        else "not measured on CPU (no allocator statistics)",
    }  # fmt: skip
    if not out["finite"] or not diff <= tol:
        raise AssertionError(f"chunked vs full: max |diff| {diff:.3g} > tolerance {tol:.3g} | {json.dumps(out)}")
    return out


def check_oldlogit(parts: Parts) -> dict:
    """The snapshot service on the device, built as a job builds it for a learner of this dtype
    (:meth:`trainer.driver.config.schema.JobConfig.oldlogit_service_options`), scores version-``V``
    tokens as the learner does."""
    import numpy as np

    from oldlogit_service import OldLogitService, items_from_trajectories
    from protocol import OldLogitRequest
    from trainer.algorithm.batch import collate
    from trainer.driver.config.schema import load_config

    core = parts.learner()
    job = load_config(None, ['loss.method="snapshot"', "controller.max_staleness=2", f'learner.dtype="{parts.dtype}"'])
    svc = OldLogitService(parts.model_path, device=parts.device, **job.oldlogit_service_options())
    manifest, payload = core.publish(dtype=parts.dtype)
    svc.update_weights(manifest, payload)
    trajs = synthetic_trajectories(core, n=6, length=48, prompt=12, seed=2)  # every row the same length
    t0 = time.perf_counter()
    ans = svc.score(OldLogitRequest(request_id="gpu-check", temperature=1.0, items=items_from_trajectories(trajs)))
    score_s = time.perf_counter() - t0
    learner_lp = core.logprobs(collate(trajs, core.version)).numpy()
    diffs, exact = [], 0
    for i, t in enumerate(trajs):
        m = t.loss_mask.astype(bool)
        exact += int(np.isfinite(ans.old_logprobs[i][m]).sum())
        diffs.append(float(np.abs(ans.old_logprobs[i][m] - learner_lp[i][: len(m)][m]).max()))
    served = svc.fingerprint()
    max_logit = _max_abs_logit(core, trajs)
    tol = logprob_tolerance(parts.dtype, max_logit)
    sampled = sum(int(t.loss_mask.sum()) for t in trajs)
    out = {
        "version": core.version, "service_device": str(svc.device), "dtype": parts.dtype,
        "tokens": sampled, "exact_tokens": exact, "max_abs_diff": max(diffs), "tolerance": tol,
        "score_s": round(score_s, 4), "bytes_held": svc.bytes_held, "served_fingerprint": served["served"],
        "published_fingerprint": manifest.fingerprint,
    }  # fmt: skip
    if exact != sampled or not max(diffs) <= tol or served["served"] != manifest.fingerprint:
        raise AssertionError(f"old-logit service disagrees with the learner | {json.dumps(out)}")
    return out


def _max_abs_logit(core: Any, trajs: list[Any]) -> float:
    """Largest |logit| of the learner's model over equal-length trajectories (for the tolerance)."""
    import numpy as np
    import torch

    ids = torch.as_tensor(np.stack([t.token_ids for t in trajs]), dtype=torch.long)
    with torch.no_grad():
        logits = core.engine.module(input_ids=ids.to(core.engine.device)).logits
    return float(logits.float().abs().max())


def ipc_child(conn: Any) -> None:
    """Second process of check ``ipc``: receives ``(manifest JSON, payload)`` and returns the
    fingerprint of the tensors it reads (and, for CUDA IPC, the payload's own check)."""
    try:
        from modelkit.fingerprint import weights_fingerprint
        from protocol import WeightManifest

        manifest_json, payload = conn.recv()
        manifest = WeightManifest.model_validate_json(manifest_json)
        if hasattr(payload, "check"):
            payload.check(manifest)  # names, shapes, digest; opens the handle on this process's GPU
        tensors = dict(payload)
        conn.send({"fingerprint": weights_fingerprint(tensors), "device": str(next(iter(tensors.values())).device)})
    except Exception as e:  # reported to the parent, which records it
        conn.send({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]})


def check_ipc(parts: Parts, timeout_s: float = 180.0) -> dict:
    """A publication read by a second process: CUDA IPC on a GPU, CPU shared memory on CPU."""
    import torch
    import torch.multiprocessing as tmp

    from modelkit.modelhub import load_causal_lm
    from modelkit.weights import pack_weights

    named = load_causal_lm(parts.model_path).to(parts.device).state_dict()
    transport = "cuda_ipc" if parts.device == "cuda" else "host"
    t0 = time.perf_counter()
    manifest, payload = pack_weights(named.items(), 1, parts.dtype, transport=transport)
    _sync(parts.device)
    pack_s = time.perf_counter() - t0
    if transport == "host":  # torch's reductions move shared-memory tensors by file descriptor
        payload = {k: v.share_memory_() for k, v in payload.items()}
    ctx = tmp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=ipc_child, args=(there,), daemon=True)
    t0 = time.perf_counter()
    child.start()
    try:
        here.send((manifest.model_dump_json(), payload))
        if not here.poll(timeout_s):
            raise TimeoutError(f"ipc: the child answered nothing within {timeout_s:.0f} s")
        got = here.recv()
    finally:
        child.join(30)
        if child.is_alive():
            child.terminate()
    round_s = time.perf_counter() - t0
    out = {
        "transport": transport, "dtype": parts.dtype, "tensors": len(manifest.tensors), "bytes": manifest.total_bytes,
        "pack_s": round(pack_s, 4), "child_round_trip_s": round(round_s, 2), "parent_fingerprint": manifest.fingerprint,
        "child_fingerprint": got.get("fingerprint"), "child_device": got.get("device"), "child_exitcode": child.exitcode,
    }  # fmt: skip
    del payload
    if parts.device == "cuda":
        torch.cuda.ipc_collect()
    if "error" in got:
        raise RuntimeError(f"ipc child: {got['error']}\n{got.get('traceback', '')}")
    if got["fingerprint"] != manifest.fingerprint:
        raise AssertionError(f"the child read other weights than were published | {json.dumps(out)}")
    return out


def _sample(engine: Any, fmt: Any, env: Any, seeds: range, group: int, max_tokens: int) -> list[Any]:
    """One trajectory per (seed, sample): the engine continues the env's prompt; the env scores it."""
    import numpy as np

    from protocol import Trajectory
    from rollout.engine import EngineRequest

    trajs = []
    for s in seeds:
        messages, _ = env.reset(s)
        prompt = fmt.prompt_ids(messages)
        reqs = [EngineRequest(f"e{s}-{k}", prompt, max_tokens=max_tokens) for k in range(group)]
        for r, (toks, lps, fin) in zip(reqs, engine.generate(reqs).values(), strict=True):
            env.reset(s)
            _, reward, _, _ = env.step(fmt.decode(toks))
            n, p = len(toks), len(prompt)
            trajs.append(Trajectory(
                trajectory_id=f"v{engine.version}-{r.request_id}", group_id=f"v{engine.version}-g{s}",
                token_ids=np.asarray(prompt + toks), loss_mask=np.r_[np.zeros(p), np.ones(n)].astype(np.int8),
                behav_logprobs=np.r_[np.zeros(p), lps].astype(np.float32), versions=np.r_[-np.ones(p), np.full(n, engine.version)].astype(np.int32),
                policy_version=engine.version, prompt_len=p, finish_reason=fin, reward=float(reward),
            ))  # fmt: skip
    return trajs


def check_loop(parts: Parts, versions: int = 3, groups: int = 2, group: int = 4, max_tokens: int = 16) -> dict:
    """Sample, train, publish, load for ``versions`` versions (the product's default loss, ppo_ewma)."""
    from transformers import AutoTokenizer

    from modelkit.weights import unpack_weights
    from rollout.agent import TemplateChatFormat
    from rollout.engine import EngineConfig, TransformersEngine
    from rollout.envs.toy import AlphabetEnv

    core = parts.new_learner(micro_batch_size=8)
    cfg = EngineConfig(kind="transformers", model_path=str(parts.model_path), dtype=parts.dtype, device=parts.device)
    engine = TransformersEngine(cfg)
    fmt, env = TemplateChatFormat(AutoTokenizer.from_pretrained(parts.model_path)), AlphabetEnv()
    transport = "cuda_ipc" if parts.device == "cuda" else "host"
    rows = []
    for v in range(versions):
        t0 = time.perf_counter()
        trajs = _sample(engine, fmt, env, range(v * groups, (v + 1) * groups), group, max_tokens)
        t1 = time.perf_counter()
        m = core.train_step(trajs)
        t2 = time.perf_counter()
        manifest, payload = core.publish(dtype=parts.dtype, transport=transport)
        engine.update_weights(unpack_weights(manifest, payload), manifest.version)
        t3 = time.perf_counter()
        rows.append({
            "sampled_version": v, "token_versions": sorted({int(x) for t in trajs for x in t.versions if x >= 0}),
            "mean_reward": sum(t.reward for t in trajs) / len(trajs), "loss": m["loss"], "learner_version": core.version,
            "engine_version": engine.version, "fingerprint_match": engine.served_fingerprint() == manifest.fingerprint,
            "sample_s": round(t1 - t0, 3), "train_s": round(t2 - t1, 3), "publish_load_s": round(t3 - t2, 3),
            "tokens": int(sum(int(t.loss_mask.sum()) for t in trajs)),
        })  # fmt: skip
        del payload
    engine.close()
    out = {"transport": transport, "versions": versions, "trajectories_per_version": groups * group, "rows": rows}
    out["max_tokens"] = max_tokens
    ok = [
        r["token_versions"] == [i] and r["learner_version"] == r["engine_version"] == i + 1 and r["fingerprint_match"]
        for i, r in enumerate(rows)
    ]
    if not all(ok) or not _finite([r["loss"] for r in rows]):
        raise AssertionError(f"loop: versions, fingerprints or losses wrong | {json.dumps(out)}")
    return out


# -- running ----------------------------------------------------------------------------------


def machine_facts(device: str) -> dict:
    """Versions, where the carried packages were imported from, the device and the host load."""
    import deepspeed
    import pydantic
    import torch
    import transformers

    facts: dict[str, Any] = {
        "python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__, "deepspeed": deepspeed.__version__, "pydantic": pydantic.__version__,
        "deepspeed_from": str(Path(deepspeed.__file__).parent), "carried_site": os.environ.get(SITE_ENV),
        "cuda_available": torch.cuda.is_available(),
    }  # fmt: skip
    if device == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        facts.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), gpu_capability=f"{p.major}.{p.minor}")
    return facts


def _run_check(name: str, fn: Any) -> dict:
    print(f"[gpu_check] {name} ...", flush=True)
    t0 = time.perf_counter()
    try:
        res = {"ok": True, **fn()}
    except Exception as e:  # recorded; the other checks still run
        res = {"ok": False, "error": f"{type(e).__name__}: {e}"[:4000], "traceback": traceback.format_exc()[-4000:]}
    res["seconds"] = round(time.perf_counter() - t0, 2)
    print(
        f"[gpu_check] {name}: {'ok' if res['ok'] else 'FAILED ' + res['error'][:300]} ({res['seconds']} s)", flush=True
    )
    return res


def _model_folder(a: argparse.Namespace, cache: Path) -> Path:
    """The tiny random model built from its config with the carried tokenizer (or this box's SmolLM2)."""
    from modelkit.modelhub import make_tiny_model, prepare_smollm2

    tok = Path(a.tokenizer)
    src = tok if (tok / "tokenizer.json").is_file() else prepare_smollm2(log=lambda *x, **k: None)
    return make_tiny_model(seed=0, cache_dir=cache, tokenizer_from=src)


def run_checks(a: argparse.Namespace) -> int:
    """Every check of ``a.checks`` in this process; writes ``a.out``; 0 iff all passed."""
    os.environ["DS_ACCELERATOR"] = a.device
    for k, v in {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}.items():
        os.environ.setdefault(k, v)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": a.device}
    result["dtype"] = a.dtype
    cache = Path(tempfile.mkdtemp(prefix="vintage-gpu-model-"))
    try:
        import torch

        if a.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"--device cuda: torch {torch.__version__} sees no CUDA device")
        if a.device == "cpu":
            from trainer.learner.ds_ops import clear_stale_build_locks

            clear_stale_build_locks()
        result["machine"] = machine_facts(a.device)
        parts = Parts(a, _model_folder(a, cache))
    except Exception as e:
        result.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
        return _write(a, result, t0)
    big = a.device == "cuda"
    fns = {
        "learner": lambda: check_learner(parts),
        "chunked": lambda: check_chunked(parts, batch=8 if big else 2, seq=1024 if big else 128, reps=3 if big else 1),
        "oldlogit": lambda: check_oldlogit(parts),
        "ipc": lambda: check_ipc(parts),
        "loop": lambda: check_loop(parts, group=4 if big else 2, max_tokens=16 if big else 12),
    }
    result.update(ok=False, checks={})
    watchdog = threading.Timer(a.budget_s, _over_budget, (a, result, t0, cache))
    watchdog.daemon = True
    watchdog.start()
    for name in a.checks:  # the file is rewritten after each check: a run cut short leaves what it did
        result["running"] = name
        result["checks"][name] = _run_check(name, fns[name])
        _save(a, result, t0)
    watchdog.cancel()
    result.pop("running")
    result["ok"] = all(c["ok"] for c in result["checks"].values())
    shutil.rmtree(cache, ignore_errors=True)
    return _write(a, result, t0)


def _over_budget(a: argparse.Namespace, result: dict, t0: float, cache: Path) -> None:
    """The watchdog: record which check was running when ``--budget-s`` ran out, remove the model
    folder ``cache``, and exit 1."""
    result["error"] = f"budget: --budget-s {a.budget_s:g} s ran out during check {result.get('running')!r}"
    print(f"[gpu_check] {result['error']}", flush=True)
    _write(a, result, t0)
    shutil.rmtree(cache, ignore_errors=True)
    os._exit(1)


def _save(a: argparse.Namespace, result: dict, t0: float) -> None:
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))


def _write(a: argparse.Namespace, result: dict, t0: float) -> int:
    _save(a, result, t0)
    out = Path(a.out)
    passed = [n for n, c in result.get("checks", {}).items() if c["ok"]]
    print(f"[gpu_check] ok={result['ok']} passed {passed} in {result['wall_s']} s; result {out}", flush=True)
    return 0 if result["ok"] else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring); ``--dtype`` defaults to bfloat16 on cuda, float32 on cpu."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_out = (
        Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else REPO / "runs" / "gpu_check.json"
    )
    ap.add_argument("--out", default=str(default_out), help="result JSON (default $OUT/gpu_check.json)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None)
    ap.add_argument("--wheels", default=str(REPO / "deploy" / "gpu" / "wheels"), help="the carried wheels")
    ap.add_argument("--tokenizer", default=str(REPO / "deploy" / "gpu" / "tokenizer"), help="the carried tokenizer")
    ap.add_argument("--site", default=None, help="install the wheels here and keep them (default: a temporary folder)")
    ap.add_argument("--checks", nargs="+", choices=CHECKS, default=list(CHECKS))
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop (exit 1, result kept) after this many seconds")
    a = ap.parse_args(argv)
    a.dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    return a


def main(argv: list[str] | None = None) -> int:
    """Run the checks here, or first install the carried wheels and run them in a child interpreter."""
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    missing = missing_modules()
    if missing and not os.environ.get(SITE_ENV):
        return rerun_with_wheels("deploy.gpu_check", argv, Path(a.wheels), Path(a.site) if a.site else None)
    if missing:
        raise SystemExit(f"[gpu_check] still missing {missing} after installing {a.wheels} into {os.environ[SITE_ENV]}")
    return run_checks(a)


if __name__ == "__main__":
    sys.exit(main())
