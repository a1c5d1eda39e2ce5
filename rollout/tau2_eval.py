"""tau2-bench evaluation of any OpenAI-compatible server: avg@k, pass@k and pass^k over k trials.

Each (task, trial) is one tau2 episode played by :func:`rollout.envs.tau2_bench.run` (tau2's own
orchestrator, tools and evaluator). A trial succeeds when its reward is 1 (within 1e-6, tau2's
``is_successful``). With ``n`` trials of a task, ``c`` of them successful, and ``T`` tasks:

* ``avg@k`` (k = n): mean over tasks of the mean success over the task's n trials,
  ``(1/T) sum_t c_t / n``; the same as tau2's ``avg_reward`` when rewards are 0/1, as they are in
  every tau2 reward basis used here;
* ``pass@k``: probability that at least one of k trials drawn without replacement from the n
  succeeds, ``1 - C(n - c, k) / C(n, k)``, averaged over tasks (the unbiased estimator of Chen et
  al., 2021, "Evaluating Large Language Models Trained on Code"); with n = k it is the fraction of
  tasks solved in at least one trial. This is the pass@k that RL papers report next to avg@k;
* ``pass^k``: probability that all k such trials succeed, ``C(c, k) / C(n, k)``, averaged over
  tasks (Yao et al., 2024, "tau-bench", arXiv 2406.12045, and tau2's leaderboard metric; tau2's
  own results file calls it ``pass_at_k``); with n = k it is the fraction of tasks solved in every
  trial.

``pass@1 = pass^1 = avg@k``. All three are reported for k = n, and pass@j / pass^j for every j <= n.
Episodes whose model call failed over HTTP are not scored: they are listed, and a task without all
n trials scored is left out of every metric (named in ``tasks_incomplete``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

SUCCESS_TOL = 1e-6


def is_success(reward: float) -> bool:
    """tau2's success rule: ``|reward - 1| <= 1e-6``."""
    return abs(reward - 1.0) <= SUCCESS_TOL


def pass_at_k(n: int, c: int, k: int) -> float:
    """At least one of k trials (of n, c successful) succeeds: ``1 - C(n-c, k) / C(n, k)``.

    Raises:
        ValueError: not ``0 <= c <= n`` or not ``1 <= k <= n``.
    """
    _check(n, c, k)
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """All of k trials (of n, c successful) succeed, tau-bench's pass^k: ``C(c, k) / C(n, k)``.

    Raises:
        ValueError: not ``0 <= c <= n`` or not ``1 <= k <= n``.
    """
    _check(n, c, k)
    return math.comb(c, k) / math.comb(n, k)


def _check(n: int, c: int, k: int) -> None:
    if not 0 <= c <= n:
        raise ValueError(f"successes: need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"k: need 1 <= k <= n, got k={k}, n={n}")


def summarize(rewards_by_task: dict[str, Sequence[float]], trials: int) -> dict[str, Any]:
    """avg@k, pass@j and pass^j (j = 1..trials) over the tasks that have all ``trials`` rewards.

    Args:
        rewards_by_task: task id -> its trials' rewards (in [0, 1]).
        trials: n, the trials each task should have.

    Returns:
        ``{"k", "num_tasks", "avg@k", "pass@k", "pass^k", "mean_reward", "pass@j": {j: v},
        "pass^j": {j: v}, "tasks_incomplete": [ids]}``; metrics are None when no task is complete.

    Raises:
        ValueError: ``trials < 1``, or a task with more than ``trials`` rewards.
    """
    if trials < 1:
        raise ValueError(f"trials: must be >= 1, got {trials}")
    complete, incomplete = {}, []
    for tid, rs in rewards_by_task.items():
        if len(rs) > trials:
            raise ValueError(f"rewards_by_task[{tid!r}]: {len(rs)} rewards for {trials} trials")
        if len(rs) == trials:
            complete[tid] = list(rs)
        else:
            incomplete.append(tid)
    out: dict[str, Any] = {"k": trials, "num_tasks": len(complete), "tasks_incomplete": sorted(incomplete)}
    if not complete:
        out.update({"avg@k": None, "pass@k": None, "pass^k": None, "mean_reward": None, "pass@j": {}, "pass^j": {}})
        return out
    counts = [sum(is_success(r) for r in rs) for rs in complete.values()]
    T = len(counts)
    out["avg@k"] = sum(c / trials for c in counts) / T
    out["mean_reward"] = sum(sum(rs) / trials for rs in complete.values()) / T
    out["pass@j"] = {j: sum(pass_at_k(trials, c, j) for c in counts) / T for j in range(1, trials + 1)}
    out["pass^j"] = {j: sum(pass_hat_k(trials, c, j) for c in counts) / T for j in range(1, trials + 1)}
    out["pass@k"] = out["pass@j"][trials]
    out["pass^k"] = out["pass^j"][trials]
    return out


async def play_all(tasks: list[dict[str, Any]], client: Any, concurrency: int, progress: bool = True) -> list[dict]:
    """Play every task dict against ``client`` with at most ``concurrency`` episodes at once.

    Returns one result per task dict, in order: :func:`rollout.envs.tau2_bench.play`'s dict, or
    ``{"task_id", "trial", "reward": None, "error": "http: ..."}`` where a model call failed.
    """
    import openai
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rollout.envs.tau2_bench import ModelCallError, run

    sem = asyncio.Semaphore(max(1, concurrency))
    results: list[dict | None] = [None] * len(tasks)
    done_rewards: list[float] = []

    with Progress(
        TextColumn("tau2 {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("success {task.fields[rate]}"),
        TimeElapsedColumn(),
        disable=not progress,
    ) as bar:
        job = bar.add_task(tasks[0]["domain"] if tasks else "", total=len(tasks), rate="-")

        async def one(i: int, task: dict) -> None:
            async with sem:
                try:
                    res = await run(task, client)
                except (openai.APIError, ModelCallError) as e:
                    res = {"task_id": task["task_id"], "trial": task.get("trial", 0), "reward": None}
                    res["error"] = f"http: {type(e).__name__}: {e}"[:500]
            results[i] = res
            if res["reward"] is not None:
                done_rewards.append(res["reward"])
            rate = f"{sum(map(is_success, done_rewards)) / len(done_rewards):.3f}" if done_rewards else "-"
            bar.update(job, advance=1, rate=rate)

        await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
    return [r for r in results if r is not None]


def evaluate(
    domain: str,
    base_url: str,
    api_key: str = "EMPTY",
    trials: int = 4,
    concurrency: int = 4,
    out: Path | None = None,
    progress: bool = True,
    split: str | None = None,
    task_ids: list[str] | None = None,
    num_tasks: int | None = None,
    tasks: list[dict[str, Any]] | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """Evaluate the model behind ``base_url`` on a tau2 domain: per-task results and totals.

    Args:
        domain: tau2 domain. base_url, api_key: the agent's OpenAI-compatible server.
        trials: k, episodes per task. concurrency: episodes in flight at once.
        out: write the report there as JSON (parent folders created).
        progress: show a rich progress bar.
        split, task_ids, num_tasks, **settings: task selection and :class:`Tau2Task` fields
            (``solo``, ``user``, ``agent_model``, ``temperature``, ``max_tokens``, ``max_steps``, ...).
        tasks: the task dicts, already selected by ``rollout.envs.tau2_bench.load_tasks`` with these
            arguments (a caller checks its arguments before starting a server); None selects them here.

    Returns:
        ``{"domain", "base_url", "trials", "settings", "totals": summarize(...), "tasks": [{"task_id",
        "rewards", "successes", "termination_reasons"}], "episodes": [...], "episodes_failed",
        "wall_s"}``.

    Raises:
        ValueError: bad domain, split, task id or setting (see ``load_tasks``).
    """
    import openai

    from rollout.envs.tau2_bench import load_tasks

    if tasks is None:
        tasks = load_tasks(domain, split=split, task_ids=task_ids, num_tasks=num_tasks, trials=trials, **settings)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key or "EMPTY", max_retries=0)
    start = time.perf_counter()
    episodes = asyncio.run(play_all(tasks, client, concurrency, progress))
    wall = time.perf_counter() - start

    per_task = per_task_results(tasks, episodes)
    totals = summarize({p["task_id"]: p["rewards"] for p in per_task}, trials)
    report = {
        "domain": domain, "split": split, "base_url": base_url, "trials": trials,
        "settings": _redacted(settings), "totals": totals, "tasks": per_task, "episodes": episodes,
        "episodes_failed": sum(e["reward"] is None for e in episodes), "wall_s": wall,
    }  # fmt: skip
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
    return report


def per_task_results(tasks: list[dict[str, Any]], episodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per task id, in the order of ``tasks``: its scored episodes' rewards by trial, how many
    were successes (:func:`is_success`) and their termination reasons; unscored episodes
    (``reward`` None) are left out. Example: trials with rewards 1.0, None, 0.0 -> rewards
    ``[1.0, 0.0]``, successes 1."""
    by_task: dict[str, list[dict]] = {t["task_id"]: [] for t in tasks}
    for e in episodes:
        by_task[e["task_id"]].append(e)
    rows = []
    for tid, eps in by_task.items():
        scored = [e for e in sorted(eps, key=lambda e: e["trial"]) if e["reward"] is not None]
        rows.append({
            "task_id": tid,
            "rewards": [e["reward"] for e in scored],
            "successes": sum(is_success(e["reward"]) for e in scored),
            "termination_reasons": [e.get("termination_reason") for e in scored],
        })  # fmt: skip
    return rows


def _redacted(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` as a report may show them: the user simulator's ``api_key`` left out."""
    out = {k: v for k, v in settings.items() if k != "user"}
    if settings.get("user"):
        out["user"] = {k: v for k, v in dict(settings["user"]).items() if k != "api_key"}
    return out


@contextlib.contextmanager
def serve_model(
    model_path: str,
    engine: str = "vllm",
    max_model_len: int = 4096,
    kv_cache_gib: int = 1,
    dtype: str = "float32",
    max_tokens: int = 256,
) -> Iterator[tuple[str, str, Any]]:
    """Serve a model folder through the gateway on 127.0.0.1 for as long as the block runs.

    One in-process rollout worker (``engine``: ``vllm`` or ``transformers``) behind a gateway whose
    admin token makes untracked calls (served, never trained on).

    Args:
        model_path: an HF folder, or ``smollm2`` / ``tiny`` (prepared by ``modelkit.modelhub``).
        max_model_len: engine context, tokens. kv_cache_gib: vLLM-on-CPU KV cache, GiB.
        max_tokens: completion budget of a call that gives none.

    Yields:
        ``(base_url, api_key, gateway)``: the gateway's ``.../v1`` URL, its admin token, and the
        :class:`rollout.gateway.Gateway` itself (sessions, ended trajectories, status).

    Raises:
        ImportError: this build has no gateway (``rollout.gateway``).
    """
    from modelkit.modelhub import make_tiny_model, prepare_smollm2
    from rollout import gateway as gw
    from rollout.engine import EngineConfig, make_engine
    from rollout.worker import RolloutWorkerCore

    if model_path == "smollm2":
        model_path = str(prepare_smollm2())
    elif model_path == "tiny":
        model_path = str(make_tiny_model(seed=0, tokenizer_from=prepare_smollm2()))
    cfg = EngineConfig(
        kind=engine, model_path=model_path, dtype=dtype, max_model_len=max_model_len, kv_cache_gib=kv_cache_gib
    )
    core = RolloutWorkerCore(make_engine(cfg))
    core.start()
    backend = gw.WorkerBackend.over_core(core)
    server = None
    try:
        gateway = gw.Gateway(backend, chat=core.chat, max_model_len=max_model_len, default_max_tokens=max_tokens)
        server = gw.GatewayServer(gateway).start()
        yield f"{server.url}/v1", gateway.admin_token, gateway
    finally:
        if server is not None:
            server.stop()
        backend.close()
        core.close()


__all__ = ["evaluate", "is_success", "pass_at_k", "pass_hat_k", "play_all", "serve_model", "summarize"]
