"""``vintage bench ...``: the benchmarks that compare methods, routes or systems side by side; each
command hands its options to the benchmark module named in its help."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from vintage_cli.output import console

bench_app = typer.Typer(help="Benchmarks that compare methods or routes side by side.", no_args_is_help=True)


@bench_app.command("methods")
def bench_methods(
    out: Annotated[Path, typer.Option(help="Results folder (JSON, markdown table, PNG plots).")] = Path(
        "results/methods"
    ),
    quick: Annotated[bool, typer.Option(help="The CI-sized smoke grid (same as --grid quick).")] = False,
    grid: Annotated[
        str,
        typer.Option(
            help="Which grid: quick, reduced, seeds, lr, eps, full, confirm, paper, paper_lr, paper_real, paper_agent, verdict (see benchmarks/methods_grid.py)."
        ),
    ] = "full",
) -> None:
    """Methods x staleness x discrepancy on the real pipeline; writes results under --out.

    Grids run into the same --out pool into one table (e.g. ``reduced`` then ``seeds``).
    """
    from benchmarks.methods import main as methods_main
    from benchmarks.methods_grid import GRIDS
    from trainer.driver.cluster.netguard import reexec_with_loopback

    if grid not in GRIDS:
        raise typer.BadParameter(f"grid={grid!r} is not one of {', '.join(GRIDS)}", param_hint="--grid")
    reexec_with_loopback()  # the cells' private clusters, this driver included, listen on loopback only
    methods_main(out_dir=out, quick=quick, console=console, kind=grid)


@bench_app.command("oracle")
def bench_oracle(
    out: Annotated[Path, typer.Option(help="Results folder (oracle.json, README.md).")] = Path("results/oracle"),
) -> None:
    """The exact oracle: every correction's expected update on a softmax bandit, lags 0-8, no sampling."""
    from benchmarks.oracle import main as oracle_main

    oracle_main(["--out", str(out)])


@bench_app.command("publish")
def bench_publish(
    fast: Annotated[bool, typer.Option(help="The tiny model only (skip SmolLM2).")] = False,
    repeats: Annotated[int, typer.Option(min=1, help="Best of this many runs per phase.")] = 3,
    versions: Annotated[int, typer.Option(min=1, help="End-to-end publications per path.")] = 3,
    out: Annotated[Path, typer.Option(help="JSON results file.")] = Path("runs/bench/publish.json"),
) -> None:
    """Weight publication per phase and end to end, previous path vs current, with a memory-copy reference."""
    from benchmarks.bench_publish import main as publish_main

    publish_main(
        [*(["--fast"] if fast else []), "--repeats", str(repeats), "--versions", str(versions), "--out", str(out)]
    )


@bench_app.command("memory")
def bench_memory(
    model: Annotated[str, typer.Option(help="tiny (the tiny random Llama) or real (SmolLM2-135M).")] = "tiny",
    batch: Annotated[int, typer.Option(min=1, help="Sequences in the micro-batch.")] = 4,
    seq: Annotated[int, typer.Option(min=2, help="Tokens per sequence.")] = 1024,
    out: Annotated[Path, typer.Option(help="JSON results file.")] = Path("runs/bench/memory.json"),
) -> None:
    """Peak memory of one micro-batch's log-probs (train and no-grad scoring), full logits vs chunked."""
    from benchmarks.bench_memory import main as memory_main

    memory_main(["--model", model, "--batch", str(batch), "--seq", str(seq), "--out", str(out)])


@bench_app.command("job-memory")
def bench_job_memory(
    seed: Annotated[int, typer.Option(help="controller.seed of every run.")] = 1,
    steps: Annotated[int, typer.Option(min=1, help="controller.total_steps of each run.")] = 8,
    variants: Annotated[
        list[str] | None,
        typer.Option(help="default, checkpointing, kv1, both, mmap, mmap8m (repeat the option; default all)."),
    ] = None,
    out: Annotated[Path, typer.Option(help="JSON results file.")] = Path("runs/bench/job_memory.json"),
) -> None:
    """A whole job's peak memory by part (learner, workers, old-logit service, driver, job), the demo
    config under settings that trade memory for time, one short run each (see benchmarks/bench_job_memory.py)."""
    from benchmarks.bench_job_memory import main as job_memory_main

    chosen = ["--variants", *variants] if variants else []
    job_memory_main(["--seed", str(seed), "--steps", str(steps), *chosen, "--out", str(out)])


@bench_app.command("learner")
def bench_learner(
    model: Annotated[str, typer.Option(help="tiny (the tiny random Llama) or real (SmolLM2-135M).")] = "tiny",
    method: Annotated[str, typer.Option(help="Loss method of both steps (the demo's: snapshot).")] = "snapshot",
    batch: Annotated[int, typer.Option(min=1, help="Sequences in the batch (one micro-batch).")] = 16,
    prompt: Annotated[int, typer.Option(min=1, help="Prompt tokens per sequence.")] = 64,
    completion: Annotated[int, typer.Option(min=1, help="Longest completion, tokens.")] = 32,
    threads: Annotated[int, typer.Option(min=1, help="Torch threads of both steps.")] = 1,
    repeats: Annotated[int, typer.Option(min=1, help="Repeats of both steps; the first is warm-up.")] = 5,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
    pack: Annotated[bool, typer.Option(help="The learner packs its rows (learner.pack_sequences).")] = False,
    out: Annotated[Path, typer.Option(help="JSON results file.")] = Path("runs/bench/learner.json"),
) -> None:
    """The learner's training step vs a plain PyTorch step (HF forward, the same loss, backward,
    fused AdamW) on the same batch, dtype and threads, and the learner's step split into its parts;
    prints a table, writes JSON (see benchmarks/bench_learner.py)."""
    from benchmarks.bench_learner import main as learner_main

    argv = ["--model", model, "--method", method, "--batch", str(batch), "--prompt", str(prompt)]
    argv += ["--completion", str(completion), "--threads", str(threads), "--repeats", str(repeats)]
    learner_main([*argv, "--dtype", dtype, *(["--pack"] if pack else []), "--out", str(out)])


@bench_app.command("trl")
def bench_trl(
    budget_s: Annotated[
        float | None, typer.Option(help="Wall seconds per system, start-up included (default 600; --quick 90).")
    ] = None,
    quick: Annotated[
        bool, typer.Option(help="Smoke check: the tiny model, a short budget, 16 held-out prompts.")
    ] = False,
    eval_prompts: Annotated[
        int | None, typer.Option(help="Held-out prompts scored greedily for both (default 200; --quick 16).")
    ] = None,
    config: Annotated[Path, typer.Option(help="vintage config both systems are set up from.")] = Path(
        "deploy/configs/demo.toml"
    ),
    out: Annotated[Path | None, typer.Option(help="Result JSON (default runs/bench/vs_trl.json).")] = None,
    keep: Annotated[bool, typer.Option(help="Keep vintage's checkpoint and TRL's final model.")] = False,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="section.field=value over the config (repeatable), both sides.")
    ] = None,
) -> None:
    """vintage vs TRL's GRPOTrainer: same model, task, prompts and settings, same wall-clock budget.

    Needs the optional ``trl`` group (``make bench-trl`` installs it). Prints the side-by-side table
    and writes the JSON with the ratios (see benchmarks/bench_vs_trl.py).
    """
    from benchmarks.bench_vs_trl import main as trl_main

    try:
        trl_main(budget_s, quick, eval_prompts, config, out, keep, log=console.print, overrides=set_)
    except (ModuleNotFoundError, ValueError) as e:
        console.print(f"[red]bench trl:[/red] {e}", soft_wrap=True)
        raise typer.Exit(2) from None
    except RuntimeError as e:
        console.print(f"[red]bench trl failed:[/red] {e}", soft_wrap=True)
        raise typer.Exit(1) from None


@bench_app.command("lora")
def bench_lora(
    windows: Annotated[list[int] | None, typer.Option(help="Staleness windows W (repeatable).")] = None,
    rank: Annotated[int, typer.Option(min=1, help="LoRA rank.")] = 8,
    alpha: Annotated[float, typer.Option(help="LoRA alpha.")] = 16.0,
    steps: Annotated[int, typer.Option(min=1, help="Measured steps per window and route.")] = 3,
    out: Annotated[Path, typer.Option(help="JSON results.")] = Path("runs/bench/lora.json"),
) -> None:
    """LoRA vs full weights on SmolLM2: old-logit memory (snapshots, adapter snapshots, PPO-EWMA),
    publication bytes and seconds, old-logit seconds per step; prints a table, writes JSON."""
    from benchmarks.bench_lora import main as lora_main

    argv = ["--rank", str(rank), "--alpha", str(alpha), "--steps", str(steps), "--out", str(out)]
    if windows:
        argv += ["--windows", *map(str, windows)]
    lora_main(argv)


@bench_app.command("latency")
def bench_latency(
    tool_latency: Annotated[
        list[float] | None, typer.Option(help="Seconds per tool call (repeatable; default 0.5 and 2.0).")
    ] = None,
    model: Annotated[str, typer.Option(help="tiny (random 2-layer Llama, fast) or smollm2.")] = "tiny",
    engine: Annotated[str, typer.Option(help="transformers or vllm.")] = "transformers",
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps per run (equal in both modes).")] = 4,
    tool_calls: Annotated[int, typer.Option(min=2, help="Tool rounds per episode.")] = 2,
    max_staleness: Annotated[int, typer.Option(min=1, help="controller.max_staleness of the async run.")] = 2,
    out: Annotated[Path, typer.Option(help="JSON results file.")] = Path("results/agent_latency.json"),
) -> None:
    """Agents whose tools wait: async vs synchronous seconds per step and tokens/s per tool latency,
    through the gateway with the openai client; prints a table, writes JSON (see benchmarks/bench_agent_latency.py)."""
    from benchmarks.bench_agent_latency import main as latency_main

    argv = ["--model", model, "--engine", engine, "--steps", str(steps), "--tool-calls", str(tool_calls)]
    argv += ["--max-staleness", str(max_staleness), "--out", str(out)]
    if tool_latency:
        argv += ["--tool-latency", *map(str, tool_latency)]
    latency_main(argv)


@bench_app.command("gateway-load")
def bench_gateway_load(
    sessions: Annotated[int, typer.Option(min=1, help="Concurrent agent sessions per round.")] = 64,
    calls: Annotated[int, typer.Option(min=1, help="Good chat calls per session.")] = 3,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds of sessions (RSS is read after each).")] = 2,
    max_tokens: Annotated[int, typer.Option(min=1, help="Completion budget of a good call.")] = 8,
    model: Annotated[str, typer.Option(help="tiny (random 2-layer Llama, fast), smollm2 or an HF folder.")] = "tiny",
    engine: Annotated[str, typer.Option(help="transformers or vllm.")] = "transformers",
    out: Annotated[Path, typer.Option(help="JSON results file.")] = Path("results/gateway_load.json"),
) -> None:
    """The gateway under load over HTTP on 127.0.0.1: concurrent sessions with ~10% malformed,
    unauthorised, over-long and abandoned calls; leaks, refusals by kind, p50/p99 latency (see
    benchmarks/bench_gateway_load.py)."""
    from benchmarks.bench_gateway_load import main as load_main

    argv = ["--sessions", str(sessions), "--calls", str(calls), "--rounds", str(rounds)]
    argv += ["--max-tokens", str(max_tokens), "--model", model, "--engine", engine, "--out", str(out)]
    load_main(argv)


@bench_app.command("cores")
def bench_cores(
    model: Annotated[str, typer.Option(help="tiny (random 2-layer Llama) or smollm2.")] = "tiny",
    steps: Annotated[int, typer.Option(min=2, help="Learner steps per run (the first is left out as warm-up).")] = 8,
    out: Annotated[Path, typer.Option(help="JSON results file.")] = Path("runs/bench/cores.json"),
) -> None:
    """The learner's seconds per step alone vs inside the asynchronous loop, one thread each vs the
    thread plan of the ``machine`` table; prints a table, writes JSON (see benchmarks/bench_cores.py)."""
    from benchmarks.bench_cores import main as cores_main

    cores_main(["--model", model, "--steps", str(steps), "--out", str(out)])


@bench_app.command("soak")
def bench_soak(
    minutes: Annotated[float, typer.Option(help="Soak length, shared by the env and agent phases.")] = 30.0,
    kill_every: Annotated[
        tuple[float, float], typer.Option(help="Seconds between kills: drawn uniformly from LO HI.")
    ] = (60.0, 120.0),
    seed: Annotated[int, typer.Option(help="Seed of the kill schedule.")] = 0,
    max_kills: Annotated[int, typer.Option(min=0, help="Most kills over the soak.")] = 30,
    phases: Annotated[list[str] | None, typer.Option(help="env and/or agent (repeatable; default both).")] = None,
    out: Annotated[Path, typer.Option(help="JSON results file.")] = Path("results/soak.json"),
) -> None:
    """Chaos soak: the tiny model trains on a two-node loopback cluster while a rollout worker, the
    old-logit service, the learner, an outside agent or a node is killed; prints what each kill did,
    the ledger check and memory growth, writes JSON (see benchmarks/bench_soak.py)."""
    from benchmarks.bench_soak import main as soak_main

    argv = ["--minutes", str(minutes), "--kill-every", *map(str, kill_every), "--seed", str(seed)]
    argv += ["--max-kills", str(max_kills), "--out", str(out)]
    if phases:
        argv += ["--phases", *phases]
    soak_main(argv)
