"""Peak host memory of one learner micro-batch's log-probs: the full-logit path vs the chunked path.

    python -m benchmarks.bench_memory [--model tiny|real] [--batch 4] [--seq 1024] [--out runs/bench/memory.json]
    vintage bench memory [--model tiny]

Paths (:mod:`modelkit.scoring`): ``full`` (``chunk_bytes=0``: HF's ``[batch, seq, vocab]`` fp32
logits, their log-softmax kept for backward), ``chunked`` (``chunk_bytes``, by default
``DEFAULT_CHUNK_BYTES``: the output projection and log-softmax per chunk of positions, recomputed
in backward) and, in train mode only, ``checkpointed`` (chunked plus ``learner.gradient_checkpointing``:
each decoder layer recomputed in backward, only its input kept). Modes:

* ``train``: the learner's micro-batch - log-probs and entropy with gradients, then backward of
  a weighted sum of the log-probs (model in train mode);
* ``score``: no-grad log-probs (the old-logit service's and the EWMA's forward).

Each (path, mode) runs in a fresh Python process: it loads the model in fp32 on the CPU, builds a
random ``[batch, seq]`` batch (the first quarter of each row a prompt: ``first = seq // 4``, as
the learner skips prompt logits), runs one short warm-up pass, resets the process's peak resident
set (Linux: ``/proc/self/clear_refs`` ``5``), runs the pass once and reads the peak (``VmHWM``).
Reported per row: ``peak_over_base_bytes`` (the peak less the resident set just before the pass:
what the pass itself adds), the peak itself, the median wall seconds of ``--repeats`` passes, and
for reference the bytes of one fp32 ``[batch, seq, vocab]`` tensor. Per train row also the
learner's estimated peak over its state, ``(state + added) / state`` with state = the fp32 weights,
gradients, Adam's two moments and the EWMA copy (5 x 4 bytes per parameter; the goal is <= 1.5). Where the peak cannot be reset, the process's lifetime
peak (``resource.getrusage``) stands in and ``peak_source`` says so.

The resident set counts what glibc's allocator keeps after a free: blocks under its mmap threshold
come from the heap and may stay resident. The passes run under the job's threshold (1 MiB,
:data:`trainer.driver.cluster.environment.MMAP_THRESHOLD_BYTES`; a ``MALLOC_MMAP_THRESHOLD_`` of
your own is kept; :func:`trainer.driver.cluster.environment.defaults_env`), recorded as
``malloc_mmap_threshold`` (None where ``GLIBC_TUNABLES`` sets it).

Writes ``runs/bench/memory.json`` (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

PATHS = ("full", "chunked", "checkpointed")
MODES = ("train", "score")
STATE_BYTES_PER_PARAM = 5 * 4
"""fp32 weights, gradients, Adam's first and second moments and the PPO-EWMA copy."""


def _status_bytes(field: str) -> int | None:
    """``VmRSS`` / ``VmHWM`` of this process from ``/proc/self/status``, bytes (None off Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Reset the peak resident set to the current one; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _status_bytes("VmHWM") is not None


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One (path, mode) measurement in this process (see the module docstring)."""
    import resource

    import torch

    from modelkit.modelhub import load_causal_lm
    from modelkit.scoring import enable_gradient_checkpointing, sequence_logprobs, sequence_logprobs_and_entropy

    torch.manual_seed(0)
    model = load_causal_lm(spec["model_path"], "float32")
    if spec["path"] == "checkpointed":
        enable_gradient_checkpointing(model)
    vocab = int(model.config.vocab_size)
    B, T = spec["batch"], spec["seq"]
    first = max(1, T // 4)
    chunk = 0 if spec["path"] == "full" else spec["chunk_bytes"]
    ids = torch.randint(0, vocab, (B, T))
    mask = torch.ones_like(ids)
    weights = torch.randn(B, T)

    def run(n: int) -> None:
        x, m, w = ids[:, :n], mask[:, :n], weights[:, :n]
        if spec["mode"] == "train":
            model.train()
            lp, ent = sequence_logprobs_and_entropy(model, x, m, 1.0, min(first, n - 1), chunk_bytes=chunk)
            (lp * w).sum().backward()
            model.zero_grad(set_to_none=True)
            del lp, ent
        else:
            model.eval()
            with torch.no_grad():
                sequence_logprobs(model, x, m, 1.0, min(first, n - 1), chunk_bytes=chunk)

    run(min(T, 16))  # thread pools, kernels, first-call allocations
    resettable = _reset_peak()
    base = _status_bytes("VmRSS") if resettable else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    run(T)
    times = [time.perf_counter() - t0]
    peak = _status_bytes("VmHWM") if resettable else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for _ in range(spec["repeats"] - 1):  # seconds only: the peak is the first pass's
        t0 = time.perf_counter()
        run(T)
        times.append(time.perf_counter() - t0)
    assert base is not None and peak is not None
    return {
        "path": spec["path"],
        "mode": spec["mode"],
        "chunk_bytes": chunk,
        "peak_bytes": peak,
        "base_bytes": base,
        "peak_over_base_bytes": peak - base,
        "seconds": statistics.median(times),
        "logits_bytes": B * T * vocab * 4,
        "vocab": vocab,
        "params": sum(p.numel() for p in model.parameters()),
        "peak_source": "VmHWM after clear_refs" if resettable else "ru_maxrss (process lifetime)",
    }


def learner_peak_over_state(params: int, added_bytes: int) -> float:
    """The learner's estimated peak over its state: ``(S + added) / S`` with ``S = params x``
    :data:`STATE_BYTES_PER_PARAM`. Example: 134,515,008 parameters (SmolLM2-135M) hold
    S = 2,690,300,160 bytes; a pass adding 1,345,150,080 bytes gives 1.5."""
    state = params * STATE_BYTES_PER_PARAM
    return (state + added_bytes) / state


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Run :func:`_worker` for ``spec`` in a fresh interpreter and return its JSON line.

    Raises:
        RuntimeError: the subprocess failed (its stderr's tail in the message)."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_memory", "--worker", json.dumps(spec)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"bench_memory worker {spec['path']}/{spec['mode']} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def print_table(res: dict[str, Any]) -> None:
    mib = 2**20
    print(
        f"{res['model']}: batch {res['batch']} x seq {res['seq']}, one fp32 [B, T, V] tensor = "
        f"{res['rows'][0]['logits_bytes'] / mib:.0f} MiB; chunk {res['chunk_bytes'] / mib:.0f} MiB"
    )
    print(f"{'mode':6s} {'path':12s} {'added MiB':>10s} {'peak MiB':>9s} {'seconds':>8s} {'learner/state':>13s}")
    for r in res["rows"]:
        est = f"{r['learner_peak_over_state']:13.2f}" if "learner_peak_over_state" in r else f"{'-':>13s}"
        print(
            f"{r['mode']:6s} {r['path']:12s} {r['peak_over_base_bytes'] / mib:10.0f} "
            f"{r['peak_bytes'] / mib:9.0f} {r['seconds']:8.2f} {est}"
        )
    for mode, ratio in res["added_ratio_chunked_over_full"].items():
        print(
            f"{mode}: chunked / full added memory {ratio:.3f}, seconds {res['seconds_ratio_chunked_over_full'][mode]:.2f}"
        )
    ck = res["train_checkpointed_over_chunked"]
    print(f"train: checkpointed / chunked added memory {ck['added']:.3f}, seconds {ck['seconds']:.2f}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("tiny", "real"), default="tiny", help="tiny random Llama or SmolLM2-135M")
    ap.add_argument("--batch", type=int, default=4, help="sequences in the micro-batch")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    ap.add_argument(
        "--chunk-bytes", type=int, default=None, help="chunked path's budget (default: the scoring default)"
    )
    ap.add_argument("--repeats", type=int, default=3, help="passes per row for the median seconds")
    ap.add_argument("--out", default="runs/bench/memory.json")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker is not None:
        print(json.dumps(_worker(json.loads(a.worker))))
        return {}
    t0 = time.perf_counter()
    from trainer.driver.cluster.environment import defaults_env

    defaults_env()  # the job's environment, glibc's mmap threshold with it: the passes' processes inherit it
    from benchmarks.machine import machine_facts
    from modelkit.modelhub import make_tiny_model, prepare_smollm2
    from modelkit.scoring import DEFAULT_CHUNK_BYTES

    real = prepare_smollm2(log=lambda *x, **k: None)
    path = str(real) if a.model == "real" else str(make_tiny_model(seed=0, tokenizer_from=real))
    chunk = a.chunk_bytes if a.chunk_bytes is not None else DEFAULT_CHUNK_BYTES
    base = {"model_path": path, "batch": a.batch, "seq": a.seq, "chunk_bytes": chunk, "repeats": max(1, a.repeats)}
    runs = [(m, p) for m in MODES for p in PATHS if m == "train" or p != "checkpointed"]  # no backward in score
    rows = [measure({**base, "path": p, "mode": m}) for m, p in runs]
    for r in rows:
        if r["mode"] == "train":
            r["learner_peak_over_state"] = learner_peak_over_state(r["params"], r["peak_over_base_bytes"])
    by = {(r["mode"], r["path"]): r for r in rows}
    res = {
        "model": "SmolLM2-135M" if a.model == "real" else "tiny",
        "batch": a.batch,
        "seq": a.seq,
        "chunk_bytes": chunk,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "rows": rows,
        "added_ratio_chunked_over_full": {
            m: by[m, "chunked"]["peak_over_base_bytes"] / max(1, by[m, "full"]["peak_over_base_bytes"]) for m in MODES
        },
        "seconds_ratio_chunked_over_full": {m: by[m, "chunked"]["seconds"] / by[m, "full"]["seconds"] for m in MODES},
        "train_checkpointed_over_chunked": {
            "added": by["train", "checkpointed"]["peak_over_base_bytes"]
            / max(1, by["train", "chunked"]["peak_over_base_bytes"]),
            "seconds": by["train", "checkpointed"]["seconds"] / by["train", "chunked"]["seconds"],
        },
    }
    res["machine"] = machine_facts(t0)
    print_table(res)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
    return res


if __name__ == "__main__":
    main()
