"""Agents that wait: async vs synchronous training when tool calls take seconds, side by side.

    python -m benchmarks.bench_agent_latency [--model tiny|smollm2] [--tool-latency 0.5 2.0] [--steps 4]

The agent is :mod:`rollout.agents.calculator` (``[agent] path``): a real multi-turn episode with the
``openai`` client against the job's gateway, ``--tool-calls`` rounds (default 2) of one model call and
at least one calculator call each, then one call for the answer. Each calculator call waits
``--tool-latency`` seconds in ``asyncio.sleep`` (no CPU: a remote tool, a user simulator, an
environment). For every latency the same job (``trainer.driver.loop.job.run_job``: rollout worker, gateway,
DeepSpeed learner, snapshot old-logit service, equal ``--steps``) runs twice, differing only in
``controller.max_staleness``: 0, vintage's synchronous mode (a batch of episodes, then one learner step on
it, then the next batch), and ``--max-staleness`` (default 2), where the episodes of the next batches wait
on their tools while the learner trains. ``agent.concurrency`` is ``(max_staleness + 1)`` batches, so
admission, not the concurrency cap, bounds the episodes in flight.

Reported per latency and mode: wall seconds of the training loop per optimizer step (``loop_s / steps``,
as ``bench_async``: start-up excluded, the wait for the first batch included), trained tokens per second
(loss-masked sampled tokens over ``loop_s``), model calls per session, and the ratio async/sync of the
seconds per step (goal <= 0.5 at 2 s tools). Prints a table, writes ``results/agent_latency.json``
(with the machine's facts and its 1-minute load average before and after: the box may be shared).

Could TRL run the same agent? No. TRL is not installed in vintage's environment (the optional ``trl``
group pins 1.16.0); what follows is read from the source of the TRL 1.13.0 wheel
(``trl/trainer/grpo_trainer.py``, ``trl/experimental/async_grpo/``). ``GRPOTrainer`` takes
``tools=`` (sync or async callables), ``environment_factory=`` and an experimental ``rollout_func=``,
but: (1) it owns the conversation: a tool runs only when the model's own reply parses into a call,
and an agent written against the OpenAI API (this one) has no endpoint to call; ``rollout_func`` must
itself return ``prompt_ids``, ``completion_ids`` and ``logprobs``, i.e. the token recording the
gateway does; (2) tools need a chat template that renders ``tool_calls`` and ``tool`` turns
(``supports_tool_calling``), and SmolLM2's ChatML template renders only role and content, so the
trainer raises ``ValueError`` at construction; (3) the tool loop (``_tool_call_loop``) runs between
whole-batch generation passes and training waits for it: the tools of a batch's samples run one sample
after another (sync tools called in the per-sample loop, async ones gathered per sample and awaited
with a blocking ``.result()``), so a tool's wait is neither overlapped with training nor with other
samples' waits. The experimental ``AsyncGRPOTrainer`` overlaps generation and training, but needs a
vLLM server with NCCL weight transfer (CUDA) and refuses async tools ("Asynchronous tools are not
supported yet.").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

GOAL_LATENCY_S = 2.0
GOAL_RATIO = 0.5
"""Async seconds per step over sync seconds per step that asynchrony should reach with 2 s tools."""


def run_row(summary: dict[str, Any], latency_s: float, max_staleness: int) -> dict[str, Any]:
    """One run's row from ``run_job``'s summary: seconds per step (``loop_s / steps``), trained tokens
    per second (``tokens_total / loop_s``), model calls per ended session (NaN without one), and the
    summary's seconds per step from the first step's launch (``loop_s_per_step``: the first batch's
    generation left out)."""
    g, steps, loop_s = summary.get("gateway") or {}, max(int(summary["steps"]), 1), float(summary["loop_s"])
    ended = g.get("sessions_ended", 0)
    return {
        "tool_latency_s": latency_s,
        "mode": "sync" if max_staleness == 0 else "async",
        "max_staleness": max_staleness,
        "steps": int(summary["steps"]),
        "loop_s": loop_s,
        "s_per_step": loop_s / steps,
        "tokens_per_s": float(summary["tokens_total"]) / loop_s if loop_s > 0 else float("nan"),
        "after_first_batch_s_per_step": summary.get("loop_s_per_step"),
        "train_s_per_step": summary.get("train_s_per_step"),
        "model_calls_per_session": g.get("calls", 0) / ended if ended else float("nan"),
        "generated": summary.get("generated"),
        "consumed": summary.get("consumed"),
        "dropped": summary.get("dropped"),
    }


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sync and async rows paired per tool latency (in the order met) with ``async_over_sync`` =
    async ``s_per_step`` / sync ``s_per_step``. Example: sync 12 s, async 5 s per step -> 0.4167.

    Raises:
        ValueError: a latency lacks its sync or its async row.
    """
    out = []
    for lat in dict.fromkeys(r["tool_latency_s"] for r in rows):
        by_mode = {r["mode"]: r for r in rows if r["tool_latency_s"] == lat}
        if set(by_mode) != {"sync", "async"}:
            raise ValueError(f"tool_latency_s={lat}: need one sync and one async row, got {sorted(by_mode)}")
        s, a = by_mode["sync"], by_mode["async"]
        out.append({"tool_latency_s": lat, "sync": s, "async": a, "async_over_sync": a["s_per_step"] / s["s_per_step"]})
    return out


def goal_met(pairs: list[dict[str, Any]]) -> bool | None:
    """Whether ``async_over_sync <= GOAL_RATIO`` at ``GOAL_LATENCY_S`` (None when that latency was not run)."""
    at = [p for p in pairs if p["tool_latency_s"] == GOAL_LATENCY_S]
    return at[0]["async_over_sync"] <= GOAL_RATIO if at else None


def table(pairs: list[dict[str, Any]]) -> str:
    """The side-by-side table: per latency, s/step and tokens/s of sync and async, and their ratio."""
    lines = [
        f"{'tool s':>6} | {'sync s/step':>11} {'tok/s':>7} | {'async s/step':>12} {'tok/s':>7} | {'async/sync':>10}"
    ]
    for p in pairs:
        s, a = p["sync"], p["async"]
        lines.append(
            f"{p['tool_latency_s']:>6.2f} | {s['s_per_step']:>11.2f} {s['tokens_per_s']:>7.1f} | "
            f"{a['s_per_step']:>12.2f} {a['tokens_per_s']:>7.1f} | {p['async_over_sync']:>10.3f}"
        )
    return "\n".join(lines)


def write_tasks(path: Path, latency_s: float, tool_calls: int, max_tokens: int, count: int = 64) -> None:
    """``count`` calculator tasks of ``tool_calls + 1`` numbers each (seeded: the same in every run) as JSONL."""
    rng = random.Random(0)
    rows = [
        {
            "numbers": [rng.randint(1, 99) for _ in range(tool_calls + 1)],
            "tool_latency_s": latency_s,
            "max_tokens": max_tokens,
        }
        for _ in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def one_run(a: argparse.Namespace, latency_s: float, staleness: int) -> dict[str, Any]:
    """One job on the calculator agent at ``latency_s`` and ``staleness``; its row (see :func:`run_row`)."""
    from trainer.driver.config.schema import load_config
    from trainer.driver.loop.job import run_job

    run_dir = Path(tempfile.mkdtemp(prefix=f"vintage-latency-{latency_s}-{staleness}-"))
    write_tasks(run_dir / "tasks.jsonl", latency_s, a.tool_calls, a.max_tokens)
    batch = a.groups * a.group_size
    cfg = load_config(
        "deploy/configs/agent-retail.toml",
        [
            f'model.path="{a.model}"', f'rollout.engine="{a.engine}"', 'agent.path="rollout.agents.calculator:run"',
            f'agent.tasks="{run_dir / "tasks.jsonl"}"', f"agent.concurrency={(staleness + 1) * batch}",
            f"agent.timeout_s={a.run_timeout_s}", "env.eval_prompts=0", f"rollout.sampling.n={a.group_size}",
            f"rollout.sampling.max_tokens={a.max_tokens}", f"controller.total_steps={a.steps}",
            f"controller.batch_groups={a.groups}", f"controller.max_staleness={staleness}",
            f"controller.time_budget_s={a.run_timeout_s}", "server.enabled=false", "logging.trackers=[]",
            "logging.plots=false", f'logging.run_dir="{run_dir}"',
        ],
    )  # fmt: skip
    return run_row(run_job(cfg), latency_s, staleness)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the grid (see the module docstring), print the table, write ``--out``; returns the result."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny (random 2-layer Llama, fast) or smollm2")
    ap.add_argument("--engine", default="transformers", choices=["transformers", "vllm"])
    ap.add_argument("--tool-latency", type=float, nargs="+", default=[0.5, 2.0], help="seconds per tool call")
    ap.add_argument("--tool-calls", type=int, default=2, help="tool rounds per episode (>= 2)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2, help="task groups per step (controller.batch_groups)")
    ap.add_argument("--group-size", type=int, default=4, help="episodes per task (rollout.sampling.n)")
    ap.add_argument("--max-tokens", type=int, default=8, help="completion tokens per model call")
    ap.add_argument("--max-staleness", type=int, default=2, help="controller.max_staleness of the async run")
    ap.add_argument("--run-timeout-s", type=float, default=900.0, help="loop budget and episode timeout per run")
    ap.add_argument("--out", default="results/agent_latency.json")
    a = ap.parse_args(argv)
    if a.tool_calls < 2:
        ap.error(f"--tool-calls: {a.tool_calls} < 2 (an episode makes at least two tool calls)")
    if a.max_staleness < 1:
        ap.error(f"--max-staleness: {a.max_staleness} < 1 (0 is the synchronous run, always made)")
    if min(a.tool_latency) < 0:
        ap.error(f"--tool-latency: {min(a.tool_latency)} s is negative")

    from benchmarks.machine import machine_facts
    from trainer.driver.cluster.netguard import reexec_with_loopback

    reexec_with_loopback()  # the private cluster, this driver included, listens on loopback only
    t0, load_before = time.perf_counter(), os.getloadavg()[0]
    rows = [one_run(a, lat, s) for lat in a.tool_latency for s in (0, a.max_staleness)]
    pairs = compare(rows)
    result = {
        "model": a.model, "engine": a.engine, "steps": a.steps, "tool_calls_per_episode": a.tool_calls,
        "episodes_per_step": a.groups * a.group_size, "max_tokens": a.max_tokens, "async_max_staleness": a.max_staleness,
        "pairs": pairs, "goal": {"tool_latency_s": GOAL_LATENCY_S, "async_over_sync_max": GOAL_RATIO},
        "goal_met": goal_met(pairs), **machine_facts(t0), "load_average_1m": [load_before, os.getloadavg()[0]],
    }  # fmt: skip
    print(table(pairs))
    print(f"goal: async/sync <= {GOAL_RATIO} at {GOAL_LATENCY_S} s tools -> {result['goal_met']}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
