"""Assembly: start the parts of one job, in order, and hand them to :class:`trainer.driver.loop.parts.Job`.

    model folder      ``model.path`` (``smollm2``, ``tiny`` or a folder) and its ``vocab_size``
    learner           :class:`trainer.learner.LearnerGroup`, one rank per ``learner.world_size``
    old-logit service :class:`oldlogit_service.actor.OldLogitServer`, unless the route is ``none``,
                      started and wrapped by its route (:func:`trainer.driver.publication.routes.start_service`, ``make_route``)
    rollout workers   :class:`trainer.driver.workers.pool.WorkerPool` at ``rollout.num_workers``
    resume            ``controller.resume_from``: the learner's state, the buffer's accounting and
                      its saved trajectories, the source's cursor and held-back trajectories
                      (:mod:`trainer.driver.sources.resume`); the ledger notes what came back
    trajectory source agents through the gateway with ``[agent]``, else the env loop over the workers
                      (:mod:`trainer.driver.sources.source`)

Every part is chosen here once, from the config; the loop never asks which kind it holds. Every
consumer starts from the model folder (version 0); a resumed job publishes its version before the
first step (:func:`trainer.driver.loop.job._loop`). A part that does not start stops the assembly with
an error naming it; the parts already started stop with the job's Ray session.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from modelkit.cores import shared_box_warning
from rollout.envs import import_attr
from trainer.driver.config.schema import JobConfig, write_private
from trainer.driver.loop.parts import Job
from trainer.driver.publication.routes import Route, make_route, start_service
from trainer.driver.records.ledger import Ledger
from trainer.driver.sources.buffer import LOST_AT_RESTART, REPLAYED_AT_RESTART, TrajectoryBuffer
from trainer.driver.sources.resume import SavedTrajectories, read_trajectories
from trainer.driver.sources.source import AgentSource, EnvSource, TrajectorySource
from trainer.learner.ds_ops import clear_stale_build_locks

if TYPE_CHECKING:
    from rollout.engine import EngineConfig
    from trainer.driver.workers.pool import WorkerPool
    from trainer.learner import LearnerGroup, LearnerSettings


def start_job(cfg: JobConfig, console: Console) -> Job:
    """The parts of the job ``cfg`` started in order (see the module docstring), resumed from
    ``controller.resume_from`` when set. A machine already busy when the job starts gets a warning
    line when the thread plan assumes its cores (:func:`modelkit.cores.shared_box_warning`).

    Raises:
        FileNotFoundError: ``model.path`` is not an HF model folder; ``controller.resume_from`` has no
            complete checkpoint, or its checkpoint lists saved trajectories and the file is missing.
        ValueError: the checkpoint's ``trajectories.jsonl`` is malformed (one line naming the file and
            line, :func:`trainer.driver.sources.resume.read_trajectories`).
        pydantic.ValidationError: the learner settings refuse the combination.
        TimeoutError: the learner or the old-logit service did not start within
            ``controller.start_timeout_s``.
    """
    c = cfg.controller
    if msg := shared_box_warning(cfg.thread_plan(), os.getloadavg()[0]):  # the plan assumes the cores are the job's
        console.print(f"[yellow]{msg}[/yellow]")
    model_path = resolve_model(cfg)
    vocab_size = int(json.loads((model_path / "config.json").read_text())["vocab_size"])
    buffer = TrajectoryBuffer(
        capacity=c.buffer_capacity, max_staleness=c.max_staleness, keep_partly_stale=c.stale_trajectories == "mask"
    )
    learner = start_learner(cfg, learner_settings(cfg, model_path), console)
    route = make_route(
        cfg.oldlogit_route,
        start_service(cfg, model_path, console),
        cfg.oldlogit.restart_timeout_s,
        cfg.current_from_learner,
        scorer_dtype=cfg.learner.dtype,
        reference_version=0 if cfg.reference_in_service else None,
    )
    pool = start_workers(cfg, model_path, route, console)
    version = run_segment = lost_before = 0
    lost_reason = REPLAYED_AT_RESTART if source_kind(cfg) == "env" else LOST_AT_RESTART
    extra: dict[str, Any] = {}
    saved = SavedTrajectories([], [])
    if c.resume_from:
        tag, extra = resume_learner(learner, c.resume_from)
        counters = extra.get("buffer", {"submitted": 0, "consumed": 0, "dropped": {}})
        source_state = extra.get("source", {})
        saved = read_trajectories(
            Path(c.resume_from) / tag, counters.get("buffered_ids", []), source_state.get("held_back_ids", [])
        )
        lost_before = counters["dropped"].get(lost_reason, 0)
        units = source_state.get("held_back_units", len(saved.held_back))
        buffer.load_state_dict(counters, saved.buffered, pending=units, lost_reason=lost_reason)
        version, run_segment = learner.version(), int(extra.get("run_segment", 0)) + 1
        console.print(
            f"resumed from {c.resume_from} at version {version} (run segment {run_segment}): "
            f"{len(saved.buffered) + len(saved.held_back)} finished trajectories kept, "
            f"{buffer.dropped[lost_reason] - lost_before} in flight "
            + ("lost" if lost_reason == LOST_AT_RESTART else "whose prompts are generated again")
        )
    ledger = Ledger(cfg.logging.run_dir, run_segment, lambda: job.version)

    def source(j: Job) -> TrajectorySource:
        src = start_source(j, console)
        src.restore(extra.get("source", {}).get("cursor", {}), saved.held_back)
        return src

    buffer.ledger = ledger
    job = Job(
        cfg,
        console,
        model_path=model_path,
        vocab_size=vocab_size,
        learner=learner,
        route=route,
        pool=pool,
        buffer=buffer,
        version=version,
        run_segment=run_segment,
        source=source,
        ledger=ledger,
    )
    if c.resume_from:
        ledger(
            "resumed",
            [t.trajectory_id for t in saved.buffered + saved.held_back],
            tag=tag,
            **{lost_reason: buffer.dropped[lost_reason] - lost_before},
        )
    return job


def resume_learner(learner: LearnerGroup, directory: str) -> tuple[str, dict[str, Any]]:
    """Load the newest complete checkpoint of ``directory`` into ``learner``; its tag and ``extra``.

    Raises:
        FileNotFoundError: no complete checkpoint in ``directory``.
    """
    from trainer.learner.checkpoint import LATEST_FILE, latest_tag

    tag = latest_tag(directory)
    if tag is None:
        raise FileNotFoundError(
            f"controller.resume_from: no complete checkpoint in {directory} ({LATEST_FILE} missing)"
        )
    return tag, learner.load_checkpoint(directory, tag)


def resolve_model(cfg: JobConfig) -> Path:
    """The HF folder for ``model.path`` (``smollm2``, ``tiny`` or a folder): :func:`modelkit.modelhub.model_folder`.

    Raises:
        FileNotFoundError: a folder without ``config.json``.
    """
    from modelkit.modelhub import model_folder

    return model_folder(cfg.model.path, cfg.model.tiny_seed)


def learner_settings(cfg: JobConfig, model_path: Path) -> LearnerSettings:
    """The :class:`trainer.learner.LearnerSettings` of ``cfg`` for the model folder ``model_path``.

    The EWMA window is at least ``controller.max_staleness`` (the oldest consumable version); a
    decaying learning-rate schedule without ``learner.lr_decay_steps`` decays over the whole run
    (``controller.total_steps`` versions of ``ppo_epochs * ppo_mini_batches`` optimizer steps).

    Raises:
        pydantic.ValidationError: the settings refuse the combination (e.g. ``current_from_learner`` with
            several optimizer steps per batch).
    """
    from trainer.learner import LearnerOptions, LearnerSettings

    c, s = cfg.controller, cfg.rollout.sampling
    ewma = cfg.ewma.model_copy(update={"window": max(cfg.ewma.window, c.max_staleness)})
    options = cfg.learner.model_dump(include=set(LearnerOptions.model_fields))
    if options["lr_decay_steps"] is None and options["lr_schedule"] != "constant":
        # the decay reaches its floor at the run's last optimizer step
        options["lr_decay_steps"] = max(1, c.total_steps * cfg.learner.ppo_epochs * cfg.learner.ppo_mini_batches)
    return LearnerSettings(
        model_path=str(model_path),
        **options,
        loss=cfg.loss,
        ewma=ewma,
        temperature=s.temperature,
        max_token_staleness=cfg.token_staleness_limit,
        seed=c.seed,
        torch_threads=cfg.thread_plan().learner,
        lora=cfg.lora,
        current_from_learner=cfg.current_from_learner,
        reference_in_batch=cfg.reference_in_service,
    )


def start_learner(cfg: JobConfig, settings: LearnerSettings, console: Console) -> LearnerGroup:
    """The learner's ranks, started (a stale DeepSpeed build lock left by a killed build is removed
    first: it would hang the start).

    Raises:
        TimeoutError: a rank did not start within ``controller.start_timeout_s``.
    """
    from trainer.learner import LearnerGroup

    for lock in clear_stale_build_locks():
        console.print(f"removed a stale DeepSpeed build lock: {lock}")
    with console.status("starting learner ..."):
        return LearnerGroup(
            settings,
            world_size=cfg.learner.world_size,
            start_timeout_s=cfg.controller.start_timeout_s,
            **cfg.learner.actor_options(),
        )


def engine_config(cfg: JobConfig, model_path: Path | str) -> EngineConfig:
    """The engine every rollout worker of the job runs over the HF folder ``model_path``
    (``rollout.engine``, ``rollout.dtype``, ``rollout.max_num_seqs`` sequences,
    ``rollout.keep_requests_on_update``, ``controller.seed``)."""
    from rollout.engine import EngineConfig

    return EngineConfig(
        kind=cfg.rollout.engine,
        model_path=str(model_path),
        dtype=cfg.rollout.dtype,
        kv_cache_gib=cfg.rollout.kv_cache_gib,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        max_num_seqs=cfg.rollout.max_num_seqs,
        max_model_len=cfg.rollout.max_model_len,
        keep_requests_on_update=cfg.rollout.keep_requests_on_update,
        seed=cfg.controller.seed,
    )


def start_workers(cfg: JobConfig, model_path: Path, route: Route, console: Console) -> WorkerPool:
    """The rollout worker pool at ``rollout.num_workers`` workers, each serving the model folder
    (version 0) with the job's rollout threads and CPU priority (:meth:`JobConfig.thread_plan`);
    on ``interrupt_sync`` the workers score their prefixes with the route's service.
    A worker not started within ``rollout.start_timeout_s`` is given up (the pool holds fewer)."""
    from trainer.driver.workers.pool import WorkerPool

    plan = cfg.thread_plan()
    pool = WorkerPool(
        engine_config(cfg, model_path),
        actor_options=cfg.rollout.actor_options(),
        max_num_seqs=cfg.rollout.max_num_seqs,
        oldlogit=route.worker_scorer,
        oldlogit_restart_timeout_s=cfg.oldlogit.restart_timeout_s,
        start_timeout_s=cfg.rollout.start_timeout_s,
        hang_timeout_s=cfg.rollout.hang_timeout_s,
        worker_options={"torch_threads": plan.rollout, "yield_cpu": plan.yield_to_learner},
    )
    with console.status(f"starting {cfg.rollout.num_workers} rollout worker(s) ..."):
        pool.scale_to(cfg.rollout.num_workers)
    return pool


def start_source(job: Job, console: Console) -> TrajectorySource:
    """The job's trajectory source, of the kind ``controller.source`` names (:data:`SOURCES`, or a
    ``package.module:factory`` called as ``factory(job, console)``); ``auto`` is ``agent`` with an
    ``[agent]`` section, else ``env``."""
    kind = source_kind(job.cfg)
    factory = SOURCES.get(kind) or import_attr(kind)
    return factory(job, console)


def source_kind(cfg: JobConfig) -> str:
    """``controller.source`` with ``auto`` resolved: ``agent`` with an ``[agent]`` section, else ``env``."""
    if cfg.controller.source == "auto":
        return "env" if cfg.agent is None else "agent"
    return cfg.controller.source


def env_source(job: Job, console: Console) -> TrajectorySource:
    """The env loop over the job's rollout workers (:class:`EnvSource`)."""
    return EnvSource(job.cfg, job.pool, job.buffer, lambda: job.version, job.run_segment, lambda: job.admission_version)


def agent_source(job: Job, console: Console) -> TrajectorySource:
    """Agents through the gateway (:class:`AgentSource`): its URL and admin token go to
    ``<run_dir>/gateway.json``, owner-only, and the URL to the console."""
    from trainer.driver.sources.agent_runner import AgentRunner

    runner = AgentRunner.for_job(job)
    write_private(job.run_dir / "gateway.json", json.dumps({"url": runner.url, "token": runner.gateway.admin_token}))
    console.print(f"agent gateway: [bold]{runner.url}/v1[/bold]  (admin token in {job.run_dir / 'gateway.json'})")
    return AgentSource(runner)


SOURCES: dict[str, Callable[[Job, Console], TrajectorySource]] = {"env": env_source, "agent": agent_source}
"""The built-in trajectory sources by ``controller.source`` name."""
