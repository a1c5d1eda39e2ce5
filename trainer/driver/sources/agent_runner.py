"""Runs OpenAI-API agents against the gateway and hands their sessions to the training loop.

The job holds it as its trajectory source under ``[agent]`` (:class:`trainer.driver.sources.source.AgentSource`);
the loop reaches three things through it:

* :meth:`AgentRunner.top_up` - admit new episodes under the staleness admission rule (whole groups
  of ``rollout.sampling.n`` episodes of one task, up to ``agent.concurrency`` running);
* :meth:`AgentRunner.poll` - trajectories of ended sessions (one per session, or one per segment
  when a session split), with the buffer's accounting kept: every admitted session is consumed,
  dropped with a reason (``no_calls``, ``agent_error``, ``agent_timeout``, ...) or still open;
* :meth:`AgentRunner.evaluate` - the same agent on held-out tasks (evaluation sessions are never
  trained on), mean reward and success rate.

Agents are ``async def run(task: dict, client: openai.AsyncOpenAI) -> float | dict`` (a dict has
the reward under ``"reward"``), run on one asyncio loop in a background thread; each episode gets
its own session and a client whose ``base_url`` is the session's ``/sessions/{id}/v1`` and whose API
key is the session key.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import itertools
import json
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from protocol import RolloutRequest, Trajectory
from trainer.driver.config.schema import JobConfig
from trainer.driver.sources.buffer import TrajectoryBuffer, admission_capacity


def load_agent(path: str) -> Callable[..., Any]:
    """Import ``package.module:attr`` and check it is an ``async def run(task, client)``.

    Raises:
        ValueError: the path is malformed, or the attribute is not a coroutine function of two arguments.
        ImportError: the module cannot be imported.
    """
    mod, _, attr = path.partition(":")
    if not mod or not attr:
        raise ValueError(f"agent.path: {path!r} is not 'package.module:attr'")
    fn = getattr(importlib.import_module(mod), attr, None)
    if fn is None:
        raise ValueError(f"agent.path: module {mod!r} has no attribute {attr!r}")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"agent.path: {path!r} is not an async function (async def run(task, client))")
    if len(inspect.signature(fn).parameters) < 2:
        raise ValueError(f"agent.path: {path!r} must take (task, client)")
    return fn


def episode_reward(result: Any) -> float:
    """The reward of an agent's return value (a number, or a dict with ``"reward"``).

    Raises:
        ValueError: no finite reward in the result.
    """
    r = result.get("reward") if isinstance(result, dict) else result
    if isinstance(r, bool) or not isinstance(r, int | float) or not math.isfinite(r):
        raise ValueError(f"agent result: expected a finite reward (float or {{'reward': float}}), got {result!r}")
    return float(r)


def read_tasks(path: str) -> list[dict[str, Any]]:
    """Task objects of a JSONL file, one per non-empty line.

    Raises:
        FileNotFoundError: no such file. ValueError: a line is not a JSON object (names the line).
    """
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"agent.tasks: {path}:{i} is not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"agent.tasks: {path}:{i} is not a JSON object")
        out.append(obj)
    if not out:
        raise ValueError(f"agent.tasks: {path} holds no task")
    return out


def task_sources(cfg: JobConfig) -> tuple[Callable[[int], dict[str, Any]], list[dict[str, Any]]]:
    """``(train_task(i), held_out_tasks)`` of the job's ``[agent]`` task source (see ``AgentConfig.tasks``),
    each task with ``agent.task_fields`` added under its own fields."""
    a, e = cfg.agent, cfg.env
    if a.tasks == "env":
        env = {"path": e.path, "kwargs": dict(e.kwargs)}
        train_tasks = None
        held = [{"env": env, "seed": s} for s in range(e.train_seeds, e.train_seeds + e.eval_prompts)]
    else:
        train_tasks = read_tasks(a.tasks)
        if a.eval_tasks is not None:
            held = read_tasks(a.eval_tasks)
        else:
            k = min(e.eval_prompts, len(train_tasks) - 1)
            train_tasks, held = (train_tasks[:-k], train_tasks[-k:]) if k > 0 else (train_tasks, [])

    def train(i: int) -> dict[str, Any]:
        task = {"env": env, "seed": i % e.train_seeds} if train_tasks is None else train_tasks[i % len(train_tasks)]
        return {**a.task_fields, **task}

    return train, [{**a.task_fields, **t} for t in held]


class AgentRunner:
    """The gateway plus the agents of one job (see the module docstring).

    Args:
        cfg: the job config (``cfg.agent`` must be set).
        submit: ``submit(list[RolloutRequest]) -> int`` of the rollout workers.
        poll: ``poll() -> list[Trajectory]`` of the same.
        version: the learner's current version.
        buffer: the job's trajectory buffer (admission and accounting).
        model_path: HF folder of the served model (its tokenizer renders the chat template).
        max_model_len: context length of the engines.
        lost: ``lost() -> list[str]``: ids of requests lost with a worker since the last call (a
            ``WorkerPool``'s ``take_lost_requests``); the gateway submits those calls again.
        admission_version: the version the admission rule counts from (the oldest the rollout
            workers still serve, :attr:`trainer.driver.loop.parts.Job.admission_version`); default ``version``.
    """

    def __init__(
        self,
        cfg: JobConfig,
        submit: Callable[[list[RolloutRequest]], int],
        poll: Callable[[], list[Trajectory]],
        version: Callable[[], int],
        buffer: TrajectoryBuffer,
        model_path: str | Path,
        max_model_len: int,
        lost: Callable[[], list[str]] | None = None,
        admission_version: Callable[[], int] | None = None,
    ):
        from transformers import AutoTokenizer

        from rollout.agent import TemplateChatFormat
        from rollout.gateway import Gateway, GatewayServer, WorkerBackend

        if cfg.agent is None:
            raise ValueError("agent: the config has no [agent] section")
        self.cfg, self.buffer, self.version = cfg, buffer, version
        self.admission_version = admission_version or version
        self.fn = load_agent(cfg.agent.path) if cfg.agent.path else None  # None: outside agents only
        self.train_task, self.held_out = task_sources(cfg)
        s, c = cfg.rollout.sampling, cfg.controller
        self.group_size, self.batch_size = s.n, c.batch_groups * s.n
        self._lock = threading.Lock()
        self.admitted = buffer.submitted  # sessions admitted so far (a resumed job continues its count)
        self._undrained = 0
        self.backend = WorkerBackend.from_config(submit, poll, version, cfg.gateway, lost=lost)
        self.gateway = Gateway.from_config(
            self.backend,
            TemplateChatFormat(AutoTokenizer.from_pretrained(str(model_path))),
            max_model_len,
            cfg.gateway,
            sampling=s,
            admission=self.admit,
        )
        self.server = GatewayServer.from_config(self.gateway, cfg.gateway).start()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vintage-agents", daemon=True)
        self._thread.start()
        self._train_ids: Iterator[int] = itertools.count(buffer.submitted // max(1, self.group_size))
        self._running: set = set()
        self.episodes = 0
        self.errors: Counter = Counter()
        self.last_error = ""

    @classmethod
    def for_job(cls, job: Any) -> AgentRunner:
        """The runner of a :class:`trainer.driver.loop.parts.Job` (its pool, buffer, version and model)."""
        return cls(
            job.cfg,
            job.pool.submit,
            job.pool.poll,
            lambda: job.version,
            job.buffer,
            job.model_path,
            job.pool.engine_config.max_model_len,
            lost=job.pool.take_lost_requests,
            admission_version=lambda: job.admission_version,
        )

    @property
    def url(self) -> str:
        """Base URL of the gateway (``<url>/v1`` is the OpenAI API root)."""
        return self.server.url

    # --- admission ---------------------------------------------------------------------------

    def admit(self, n: int) -> bool:
        """Admit ``n`` new training sessions if the staleness rule allows them now (thread-safe).

        The rule is :func:`trainer.driver.sources.buffer.admission_capacity` over admitted sessions not dropped: a
        session admitted while the rollout workers serve version ``V`` or later is consumed at most
        ``max_staleness`` versions after ``V``.
        """
        with self._lock:
            scheduled = self.admitted - self.buffer.dropped_total
            room = admission_capacity(
                self.admission_version(), self.cfg.controller.max_staleness, self.batch_size, scheduled
            )
            if room < n:
                return False
            self.admitted += n
            self._undrained += n
            return True

    def _drain(self) -> None:
        with self._lock:
            n, self._undrained = self._undrained, 0
        if n:
            self.buffer.note_submitted(n)

    # --- the loop's seam -----------------------------------------------------------------------

    def top_up(self) -> int:
        """Start as many new task groups as admission and ``agent.concurrency`` allow; returns episodes started."""
        started = 0
        self._running = {f for f in self._running if not f.done()}
        while self.fn is not None and len(self._running) + self.group_size <= max(
            self.cfg.agent.concurrency, self.group_size
        ):
            if not self.admit(self.group_size):
                break
            i = next(self._train_ids)
            task = self.train_task(i)
            group = f"v{self.version()}-t{i}"
            for _ in range(self.group_size):
                s = self.gateway.open_session(group_id=group, train=True, admit=False)
                s.info["task_index"] = i
                self._running.add(asyncio.run_coroutine_threadsafe(self._episode(s, task), self.loop))
                started += 1
        self._drain()
        return started

    def poll(self) -> list[Trajectory]:
        """Trajectories of training sessions ended since the last call (accounting kept, see the module)."""
        self._drain()
        out: list[Trajectory] = []
        for e in self.gateway.take_ended():
            if e.dropped is not None:
                self.buffer.note_lost(1, e.dropped)
                continue
            if len(e.trajectories) > 1:  # the extra segments of a split session enter the accounting here
                self.buffer.note_submitted(len(e.trajectories) - 1)
            out += e.trajectories
        out += self.backend.take_foreign()
        return out

    def evaluate(self, tag: str) -> dict[str, float]:
        """Mean reward and success rate (reward > 0.5) of the agent on the held-out tasks; ``{}`` if none."""
        if not self.held_out or self.fn is None:
            return {}
        t0 = time.perf_counter()

        async def all_tasks() -> list[float | None]:
            sem = asyncio.Semaphore(self.cfg.agent.concurrency)

            async def one(k: int, task: dict[str, Any]) -> float | None:
                async with sem:
                    s = self.gateway.open_session(group_id=f"eval-{tag}-{k}", train=False, admit=False)
                    return await self._episode(s, task)

            return await asyncio.gather(*(one(k, t) for k, t in enumerate(self.held_out)))

        rewards = asyncio.run_coroutine_threadsafe(all_tasks(), self.loop).result()
        ok = [r for r in rewards if r is not None]
        out = {
            "reward": sum(ok) / len(ok) if ok else float("nan"),
            "success_rate": sum(r > 0.5 for r in ok) / len(ok) if ok else float("nan"),
            "episodes": len(ok),
            "failed": len(rewards) - len(ok),
            "seconds": time.perf_counter() - t0,
        }
        return out

    async def _episode(self, session: Any, task: dict[str, Any]) -> float | None:
        """Run the agent on one task in ``session``; ends the session with the reward (or drops it)."""
        import openai

        from rollout.gateway import ApiError

        client = openai.AsyncOpenAI(
            base_url=f"{self.server.url}/sessions/{session.session_id}/v1",
            api_key=session.key,
            max_retries=0,
            timeout=self.cfg.agent.timeout_s,
        )
        reward, dropped = None, None
        try:
            result = await asyncio.wait_for(self.fn(dict(task), client), self.cfg.agent.timeout_s)
            reward = episode_reward(result)
        except TimeoutError:
            dropped = "agent_timeout"
        except Exception as e:  # the agent's own bug or a refused call: drop the episode, say why
            dropped = "agent_error"
            self.last_error = f"{type(e).__name__}: {e}"[:500]
        finally:
            await client.close()
        self.episodes += 1
        if dropped:
            self.errors[dropped] += 1
        try:
            self.gateway.end_session(session.session_id, reward=reward, dropped=dropped)
        except ApiError:  # the agent ended its session itself
            pass
        return reward

    def close(self) -> None:
        """Cancel running episodes, stop the gateway and the agents' loop."""
        for f in self._running:
            f.cancel()
        self.server.stop()
        self.backend.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
