"""The learner's training step against a plain PyTorch step on the identical batch, dtype and threads,
and the learner's step split into its parts.

    python -m benchmarks.bench_learner [--model tiny|real] [--method snapshot] [--batch 16] [--prompt 64]
        [--completion 32] [--threads 1] [--repeats 5] [--dtype float32|bfloat16] [--pack]
        [--chunk-bytes N]
        [--out runs/bench/learner.json]
    vintage bench learner [--model tiny]

The batch: ``--batch`` synthetic trajectories of random token ids (``--seed``), each a prompt of
``--prompt`` tokens and a completion of ``ceil(completion / 2)`` to ``--completion`` tokens (the
first row the longest, so rows pad to ``prompt + completion``), groups of two with rewards 0 and 1.
Their behaviour log-probs mu are the model's own log-probs at version 0 plus N(0, 0.05) noise
(capped at 0), as the learner's integration tests make them. For a method with an old-logit route
(the default ``snapshot``, the demo's) the exact old log-probs are the model's own at version 0,
supplied for every completion token. Both steps train on the same :func:`trainer.algorithm.batch.collate`
batch (``--batch`` rows, one micro-batch).

The two steps, each on its own copy of the model loaded from the same folder:

* **plain**: the HF model (:func:`modelkit.modelhub.load_causal_lm`, train mode) forward on the
  padded batch with ``logits_to_keep`` from the first trained position's predecessor on (the
  learner's forwards skip the prompt's vocabulary logits too), ``log_softmax`` of the fp32 logits
  over the temperature, the sampled tokens' log-probs gathered, then
  :func:`trainer.algorithm.losses.compute_policy_loss` with the learner's ``LossConfig`` and the
  inputs the learner gives it (old log-probs, exact mask, staleness, global token and sequence
  counts; no EWMA: where the proxy is "ewma" the detached current log-probs stand in, as the learner
  does when every sampled token has exact old logits), ``loss.backward()``, gradient-norm clipping
  at the learner's ``grad_clip``, ``torch.optim.AdamW(fused=True)`` step and ``zero_grad``. No
  DeepSpeed, no EWMA, no non-finite guard. bfloat16: ``torch.autocast`` over the forward and the
  loss with fp32 weights and optimizer (the learner's bf16 keeps fp32 master weights too).
  Split by ``time.perf_counter`` into ``forward_loss_s``, ``backward_s`` and ``optimizer_s``
  (clip, AdamW step, ``zero_grad``); ``step_s`` is their sum.
* **learner**: :meth:`trainer.learner.core.LearnerCore.train_step` (DeepSpeed ZeRO 0, torch fused
  AdamW, the guard, the EWMA where the method's proxy is "ewma"; ``micro_batch_size = --batch``).
  Its own metrics give ``step_s`` (:meth:`~trainer.learner.core.LearnerCore.train_batch`, from the
  collated batch to the version bump) and the parts ``forward_loss_s`` (log-probs and loss),
  ``backward_s``, ``ewma_forward_s``,
  ``ref_forward_s``, ``optimizer_s`` (``engine.step()`` with the guard's copy of the updated
  tensors and DeepSpeed's clipping), ``ewma_update_s``, ``recompute_forward_s``;
  ``remainder_s = step_s - sum(parts)``. ``wall_s`` is the ``train_step`` call measured outside
  (collation and the thread switch included), ``collate_s = wall_s - step_s``. With ``--pack`` the
  learner packs its rows (``learner.pack_sequences``) while the plain step keeps the padded batch;
  the header gives the forward's token positions padded and packed
  (:func:`modelkit.scoring.packed_token_counts`).

Both run under ``--threads`` torch threads (:func:`modelkit.cores.torch_threads`). Each repeat runs
both steps back to back (plain first on even repeats, learner first on odd ones, so a drifting
background load touches both alike); the learner consumes each batch at its current version (the
trajectories were sampled at version 0, the staleness grows by one per repeat, the same for the
plain step's batch). The first repeat is warm-up (thread pools, allocator, kernels); every figure
is the median, min and max over the others (all seconds, wall clock). With the snapshot method
the EWMA forward runs only as its probe, every ``ewma.probe_every`` (4) versions: at the warm-up
and at version 4. ``ratio_learner_over_plain`` is the learner's ``step_s`` over the plain
``step_s`` of the same repeat (paired), summarised the same way.

Writes ``runs/bench/learner.json`` (``--out``) and prints a table. With no arguments it runs on the
tiny model (seconds on a CPU core).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

LEARNER_PARTS = (
    "forward_loss_s", "backward_s", "ewma_forward_s", "ref_forward_s", "optimizer_s", "ewma_update_s",
    "recompute_forward_s",
)  # fmt: skip
"""The phases of the learner's own metrics (seconds, summed over its optimizer steps) that split ``step_s``."""
PLAIN_PARTS = ("forward_loss_s", "backward_s", "optimizer_s")
"""The plain step's phases (seconds): forward and loss, backward, clip + AdamW step + ``zero_grad``."""
NOISE = 0.05
"""Standard deviation of the N(0, s) noise added to the model's log-probs to make mu (nats)."""
LR = 5e-5
"""Learning rate of both steps (the demo's peak rate)."""
GRAD_CLIP = 1.0
"""Global gradient-norm clip of both steps (the demo's)."""


# -- pure parts --------------------------------------------------------------------------------------


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of ``values`` without the first (warm-up) one; of all when there is one.

    Returns ``{"median", "min", "max", "n"}`` (``n``: the values summarised); NaN for no values.
    Example: [9.0, 2.0, 4.0, 3.0] -> median 3.0, min 2.0, max 4.0, n 3.
    """
    vals = list(values[1:] if len(values) > 1 else values)
    if not vals:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def learner_split(metrics: Mapping[str, float], wall_s: float) -> dict[str, float]:
    """The learner's step from its own metrics: ``step_s``, each of :data:`LEARNER_PARTS` (0 when
    absent), ``remainder_s = step_s - sum(parts)``, ``wall_s`` (the ``train_step`` call, measured
    outside) and ``collate_s = wall_s - step_s``; seconds.

    Example: step_s 1.0, forward_loss_s 0.2, backward_s 0.4, optimizer_s 0.2, ewma_update_s 0.05, wall 1.1 ->
    remainder 0.15, collate 0.1.
    """
    step = float(metrics["step_s"])
    out = {"step_s": step, **{p: float(metrics.get(p, 0.0)) for p in LEARNER_PARTS}}
    out["remainder_s"] = step - sum(out[p] for p in LEARNER_PARTS)
    out["wall_s"] = float(wall_s)
    out["collate_s"] = float(wall_s) - step
    return out


def summarize(repeats: Sequence[Mapping[str, Mapping[str, float]]]) -> dict[str, Any]:
    """Every timing of ``repeats`` (each ``{"plain": {...}, "learner": {...}}`` as :func:`run_repeat`
    gives them) through :func:`spread`, and the paired ratio learner ``step_s`` / plain ``step_s``.

    Returns ``{"plain": {key: spread}, "learner": {key: spread}, "ratio_learner_over_plain": spread,
    "ratio_of_medians": float}``. Example: plain 1.0, 2.0, 2.5 and learner 5.0, 3.0, 6.0 s: the
    warm-up pair is left out, ratios 1.5 and 2.4 -> median 1.95; medians 2.25 and 4.5 -> 2.0.
    """
    plain_keys = ("step_s", *PLAIN_PARTS)
    learner_keys = ("step_s", *LEARNER_PARTS, "remainder_s", "wall_s", "collate_s")
    plain = {k: spread([r["plain"][k] for r in repeats]) for k in plain_keys}
    learner = {k: spread([r["learner"][k] for r in repeats]) for k in learner_keys}
    ratios = [r["learner"]["step_s"] / r["plain"]["step_s"] for r in repeats]
    return {
        "plain": plain,
        "learner": learner,
        "ratio_learner_over_plain": spread(ratios),
        "ratio_of_medians": learner["step_s"]["median"] / plain["step_s"]["median"],
    }


def table_rows(summary: Mapping[str, Any]) -> list[tuple[str, dict[str, float]]]:
    """The printed table's rows: ``(label, spread)`` in order - the plain step and its parts, the
    learner's ``step_s`` and its parts with the remainder, its ``train_step`` wall time and the
    collation outside ``step_s``, then the paired ratio learner / plain. Parts are indented by two
    spaces."""
    p, q = summary["plain"], summary["learner"]
    rows = [
        ("plain step", p["step_s"]),
        ("  forward + loss", p["forward_loss_s"]),
        ("  backward", p["backward_s"]),
        ("  optimizer (clip, AdamW, zero_grad)", p["optimizer_s"]),
        ("learner step (step_s)", q["step_s"]),
    ]
    rows += [(f"  {k}", q[k]) for k in LEARNER_PARTS]
    rows += [
        ("  remainder (step_s - parts)", q["remainder_s"]),
        ("learner train_step wall", q["wall_s"]),
        ("  collation (wall - step_s)", q["collate_s"]),
        ("ratio learner / plain (paired)", summary["ratio_learner_over_plain"]),
    ]
    return rows


def format_table(result: Mapping[str, Any]) -> str:
    """The result as plain text: a header (model, method, dtype, threads, batch, tokens), then
    :func:`table_rows` with median / min / max (seconds; the ratio row is a plain number)."""
    c, b = result["config"], result["batch"]
    lines = [
        f"{c['model']} ({c['params']:,} params), method {c['method']}, {c['dtype']}, {c['threads']} thread(s), "
        f"{c['device']}; batch {c['batch']} x ({c['prompt']} prompt + <= {c['completion']} completion)",
        f"tokens: padded {b['padded_tokens']:,}, real {b['real_tokens']:,} "
        f"(padded / real {b['padded_over_real']:.3f}), packed {b['packed_tokens']:,} (packed / real "
        f"{b['packed_over_real']:.3f}; the learner {'packs' if c['pack'] else 'pads'}), "
        f"trained {b['trained_tokens']:,}; trained per step "
        f"plain {result['tokens']['plain']:,.0f}, learner {result['tokens']['learner']:,.0f}",
        f"{c['repeats'] - 1 if c['repeats'] > 1 else c['repeats']} measured repeat(s) after a warm-up; seconds",
        f"{'':38s} {'median':>9s} {'min':>9s} {'max':>9s}",
    ]
    for label, s in table_rows(result["summary"]):
        lines.append(f"{label:38s} {s['median']:9.4f} {s['min']:9.4f} {s['max']:9.4f}")
    lines.append(f"{'ratio of medians learner / plain':38s} {result['summary']['ratio_of_medians']:9.3f}")
    return "\n".join(lines)


def completion_lengths(batch: int, completion: int, seed: int) -> list[int]:
    """Completion tokens per row: the first row ``completion``, the others drawn uniformly from
    ``[ceil(completion / 2), completion]`` (numpy generator seeded with ``seed``)."""
    import numpy as np

    rng = np.random.default_rng(seed + 1)
    low = max(1, -(-completion // 2))
    return [completion] + [int(x) for x in rng.integers(low, completion + 1, batch - 1)]


# -- measured parts ----------------------------------------------------------------------------------


def make_trajectories(model: Any, batch: int, prompt: int, completion: int, seed: int = 0) -> tuple[list, list]:
    """``batch`` synthetic trajectories sampled at version 0 and their exact old log-probs (see the
    module docstring): ``(trajectories, old_logits)``, ``old_logits`` one float32 array per
    trajectory, the model's own log-probs on completion tokens and NaN elsewhere."""
    import numpy as np
    import torch

    from modelkit.scoring import sequence_logprobs
    from protocol import Trajectory

    rng = np.random.default_rng(seed)
    vocab = int(model.config.vocab_size)
    trajs, olds = [], []
    for i, comp in enumerate(completion_lengths(batch, completion, seed)):
        length = prompt + comp
        ids = rng.integers(3, vocab, length)
        with torch.no_grad():
            lp = sequence_logprobs(model, torch.tensor(ids)[None], torch.ones(1, length, dtype=torch.long), 1.0)
        lp = lp[0].numpy()
        mask = np.zeros(length, np.int8)
        mask[prompt:] = 1
        mu = np.where(mask == 1, np.minimum(lp + rng.normal(0, NOISE, length), 0.0), 0.0).astype(np.float32)
        trajs.append(Trajectory(
            trajectory_id=f"b{i}", group_id=f"g{i // 2}", token_ids=ids, loss_mask=mask, behav_logprobs=mu,
            versions=np.where(mask == 1, 0, -1), policy_version=0, prompt_len=prompt, finish_reason="stop",
            reward=float(i % 2),
        ))  # fmt: skip
        olds.append(np.where(mask == 1, lp, np.nan).astype(np.float32))
    return trajs, olds


def _sync(device: Any) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)


def plain_step(model: Any, optimizer: Any, batch: Any, cfg: Any, amp: Any, grad_clip: float) -> dict[str, float]:
    """One plain PyTorch step on a collated ``batch`` already on the model's device (see the
    module docstring). ``amp``: the autocast dtype (``torch.bfloat16``) or None for fp32.

    Returns ``forward_loss_s``, ``backward_s``, ``optimizer_s`` and ``step_s`` (their sum), seconds;
    ``tokens`` (the loss tokens), ``loss`` and ``grad_norm`` (before clipping)."""
    import torch

    from trainer.algorithm.batch import first_loss_position
    from trainer.algorithm.losses import compute_policy_loss

    device = batch.token_ids.device
    ids, attn, mask = batch.token_ids, batch.attention_mask, batch.loss_mask
    B, T = ids.shape
    first = first_loss_position(batch)
    autocast = torch.autocast(device.type, dtype=amp) if amp is not None else contextlib.nullcontext()
    _sync(device)
    t0 = time.perf_counter()
    with autocast:
        logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=T - first + 1).logits  # [B, T-first+1, V]
        log_p = torch.log_softmax(logits[:, :-1].float() / batch.temperature, dim=-1)  # predicts tokens first..T-1
        lp = log_p.gather(-1, ids[:, first:, None]).squeeze(-1) * attn[:, first:].float()
        lp = torch.cat([lp.new_zeros((B, first)), lp], dim=1)  # [B, T], 0 before first
        n_tok, n_seq = float(mask.sum()), float(mask.any(-1).sum())
        loss, _ = compute_policy_loss(
            lp, batch.behav_logprobs, batch.advantages, mask, cfg,
            old_logprobs=torch.where(batch.current_mask, lp.detach(), batch.old_logprobs),
            exact_mask=batch.exact_mask | batch.current_mask, staleness=batch.staleness,
            ewma_logprobs=lp.detach() if cfg.proxy == "ewma" else None,
            global_token_count=n_tok, global_seq_count=n_seq,
        )  # fmt: skip
    _sync(device)
    t1 = time.perf_counter()
    loss.backward()
    _sync(device)
    t2 = time.perf_counter()
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip) if grad_clip > 0 else torch.tensor(math.nan)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _sync(device)
    t3 = time.perf_counter()
    return {
        "forward_loss_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": t3 - t2, "step_s": t3 - t0,
        "tokens": n_tok, "loss": float(loss.detach()), "grad_norm": float(norm),
    }  # fmt: skip


def run_repeat(index: int, core: Any, plain: tuple[Any, Any], trajs: list, olds: list | None, amp: Any) -> dict:
    """Repeat ``index``: the plain step and the learner's ``train_step`` on the same trajectories,
    consumed at the learner's current version (plain first on even ``index``). Returns
    ``{"plain": plain_step's dict, "learner": learner_split + tokens, loss, version}``."""
    from modelkit.cores import torch_threads
    from trainer.algorithm.batch import collate

    s = core.settings
    model, optimizer = plain
    batch = collate(
        trajs, core.version, old_logits=olds, temperature=s.temperature, pad_token_id=core.pad_token_id,
        advantage=s.loss.advantage,
    ).to(core.engine.device)  # fmt: skip
    out: dict[str, Any] = {}

    def run_plain() -> None:
        with torch_threads(s.torch_threads):
            out["plain"] = plain_step(model, optimizer, batch, s.loss, amp, s.grad_clip)

    def run_learner() -> None:
        _sync(core.engine.device)
        t0 = time.perf_counter()
        m = core.train_step(trajs, olds)
        _sync(core.engine.device)
        wall = time.perf_counter() - t0
        out["learner"] = {
            **learner_split(m, wall), "tokens": float(m["tokens"]), "loss": float(m["loss"]),
            "version": float(m["version"]), "applied": float(m["applied"]),
            "ewma_forward_micro_batches": float(m.get("ewma_forward_micro_batches", 0.0)),
        }  # fmt: skip

    for fn in (run_plain, run_learner) if index % 2 == 0 else (run_learner, run_plain):
        fn()
    return out


def run(
    model_path: str, model_name: str, method: str, batch: int, prompt: int, completion: int, threads: int,
    repeats: int, dtype: str, seed: int = 0, pack: bool = False, chunk_bytes: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Build the batch, the learner and the plain model, run ``repeats`` repeats; the result dict
    (``config``, ``batch``, ``tokens``, ``repeats``, ``summary``; see :func:`main`)."""
    import torch

    from modelkit.cores import torch_threads
    from modelkit.modelhub import load_causal_lm
    from modelkit.scoring import packed_token_counts
    from trainer.algorithm.batch import collate
    from trainer.algorithm.loss_config import loss_config
    from trainer.learner import LearnerCore, LearnerSettings, free_port

    cfg = loss_config(method)
    torch.manual_seed(seed)
    with torch_threads(threads):
        scorer = load_causal_lm(model_path, "float32")
        trajs, olds = make_trajectories(scorer, batch, prompt, completion, seed)
        del scorer
        settings = LearnerSettings(
            model_path=model_path, lr=LR, grad_clip=GRAD_CLIP, micro_batch_size=batch, dtype=dtype, loss=cfg,
            torch_threads=threads, seed=seed, master_port=free_port(), pack_sequences=pack,
            **({} if chunk_bytes is None else {"logprob_chunk_bytes": chunk_bytes}),
        )  # fmt: skip
        core = LearnerCore(settings)
        device = core.engine.device
        model = load_causal_lm(model_path, "float32").to(device)
        model.config.use_cache = False
        model.train()
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=LR, betas=settings.betas, eps=settings.adam_eps,
            weight_decay=settings.weight_decay, fused=True,
        )  # fmt: skip
    old_logits = olds if cfg.oldlogit_route != "none" else None
    amp = torch.bfloat16 if dtype == "bfloat16" else None
    rows = [run_repeat(i, core, (model, optimizer), trajs, old_logits, amp) for i in range(repeats)]
    b0 = collate(trajs, 0, old_logits=old_logits, pad_token_id=core.pad_token_id, advantage=cfg.advantage)
    padded, real = int(b0.token_ids.numel()), int(b0.attention_mask.sum())
    packed = packed_token_counts(b0.attention_mask)[1]
    plain_tokens = {r["plain"]["tokens"] for r in rows}
    learner_tokens = {r["learner"]["tokens"] for r in rows}
    return {
        "config": {
            "model": model_name, "model_path": model_path, "params": sum(p.numel() for p in model.parameters()),
            "method": method, "dtype": dtype, "threads": threads, "batch": batch, "prompt": prompt,
            "completion": completion, "repeats": repeats, "seed": seed, "lr": LR, "grad_clip": GRAD_CLIP, "pack": pack,
            "logprob_chunk_bytes": settings.logprob_chunk_bytes, "micro_batch_size": batch, "zero_stage": settings.zero_stage, "device": str(device),
            "loss": cfg.model_dump(),
        },
        "batch": {
            "padded_tokens": padded, "real_tokens": real, "padded_over_real": padded / real,
            "packed_tokens": packed, "packed_over_real": packed / real,
            "trained_tokens": int(b0.loss_mask.sum()), "width": int(b0.token_ids.shape[1]),
            "completion_lengths": completion_lengths(batch, completion, seed),
        },
        "tokens": {
            "plain": max(plain_tokens), "learner": max(learner_tokens),
            "equal": plain_tokens == learner_tokens and len(plain_tokens) == 1,
        },
        "repeats": rows,
        "summary": summarize(rows),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark (see the module docstring); print the table, write and return the result."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("tiny", "real"), default="tiny", help="tiny random Llama or SmolLM2-135M")
    ap.add_argument("--method", default="snapshot", help="loss method (trainer.algorithm.loss_config.METHODS)")
    ap.add_argument("--batch", type=int, default=16, help="sequences in the batch (one micro-batch)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    ap.add_argument("--completion", type=int, default=32, help="longest completion, tokens")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of both steps")
    ap.add_argument("--repeats", type=int, default=5, help="repeats of both steps; the first is warm-up")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--seed", type=int, default=0, help="seed of the batch and of torch")
    ap.add_argument("--pack", action="store_true", help="the learner packs its rows (learner.pack_sequences)")
    ap.add_argument(
        "--chunk-bytes", type=int, default=None,
        help="the learner's learner.logprob_chunk_bytes (default: its default; 0: whole logits, no recompute)",
    )  # fmt: skip
    ap.add_argument("--out", default="runs/bench/learner.json")
    a = ap.parse_args(argv)
    from trainer.algorithm.loss_config import METHODS

    if a.method not in METHODS:
        ap.error(f"--method {a.method!r} is not one of {', '.join(METHODS)}")
    for name in ("batch", "prompt", "completion", "threads", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be >= 1")

    t0, load0 = time.perf_counter(), list(os.getloadavg())
    from trainer.driver.cluster.environment import defaults_env

    defaults_env()  # offline hubs, DeepSpeed's accelerator and its one JIT build per virtual environment
    import torch

    from benchmarks.machine import machine_facts
    from modelkit.modelhub import model_folder

    path = str(model_folder("smollm2" if a.model == "real" else "tiny"))
    before = torch.get_num_threads()
    try:
        res = run(
            path, "SmolLM2-135M" if a.model == "real" else "tiny", a.method, a.batch, a.prompt, a.completion,
            a.threads, a.repeats, a.dtype, a.seed, a.pack, a.chunk_bytes,
        )  # fmt: skip
    finally:
        torch.set_num_threads(before)
    res["machine"] = machine_facts(t0)
    res["machine"].update(loadavg_before=load0, loadavg_after=list(os.getloadavg()))
    print(format_table(res))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
    return res


if __name__ == "__main__":
    main()
