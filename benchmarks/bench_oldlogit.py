"""Cost of exact old logits: memory held and extra seconds per training step, per route, vs PPO-EWMA.

One run, same learner, same batch, for every staleness window W: the three exact routes of
``oldlogit_service`` (snapshot, old_logit_model, interrupt_sync) and the PPO-EWMA proxy (one extra
fp32 copy + one extra forward, ``trainer.algorithm.ewma.EwmaProximal`` when present). A step is simulated in
steady state (the snapshot store already holds [V - W, V]):

* the learner takes a step (a fake in-place update; the learner's own cost is measured once, a real
  forward + backward + AdamW step on the same batch, as the reference "step seconds");
* every route receives the new weights (``update_weights``: verify + copy);
* the batch of B partial rollouts carries tokens of versions [V - W, V] (each sequence spans
  several versions); snapshot scores it with one forward per distinct version; old_logit_model
  scores the segments finished at the outgoing version; interrupt_sync scores the in-flight prefixes
  at the outgoing version (the workers' stall); EWMA folds the step in and runs one forward.

Memory is what each route holds in weight copies (bytes, tied tensors once), seconds are wall
seconds per step (mean over ``--steps``). Paper reference (Guan et al. 2026, 30B model):
snapshot = 5.0x the memory and 4.4x the time of PPO-EWMA.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_oldlogit.py [--model tiny|real|both] [--windows 1 2 4]

Writes ``runs/bench/oldlogit.json`` (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.machine import machine_facts  # noqa: E402
from modelkit.modelhub import load_causal_lm, make_tiny_model, prepare_smollm2  # noqa: E402
from modelkit.scoring import sequence_logprobs  # noqa: E402
from modelkit.weights import pack_weights  # noqa: E402
from oldlogit_service import OldLogitService  # noqa: E402
from oldlogit_service.items import right_padded  # noqa: E402
from protocol import OldLogitItem, OldLogitRequest  # noqa: E402

BLOCKS = {
    "snapshot": "learner (scores the batch before the step)",
    "ppo_ewma": "learner (EWMA fold-in + proxy forward before the step)",
    "old_logit_model": "nothing (scores finished segments while the learner trains)",
    "interrupt_sync": "rollout (generation stalls for prefix scoring + weight load at each update)",
}
"""Whose critical path each route's seconds land on."""
PAPER = {
    "memory_ratio": 5.0,
    "time_ratio": 4.4,
    "model": "30B",
    "source": "Guan et al. 2026, Missing Old Logits in Asynchronous Agentic RL",
}
TEMPERATURE = 1.0


class _FallbackEwma:
    """Used only when ``trainer.algorithm.ewma`` is absent: an fp32 parameter copy, a lerp and a functional forward."""

    def __init__(self, model: torch.nn.Module, window: int) -> None:
        self.beta = window / (window + 2.0)
        self.total = 1.0
        self.params = {n: p.detach().float().clone() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        new = self.beta * self.total + 1.0
        keep = self.beta * self.total / new
        for n, p in model.named_parameters():
            self.params[n].mul_(keep).add_(p.detach().float(), alpha=1.0 / new)
        self.total = new

    @torch.no_grad()
    def forward(self, model: torch.nn.Module, **kw: Any) -> Any:
        return torch.func.functional_call(model, self.params, (), kw)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.params.values())


def make_ewma(model: torch.nn.Module, window: int) -> tuple[Any, str]:
    try:
        from trainer.algorithm.ewma import EwmaProximal
        from trainer.algorithm.loss_config import EwmaConfig

        return EwmaProximal(model, EwmaConfig(window=window)), "trainer.algorithm.ewma.EwmaProximal"
    except Exception as e:  # noqa: BLE001 - the class is being written elsewhere; measure the same work directly
        print(
            f"note: trainer.algorithm.ewma.EwmaProximal unavailable ({e!r}); measuring an fp32 copy + forward directly",
            file=sys.stderr,
        )
        return _FallbackEwma(model, window), "fallback (fp32 copy + lerp + functional forward)"


def fake_step(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)


def make_batch(vocab: int, batch: int, prompt: int, gen: int, V: int, W: int, seed: int) -> list[OldLogitItem]:
    """B partial rollouts consumed at version V: sequence i started at version V - (i mod (W+1)) and
    its generated tokens are split evenly over the versions from its start to V."""
    rng = np.random.RandomState(seed)
    items = []
    for i in range(batch):
        start = max(0, V - (i % (W + 1)))
        span = np.arange(start, V + 1)
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


def upto_version(items: list[OldLogitItem], v: int) -> list[OldLogitItem]:
    """Each item cut after its last token of version <= v, with only version-v tokens to score
    (the segment that finishes, or the prefix that is in flight, when v is superseded)."""
    out = []
    for it in items:
        idx = np.flatnonzero((it.versions >= 0) & (it.versions <= v))
        if not idx.size or not (it.versions == v).any():
            continue
        k = int(idx.max()) + 1
        out.append(
            OldLogitItem(
                trajectory_id=it.trajectory_id,
                token_ids=it.token_ids[:k],
                loss_mask=(it.versions[:k] == v).astype(np.int8),
                versions=it.versions[:k],
            )
        )
    return out


def learner_step_seconds(model: torch.nn.Module, items: list[OldLogitItem], reps: int = 2) -> float:
    """A real learner step on the batch (forward + backward + AdamW), the reference for overheads."""
    ids, mask = right_padded(items)
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-6)
    saved = [p.detach().clone() for p in params]
    times = []
    model.train()
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        lp = sequence_logprobs(model, ids, mask, TEMPERATURE)
        (-lp.sum() / mask.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    model.eval()
    with torch.no_grad():
        for p, s in zip(params, saved, strict=True):
            p.copy_(s)
    del opt
    return float(np.mean(times[1:]))


class _Clock:
    """Per-step wall and CPU seconds of one route (CPU time: robust when the box is shared)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.forwards = 0
        self.exact: list[float] = []

    def new_step(self) -> None:
        self.steps.append({"update_wall": 0.0, "update_cpu": 0.0, "score_wall": 0.0, "score_cpu": 0.0})

    def run(self, kind: str, fn, *args: Any, **kw: Any) -> Any:
        w, c = time.perf_counter(), time.process_time()
        out = fn(*args, **kw)
        if self.steps:
            self.steps[-1][f"{kind}_wall"] += time.perf_counter() - w
            self.steps[-1][f"{kind}_cpu"] += time.process_time() - c
        return out

    def median(self, key: str) -> float:
        return float(np.median([st[key] for st in self.steps]))

    def median_total(self, clock: str) -> float:
        return float(np.median([st[f"update_{clock}"] + st[f"score_{clock}"] for st in self.steps]))


def _ewma_logprobs(ewma: Any, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = ewma.forward(model, input_ids=ids, attention_mask=mask).logits
        return torch.log_softmax(logits[:, :-1].float() / TEMPERATURE, -1).gather(-1, ids[:, 1:, None])


def bench_model(
    name: str, folder: Path, windows: list[int], steps: int, batch: int, prompt: int, gen: int
) -> dict[str, Any]:
    """Run every route and PPO-EWMA side by side on one model for each W; returns rows of the table."""
    learner = load_causal_lm(folder)
    vocab = int(learner.get_input_embeddings().weight.shape[0])
    n_params = sum(p.numel() for p in learner.parameters())
    step_s = learner_step_seconds(learner, make_batch(vocab, batch, prompt, gen, 4, 2, 0))
    rows: list[dict[str, Any]] = []
    ewma_impl = ""
    for W in windows:
        services = {
            r: OldLogitService(folder, route=r, max_staleness=W)
            for r in ("snapshot", "old_logit_model", "interrupt_sync")
        }
        ewma, ewma_impl = make_ewma(learner, W)
        clocks = {r: _Clock() for r in (*services, "ppo_ewma")}
        V = 0
        for k in range(W + steps):  # the first W steps fill the snapshot store; the rest are measured
            if k >= W:
                for c in clocks.values():
                    c.new_step()
            # segments finishing (old_logit_model) / prefixes in flight (interrupt_sync) at the
            # outgoing version V are scored before V + 1 lands
            items_prev = make_batch(vocab, batch, prompt, gen, V, W, seed=V)
            sub = upto_version(items_prev, V)
            for r in ("old_logit_model", "interrupt_sync"):
                svc = services[r]
                f0 = svc.forwards
                clocks[r].run("score", svc.score_prefixes, sub, TEMPERATURE)
                clocks[r].forwards += (svc.forwards - f0) if clocks[r].steps else 0
            fake_step(learner, seed=V + 1)
            V += 1
            man, pay = pack_weights(learner.state_dict().items(), V)
            for r, svc in services.items():
                clocks[r].run("update", svc.update_weights, man, pay)
            clocks["ppo_ewma"].run("update", ewma.update, learner)
            # the learner consumes a batch of partial rollouts spanning [V - W, V]
            items = make_batch(vocab, batch, prompt, gen, V, W, seed=1000 + V)
            svc = services["snapshot"]
            f0 = svc.forwards
            ans = clocks["snapshot"].run(
                "score", svc.score, OldLogitRequest(request_id=f"b{V}", temperature=TEMPERATURE, items=items)
            )
            if clocks["snapshot"].steps:
                clocks["snapshot"].forwards += svc.forwards - f0
                clocks["snapshot"].exact.append(ans.exact_token_fraction())
            ids, mask = right_padded(items)
            clocks["ppo_ewma"].run("score", _ewma_logprobs, ewma, learner, ids, mask)
            clocks["ppo_ewma"].forwards += 1 if clocks["ppo_ewma"].steps else 0
        held = {r: s.bytes_held for r, s in services.items()}
        held["ppo_ewma"] = int(ewma.nbytes)
        for r, c in clocks.items():
            rows.append(
                {
                    "model": name,
                    "params": n_params,
                    "W": W,
                    "route": r,
                    "bytes_held": held[r],
                    "copies": held[r] / (n_params * 4),
                    "seconds_per_step": c.median_total("wall"),
                    "cpu_seconds_per_step": c.median_total("cpu"),
                    "update_s": c.median("update_wall"),
                    "score_s": c.median("score_wall"),
                    "update_cpu_s": c.median("update_cpu"),
                    "score_cpu_s": c.median("score_cpu"),
                    "forwards_per_step": c.forwards / steps,
                    "exact_token_fraction": float(np.mean(c.exact)) if c.exact else (0.0 if r == "ppo_ewma" else 1.0),
                    "overhead_vs_learner_step": c.median_total("wall") / step_s,
                    "blocks": BLOCKS[r],
                }
            )
        del services, ewma
    return {
        "model": name,
        "params": n_params,
        "learner_step_s": step_s,
        "ewma_impl": ewma_impl,
        "batch": batch,
        "prompt": prompt,
        "gen": gen,
        "steps": steps,
        "rows": rows,
    }


def ratios(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for W in sorted({r["W"] for r in result["rows"]}):
        by = {r["route"]: r for r in result["rows"] if r["W"] == W}
        e = by["ppo_ewma"]
        for route in ("snapshot", "old_logit_model", "interrupt_sync"):
            out.append(
                {
                    "model": result["model"],
                    "W": W,
                    "route": route,
                    "memory_ratio_vs_ewma": by[route]["bytes_held"] / e["bytes_held"],
                    "time_ratio_vs_ewma": by[route]["seconds_per_step"] / e["seconds_per_step"],
                    "cpu_time_ratio_vs_ewma": by[route]["cpu_seconds_per_step"] / e["cpu_seconds_per_step"],
                }
            )
    return out


def print_table(results: list[dict[str, Any]]) -> None:
    """Medians per step: wall seconds (update = receive + copy weights, score = forwards) and CPU seconds."""
    print(
        f"\n{'model':5} {'W':>2} {'route':16} {'MiB':>7} {'copies':>6} {'s/step':>7} {'update':>7} {'score':>7} {'cpu s':>7} "
        f"{'fwd':>4} {'exact':>5} {'%step':>6} {'mem/EWMA':>8} {'t/EWMA':>7} {'cpu/EWMA':>8}"
    )
    for res in results:
        rat = {(r["W"], r["route"]): r for r in ratios(res)}
        for r in res["rows"]:
            q = rat.get(
                (r["W"], r["route"]),
                {"memory_ratio_vs_ewma": 1.0, "time_ratio_vs_ewma": 1.0, "cpu_time_ratio_vs_ewma": 1.0},
            )
            print(
                f"{r['model']:5} {r['W']:>2} {r['route']:16} {r['bytes_held'] / 2**20:7.1f} {r['copies']:6.2f} {r['seconds_per_step']:7.3f} "
                f"{r['update_s']:7.3f} {r['score_s']:7.3f} {r['cpu_seconds_per_step']:7.3f} {r['forwards_per_step']:4.1f} "
                f"{r['exact_token_fraction']:5.2f} {100 * r['overhead_vs_learner_step']:5.1f}% {q['memory_ratio_vs_ewma']:7.2f}x "
                f"{q['time_ratio_vs_ewma']:6.2f}x {q['cpu_time_ratio_vs_ewma']:7.2f}x"
            )
        print(
            f"  ({res['model']}: {res['params'] / 1e6:.1f}M params, learner step (fwd+bwd+AdamW) {res['learner_step_s']:.3f} s on batch "
            f"{res['batch']}x{res['prompt'] + res['gen']}, medians of {res['steps']} steps, EWMA = {res['ewma_impl']})"
        )
    print(
        f"paper ({PAPER['model']}): snapshot = {PAPER['memory_ratio']}x memory, {PAPER['time_ratio']}x time of PPO-EWMA"
    )
    print("update = verify (blake2b) + copy of the published weights; score = the route's forwards; cpu = process CPU")
    print(
        "seconds (robust on a shared box); seconds land on: " + "; ".join(f"{k}: {v}" for k, v in BLOCKS.items()) + "\n"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["tiny", "real", "both"], default="tiny")
    ap.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=4, help="measured steps per window (after W warm-up steps)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--gen", type=int, default=96)
    ap.add_argument("--real-batch", type=int, default=5, help="batch for the real model (CPU time)")
    ap.add_argument("--real-gen", type=int, default=40)
    ap.add_argument("--out", type=Path, default=Path("runs/bench/oldlogit.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    results = []
    t0 = time.perf_counter()
    if args.model in ("tiny", "both"):
        real = prepare_smollm2()
        results.append(
            bench_model(
                "tiny",
                make_tiny_model(seed=0, tokenizer_from=real),
                args.windows,
                args.steps,
                args.batch,
                args.prompt,
                args.gen,
            )
        )
    if args.model in ("real", "both"):
        results.append(
            bench_model(
                "real",
                prepare_smollm2(),
                args.windows,
                max(2, args.steps // 2),
                args.real_batch,
                args.prompt,
                args.real_gen,
            )
        )
    print_table(results)
    out = {
        "bench": "oldlogit",
        "paper": PAPER,
        "results": results,
        "ratios": [q for r in results for q in ratios(r)],
        "env": machine_facts(t0),
        "notes": "memory = bytes of weight copies held (tied tensors once); seconds = extra wall seconds per training step "
        "(weight receive + scoring); snapshot forwards = distinct versions in the batch; single-replica routes "
        "score each token once, at its version, before it is superseded",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
