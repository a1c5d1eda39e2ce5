"""The driver: one async RL job, top to bottom.

    start Ray, the HTTP status server, the learner, the old-logit service and the rollout workers
    every consumer starts from the model folder (version 0); score held-out episodes (reward before)
    loop until total_steps (``_loop``, one line per part):
        controls      apply control requests (scale workers, pause)
        admit         ``Job.top_up``: submit groups under the staleness admission rule (here only
                      when no batch was taken ahead; otherwise after the launch below)
        collect       ``Job.collect``: finished trajectories into the buffer (scorer routes attach
                      exact pi_old here, before their version is superseded)
        take          ``Job.take``: a batch at the learner's version (stale ones dropped, with a
                      reason) and a reference to the snapshot route's per-token answer for it -
                      unless the batch was already taken ahead during the previous step
        train         ``Job.async_train``: waits for the batch's old logits, then launches one
                      learner step (exact where known, the configured proxy elsewhere)
        admit         ``Job.top_up`` again: the room the new version opened is submitted while
                      the learner trains, not between its steps
        take ahead    ``Job.take_ahead``: while the learner trains on batch k at version V, batch
                      k+1 is taken for version V+1 and the snapshot route scores it (its tokens
                      are all at versions <= V, which the service holds)
        wait          ``Job.finish_train``: the step's metrics; the version moves up by one when
                      the step is applied
        publish       ``Job.await_old_logits`` (the service answers the next batch before it takes
                      the new version: one call at a time), ``route.before_publish`` (scorer routes
                      collect first), then ``Job.publish``
        log           ``Job.step_metrics`` -> ``metrics.jsonl``, TensorBoard, ``/v1/status``
        checkpoint    every ``controller.checkpoint_every`` versions
    score held-out episodes (reward after), write summary, plots, checkpoint

What differs per old-logit route lives in one object per route kind (:mod:`trainer.driver.routes`).

Invariants: the learner's version rises by exactly one per applied step and is published whole to
every consumer before the next version is published (consumers apply it in the background; the
old-logit service runs its calls in order, so it takes V+1 before it scores anything sent after);
a batch holding a token of version V+1 is scored only after the service took V+1 (a batch taken
ahead is taken before V+1 exists); every submitted sample is consumed, dropped with a reason,
buffered, held in a batch taken ahead (returned to the buffer when the loop stops) or in flight
(``TrajectoryBuffer.accounting_ok``).

Time split (``summary["time_split_s"]``, wall seconds of the driver): ``train`` from launching a
step to its metrics; ``old_logits`` only the waits for an answer (and scorer-route attaching
between steps); ``old_logits_overlapped`` the service's scoring seconds hidden behind a learner
step, plus scorer-route attaching while the learner trained; ``publish``; ``eval``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
from rich.console import Console

from oldlogit_service.calls import PendingCall
from protocol import EnvRef, EwmaStatus, RolloutRequest, Trajectory
from trainer.driver.buffer import TrajectoryBuffer, admission_capacity, token_staleness_histogram
from trainer.driver.config import JobConfig, one_line, write_private, write_resolved
from trainer.driver.environment import ENV_VARS, defaults_env
from trainer.driver.metrics_log import MetricsLog, StepMetrics, plot_run
from trainer.driver.routes import make_route
from trainer.driver.server import ApiServer, StatusBoard
from trainer.learner.ds_ops import clear_stale_build_locks


@contextlib.contextmanager
def ray_session(cfg: JobConfig):
    """Connect to ``cfg.ray.address``, or start a private local cluster stopped on exit.

    The local cluster gets its own temp dir; Ray's memory monitor is off (it killed actors on a
    24 GiB box running several model copies) - size the job instead. With ``ray.loopback_only``
    every process it starts listens on loopback only, with token authentication
    (:func:`trainer.driver.netguard.private_cluster_env`); the driver's own port is covered when the
    process was started with that environment (``vintage run`` re-executes itself so).

    Raises:
        trainer.driver.netguard.LoopbackUnavailable: ``ray.loopback_only`` and no C compiler to build the
            bind interposer.
    """
    if ray.is_initialized():
        yield
        return
    if not cfg.ray.address and cfg.ray.loopback_only:
        _loopback_private_cluster()
    env = {"env_vars": {k: os.environ[k] for k in ENV_VARS if k in os.environ}}
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, runtime_env=env, log_to_driver=True)
    else:
        need = (
            cfg.rollout.num_workers * cfg.rollout.num_cpus
            + cfg.learner.world_size * cfg.learner.num_cpus
            + cfg.oldlogit.num_cpus
        )
        custom: Counter = Counter()  # declare the groups' custom resources on the single local node
        for group, count in (
            (cfg.rollout, cfg.rollout.num_workers),
            (cfg.learner, cfg.learner.world_size),
            (cfg.oldlogit, 1),
        ):
            for k, v in group.resources.items():
                custom[k] += v * max(count, 1) * (4 if group is cfg.rollout else 1)  # room to scale workers up
        ray.init(
            resources=dict(custom) or None,
            num_cpus=cfg.ray.num_cpus or max(2, int(np.ceil(need)) + 2),
            include_dashboard=False,
            _temp_dir=tempfile.mkdtemp(prefix="vintage-ray-"),
            runtime_env=env,
            log_to_driver=True,
        )
    try:
        yield
    finally:
        ray.shutdown()


def _loopback_private_cluster() -> None:
    """Give the processes the private cluster will start the loopback-only environment."""
    from trainer.driver import netguard

    bound = netguard.active()  # this process itself was started with the interposer
    os.environ.update(netguard.private_cluster_env())
    # Ray read these when it was imported: the node address must be loopback for this start, and
    # this process must see token authentication like the processes it starts
    import ray._private.ray_constants as ray_constants
    from ray._raylet import AuthenticationTokenLoader, Config

    ray_constants.ENABLE_RAY_CLUSTER = False
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    if not bound:
        print(
            "warning: ray.loopback_only: this driver process was not started with the bind interposer; "
            "its own Ray port listens on every interface (start jobs with `vintage run`)",
            file=sys.stderr,
        )


def loop_per_step(loop_s: float, train_s: float, steps: int) -> dict[str, float | None]:
    """Loop and learner wall seconds per step and their ratio (None without a step).

    ``loop_s``: from the first step's launch to the loop's end (the wait for the first batch is the
    rollout's ramp-up, not a per-step cost); ``train_s``: the learner steps' seconds, launch to
    metrics (:meth:`Job.finish_train`). ``loop_over_learner = loop_s / train_s`` is 1 when the loop
    does nothing but wait for the learner. Example: 3 steps, 90 s of loop, 75 s of learner:
    30 s, 25 s, 1.2.
    """
    if steps < 1 or train_s <= 0:
        return {"loop_s_per_step": None, "train_s_per_step": None, "loop_over_learner": None}
    return {
        "loop_s_per_step": loop_s / steps,
        "train_s_per_step": train_s / steps,
        "loop_over_learner": loop_s / train_s,
    }


class StopSignal:
    """SIGINT / SIGTERM ask the loop to stop; a second signal exits at once.

    The first signal sets :attr:`requested`: the loop leaves after the current step, the job
    checkpoints, stops every actor and writes ``summary.json`` (``end_reason = "interrupted"``).
    A second signal ends the process immediately with status 130. Handlers are installed only in
    the main thread (a job run from another thread keeps the process's handlers).
    """

    def __init__(self) -> None:
        self.requested = False

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            os._exit(130)
        self.requested = True
        print(f"\n{signal.Signals(signum).name}: stopping after this step (again to exit at once)", file=sys.stderr)

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, h in old.items():
                signal.signal(s, h)


def end_reason(version: int, total_steps: int, interrupted: bool) -> str:
    """Why the loop ended: ``completed`` (``total_steps`` reached), ``interrupted`` (a signal), or
    ``time_budget`` (the budget expired first)."""
    if version >= total_steps:
        return "completed"
    return "interrupted" if interrupted else "time_budget"


_PARTS = {"LearnerCore": "learner", "RolloutWorker": "rollout worker", "OldLogit": "old-logit service"}


def failed_part(e: BaseException) -> str:
    """The part a failure came from: the Ray actor's role for actor errors, the part an error message
    starts with (``"learner: ..."``), else the exception type."""
    if isinstance(e, ray.exceptions.RayActorError):
        return next((part for key, part in _PARTS.items() if key in str(e)), "actor")
    return next((part for part in _PARTS.values() if str(e).startswith(part + ":")), type(e).__name__)


def held_by_pause(board: StatusBoard) -> bool:
    """Whether the driver loop holds at a pause request; while it holds, ``/v1/status`` says
    ``state = "paused"``, and ``"running"`` again once it goes on."""
    state = board.status().state
    if board.paused and state == "running":
        board.update(state="paused")
    elif not board.paused and state == "paused":
        board.update(state="running")
    return board.paused


def intake_refusal(t: Trajectory, vocab_size: int) -> str | None:
    """Why a finished trajectory cannot enter the buffer (the buffer's drop reason), or None.

    ``aborted``: its generation was aborted; ``token_id_out_of_vocab``: a token id is ``>= vocab_size``
    (the model config's ``vocab_size``, rows of the learner's embedding), which no forward can score.
    """
    if t.finish_reason == "abort":
        return "aborted"
    if int(t.token_ids.max()) >= vocab_size:
        return "token_id_out_of_vocab"
    return None


def _finite_or_none(x: float | None) -> float | None:
    """``x`` when it is a finite number, else None (the status never shows NaN)."""
    return float(x) if x is not None and np.isfinite(x) else None


def resolve_model(cfg: JobConfig) -> Path:
    """The HF folder for ``model.path`` (``smollm2``, ``tiny`` or a folder)."""
    from modelkit.modelhub import make_tiny_model, prepare_smollm2

    if cfg.model.path == "smollm2":
        return prepare_smollm2()
    if cfg.model.path == "tiny":
        return make_tiny_model(cfg.model.tiny_seed)
    p = Path(cfg.model.path).expanduser()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model.path: {p} is not an HF model folder (no config.json)")
    return p


def make_requests(
    cfg: JobConfig, seeds: list[int], prefix: str, version: int, n: int | None = None
) -> list[RolloutRequest]:
    """One request (a group of ``sampling.n`` samples) per env seed."""
    sampling = cfg.rollout.sampling if n is None else cfg.rollout.sampling.model_copy(update={"n": n})
    return [
        RolloutRequest(
            request_id=f"{prefix}{s}",
            group_id=f"{prefix}{s}",
            env=EnvRef(path=cfg.env.path, kwargs=cfg.env.kwargs, seed=s),
            sampling=sampling,
            admitted_version=version,
        )
        for s in seeds
    ]


def perturbed(manifest, payload: dict, std: float, seed: int):
    """``payload`` with every floating tensor multiplied by ``1 + N(0, std)`` (re-packed, new checksum)."""
    import torch

    from modelkit.weights import pack_weights, unpack_weights

    g = torch.Generator().manual_seed(seed)
    named = unpack_weights(manifest, payload, verify=False)
    noisy = {
        k: v
        if k in manifest.tied
        else v * (1 + std * torch.randn(v.shape, generator=g, dtype=torch.float32).to(v.dtype))
        for k, v in named.items()
    }
    for alias, src in manifest.tied.items():  # keep ties: same tensor object under both names
        noisy[alias] = noisy[src]
    return pack_weights(noisy.items(), manifest.version, manifest.tensors[0].dtype)


def learner_settings(cfg: JobConfig, model_path: Path):
    """The :class:`trainer.learner.LearnerSettings` of ``cfg`` for the model folder ``model_path``.

    The EWMA window is at least ``controller.max_staleness`` (the oldest consumable version).

    Raises:
        pydantic.ValidationError: the settings refuse the combination (e.g. ``loss.kl_coef > 0``).
    """
    from trainer.learner import LearnerSettings

    c, s = cfg.controller, cfg.rollout.sampling
    ewma = cfg.ewma.model_copy(update={"window": max(cfg.ewma.window, c.max_staleness)})
    return LearnerSettings(
        model_path=str(model_path),
        zero_stage=cfg.learner.zero_stage,
        dtype=cfg.learner.dtype,
        lr=cfg.learner.lr,
        weight_decay=cfg.learner.weight_decay,
        grad_clip=cfg.learner.grad_clip,
        overlong_filter=cfg.learner.overlong_filter,
        micro_batch_size=cfg.learner.micro_batch_size,
        ppo_mini_batches=cfg.learner.ppo_mini_batches,
        ppo_epochs=cfg.learner.ppo_epochs,
        loss=cfg.loss,
        ewma=ewma,
        temperature=s.temperature,
        logprob_chunk_bytes=cfg.learner.logprob_chunk_bytes,
        max_token_staleness=c.max_token_staleness,
        seed=c.seed,
        lora=cfg.lora,
    )


@dataclass
class TakenBatch:
    """A batch out of the buffer (held there until its step starts) and the route's pending answer."""

    trajectories: list[Trajectory]
    old_logits: PendingCall | None
    """The snapshot route's call for the per-token answer (:class:`protocol.OldLogitAnswer`), None on
    other routes; ``old_logits.ref`` is the reference the learner resolves."""
    ahead: bool
    """Taken for the next version while the learner trained on the batch before."""
    waited_s: float | None = None
    """Seconds the driver waited for the answer; None until it has waited (:meth:`Job.await_old_logits`)."""


@dataclass
class TrainStep:
    """One launched learner step."""

    batch: TakenBatch
    refs: list[ray.ObjectRef]
    """One reference per rank to its metrics (rank 0's first)."""
    started: float
    """``time.perf_counter()`` at the launch."""
    old_logits_s: float
    """Seconds the driver waited for the batch's answer before the launch."""

    def done(self, timeout_s: float) -> bool:
        """Whether rank 0 has finished, waiting at most ``timeout_s`` seconds."""
        ready, _ = ray.wait(self.refs[:1], timeout=timeout_s)
        return bool(ready)


class Job:
    """The parts of one running job and the bookkeeping the loop needs (see the module docstring)."""

    agents = None
    """The :class:`trainer.driver.agent_runner.AgentRunner` when ``[agent]`` is set: it admits, collects and evaluates."""
    _applying: threading.Thread | None = None
    """The publication being applied in the background (:meth:`publish`)."""
    _apply_error: BaseException | None = None

    def __init__(self, cfg: JobConfig, console: Console):
        from oldlogit_service.actor import OldLogitServer
        from rollout.engine import EngineConfig
        from trainer.driver.pool import WorkerPool
        from trainer.learner import LearnerGroup

        self.cfg, self.console = cfg, console
        self.run_dir = Path(cfg.logging.run_dir)
        self.model_path = resolve_model(cfg)
        self.vocab_size = int(json.loads((self.model_path / "config.json").read_text())["vocab_size"])
        c, s = cfg.controller, cfg.rollout.sampling
        self.group_size, self.batch_size = s.n, c.batch_groups * s.n
        self.buffer = TrajectoryBuffer(capacity=c.buffer_capacity, max_staleness=c.max_staleness)
        settings = learner_settings(cfg, self.model_path)
        for lock in clear_stale_build_locks():  # a killed build's lock would hang the learner's start
            console.print(f"removed a stale DeepSpeed build lock: {lock}")
        with console.status("starting learner ..."):
            self.learner = LearnerGroup(
                settings,
                world_size=cfg.learner.world_size,
                start_timeout_s=c.start_timeout_s,
                **cfg.learner.actor_options(),
            )
        oldlogit = None
        if cfg.oldlogit_route != "none":
            with console.status(f"starting old-logit service ({cfg.oldlogit_route}) ..."):
                restarts = cfg.oldlogit.max_restarts
                oldlogit = OldLogitServer.options(
                    **cfg.oldlogit.actor_options(), max_restarts=restarts, max_task_retries=restarts
                ).remote(
                    str(self.model_path),
                    route=cfg.oldlogit_route,
                    max_staleness=c.max_staleness,
                    memory_budget_bytes=cfg.oldlogit.memory_budget_bytes,
                    adapter=cfg.lora.spec() if cfg.lora.enabled else None,
                )
                try:
                    ray.get(oldlogit.ready.remote(), timeout=c.start_timeout_s)
                except ray.exceptions.GetTimeoutError:
                    ray.kill(oldlogit)
                    raise TimeoutError(
                        f"old-logit service: not started within controller.start_timeout_s = {c.start_timeout_s} s"
                    ) from None
        self.route = make_route(cfg.oldlogit_route, oldlogit, cfg.oldlogit.restart_timeout_s)
        self._oldlogit_status = None  # the service's status at the last step (:meth:`oldlogit_status`)
        engine = EngineConfig(
            kind=cfg.rollout.engine,
            model_path=str(self.model_path),
            dtype=cfg.rollout.dtype,
            kv_cache_gib=cfg.rollout.kv_cache_gib,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            max_num_seqs=cfg.rollout.max_batch,
            max_model_len=cfg.rollout.max_model_len,
            seed=c.seed,
        )
        self.pool = WorkerPool(
            engine,
            actor_options=cfg.rollout.actor_options(),
            max_in_flight=cfg.rollout.max_batch,
            oldlogit=self.route.worker_scorer,
            oldlogit_restart_timeout_s=cfg.oldlogit.restart_timeout_s,
            start_timeout_s=cfg.rollout.start_timeout_s,
            hang_timeout_s=cfg.rollout.hang_timeout_s,
        )
        with console.status(f"starting {cfg.rollout.num_workers} rollout worker(s) ..."):
            self.pool.scale_to(cfg.rollout.num_workers)
        self.version = 0
        self.workers_wanted, self.restarts = cfg.rollout.num_workers, 0
        self.run_segment = 0
        """0 for a fresh run, +1 at every resume: (segment, version) names one set of weights even
        when a resumed run re-reaches a version number it had passed before the resume point."""
        if c.resume_from:
            extra = self.learner.load_checkpoint(c.resume_from)
            self.buffer.load_state_dict(extra.get("buffer", {"submitted": 0, "consumed": 0, "dropped": {}}))
            self.version = self.learner.version()
            self.run_segment = int(extra.get("run_segment", 0)) + 1
            console.print(f"resumed from {c.resume_from} at version {self.version} (run segment {self.run_segment})")
        self.seeds = iter(range(self.buffer.submitted, 10**9))
        self.times = Counter()
        self.train_steps = self.taken_ahead = 0
        self.first_launch: float | None = None  # perf_counter at the first learner step's launch
        self.tokens_exact = self.tokens_total = 0
        self.last_publish: dict[str, float] = {}
        self._held_back: list[Trajectory] = []  # training trajectories polled during an evaluation
        if cfg.agent is not None:
            from trainer.driver.agent_runner import AgentRunner

            self.agents = AgentRunner.for_job(self)
            write_private(
                self.run_dir / "gateway.json",
                json.dumps({"url": self.agents.url, "token": self.agents.gateway.admin_token}),
            )
            console.print(
                f"agent gateway: [bold]{self.agents.url}/v1[/bold]  (admin token in {self.run_dir / 'gateway.json'})"
            )

    # -- the parts of one iteration (the loop in :func:`_loop` calls them in order) -----------

    def top_up(self) -> None:
        """Admit: submit as many new groups as the staleness admission rule allows."""
        if self.agents is not None:
            self.agents.top_up()
            return
        room = admission_capacity(
            self.version, self.cfg.controller.max_staleness, self.batch_size, self.buffer.scheduled
        )
        groups = room // self.group_size
        if groups and len(self.pool):
            seeds = [next(self.seeds) % self.cfg.env.train_seeds for _ in range(groups)]
            reqs = make_requests(self.cfg, seeds, f"v{self.version}-", self.version)
            # request ids must be unique: the seed may repeat, the submission counter does not
            reqs = [
                r.model_copy(
                    update={
                        "request_id": f"{r.request_id}-{self.buffer.submitted + i}",
                        "group_id": f"{r.group_id}-{self.buffer.submitted + i}",
                    }
                )
                for i, r in enumerate(reqs)
            ]
            self.buffer.note_submitted(self.pool.submit(reqs))

    def collect(self, timer: str = "old_logits") -> None:
        """Move finished training trajectories into the buffer (the route attaches exact pi_old first).

        Training trajectories polled while an evaluation waited are collected here too. The seconds
        the route spends attaching go to ``times[timer]``.
        """
        polled = self.agents.poll() if self.agents is not None else self.pool.poll()
        got, self._held_back = self._held_back + polled, []
        t0 = time.perf_counter()
        got = self.route.attach(got, self.cfg.rollout.sampling.temperature)
        self.times[timer] += time.perf_counter() - t0
        for t in got:
            refused = intake_refusal(t, self.vocab_size)
            if refused:
                self.buffer.reject(refused)
            else:
                self.buffer.offer(t)

    def take(self, ahead: bool = False) -> TakenBatch | None:
        """A batch for the learner's version (``ahead``: for the next one) and the route's pending answer.

        The batch stays held in the buffer until :meth:`async_train`; ahead, trajectories too stale
        for the next version are passed over, not dropped (:meth:`TrajectoryBuffer.take_ahead`).
        None when the buffer has no full batch.
        """
        v = self.version + int(ahead)
        if ahead:
            batch = self.buffer.take_ahead(self.batch_size, v, self.group_size)
        else:
            batch = self.buffer.take(self.batch_size, v, self.group_size, hold=True)
        if batch is None:
            return None
        self.taken_ahead += int(ahead)
        return TakenBatch(batch, self.route.async_old_logits(batch, v, self.cfg.rollout.sampling.temperature), ahead)

    def await_old_logits(self, taken: TakenBatch | None) -> None:
        """Wait until the route's answer for ``taken`` is ready (once; nothing when there is none).

        The wait is ``taken.waited_s`` and counts as ``times["old_logits"]``; the service's own
        scoring seconds beyond it (``OldLogitAnswer.seconds``: scoring hidden behind the learner)
        count as ``times["old_logits_overlapped"]``. A service that is restarting is waited for and
        asked again (:class:`oldlogit_service.calls.ServiceCalls`).

        Raises:
            oldlogit_service.calls.ServiceNotBack: the service did not come back within
                ``oldlogit.restart_timeout_s``.
        """
        if taken is None or taken.waited_s is not None:
            return
        t0 = time.perf_counter()
        answer = None if taken.old_logits is None else taken.old_logits.result()
        taken.waited_s = time.perf_counter() - t0
        self.times["old_logits"] += taken.waited_s
        if answer is not None:
            self.times["old_logits_overlapped"] += max(0.0, float(answer.seconds) - taken.waited_s)

    def async_train(self, taken: TakenBatch) -> TrainStep:
        """Launch one learner step on ``taken`` with its answer, after waiting for the answer.

        The batch counts as consumed from here. The learner gets the answer's reference (Ray
        resolves it in the learner process). Nothing is published.
        """
        self.await_old_logits(taken)
        self.buffer.consume(taken.trajectories)
        t0 = time.perf_counter()
        if self.first_launch is None:
            self.first_launch = t0
        refs = self.learner.async_train_step(
            taken.trajectories, taken.old_logits.ref if taken.old_logits is not None else None
        )
        return TrainStep(taken, refs, t0, taken.waited_s or 0.0)

    def take_ahead(self, step: TrainStep) -> TakenBatch | None:
        """While ``step`` trains: collect finished trajectories and take the next batch ahead (for the
        learner's version + 1), until one is taken or the step has finished (then None: the next
        batch is taken at the new version). None at once when ``controller.max_staleness`` is 0 (no
        batch is consumable at V+1 before V+1 is published) or when V+1 is the last version
        (``controller.total_steps``)."""
        c = self.cfg.controller
        if c.max_staleness == 0 or self.version + 1 >= c.total_steps:
            return None
        while True:
            nxt = self.take(ahead=True)
            if nxt is not None or step.done(timeout_s=0.2):
                return nxt
            self.collect(timer="old_logits_overlapped")

    def finish_train(self, step: TrainStep) -> dict[str, Any]:
        """Wait for ``step``; the learner's metrics (rank 0).

        On an applied step ``self.version`` moves to the learner's new version; nothing is published.
        The metrics gain ``old_logits_s`` (wait for the answer before the launch), ``train_s`` (launch
        to metrics), wall seconds, and ``taken_ahead`` (the batch was taken ahead).

        Raises:
            ray.exceptions.RayActorError: a learner rank died.
        """
        m = ray.get(step.refs)[0]
        train_s = time.perf_counter() - step.started
        self.times["train"] += train_s
        self.train_steps += 1
        if m["applied"]:
            self.version = int(m["version"])
        m.update(old_logits_s=step.old_logits_s, train_s=train_s, taken_ahead=step.batch.ahead)
        return m

    def return_taken(self, taken: TakenBatch | None) -> None:
        """A batch taken ahead whose step never started (the loop stopped): back to the buffer, unconsumed."""
        if taken is not None:
            self.buffer.put_back(taken.trajectories)

    def publish(self) -> None:
        """Publish the learner's current version to every rollout worker and the old-logit service.

        The learner packs the version into the object store and is free again (the driver handles
        manifests and references only). The consumers then take it in the order the route decides
        (:mod:`trainer.driver.routes`): on the ``none`` and ``snapshot`` routes in the background, so the
        loop and the learner go on while each worker switches between two tokens; scorer routes
        keep the scorer in lockstep with the workers, so this call waits for them. One publication
        is applied at a time: this call, :meth:`evaluate` and :meth:`shutdown` first wait for the
        previous one (:meth:`wait_published`, which raises its error, if any).
        """
        self.wait_published()
        t0 = time.perf_counter()
        noise = self.cfg.rollout.inject_mismatch_std
        manifest, ref = self.learner.async_publish(self.cfg.rollout.dtype)
        scorer_weights = None
        if self.route.oldlogit is not None:
            if self.cfg.rollout.dtype != "float32" or noise > 0:
                scorer_weights = self.learner.async_publish("float32")
            else:
                scorer_weights = (manifest, ref)
        if noise > 0:
            seed = self.cfg.controller.seed * 100_003 + manifest.version
            manifest, payload = perturbed(manifest, ray.get(ref), noise, seed=seed)
            ref = ray.put(payload)
        self.last_publish = {"seconds": time.perf_counter() - t0, "bytes": manifest.total_bytes, "unix": time.time()}
        self.times["publish"] += self.last_publish["seconds"]

        def apply() -> None:
            t1 = time.perf_counter()
            try:
                self.route.publish(lambda: self.pool.update_weights(manifest, ref), scorer_weights)
            except BaseException as e:  # raised by the next wait_published
                self._apply_error = e
            self.last_publish["applied_s"] = time.perf_counter() - t1

        if self.route.name in ("none", "snapshot"):
            self._applying = threading.Thread(target=apply, name=f"publish-v{manifest.version}", daemon=True)
            self._applying.start()
        else:
            apply()
            self.wait_published()

    def wait_published(self) -> None:
        """Wait until every consumer has applied the last publication; re-raise its failure, if any."""
        th, self._applying = self._applying, None
        if th is not None:
            th.join()
        err, self._apply_error = self._apply_error, None
        if err is not None:
            raise err

    def step_metrics(self, batch: list[Trajectory], m: dict[str, Any]) -> StepMetrics:
        """The learner's metrics ``m`` plus the batch's rewards and staleness, the last publication,
        the old-logit service's restarts and outages so far (:meth:`ServiceCalls.record`) and the
        buffer's drop counts: one row of ``metrics.jsonl``. Adds to the job's exact-token totals.

        Raises:
            pydantic.ValidationError: the learner's metrics lack a field every step has.
            oldlogit_service.calls.ServiceNotBack: the service did not come back within
                ``oldlogit.restart_timeout_s``.
        """
        hist = token_staleness_histogram(batch, int(m["consumed_version"]))
        n = sum(hist.values())
        self.oldlogit_status()  # counts a restart of the service before the row is written
        service = self.route.service_record()
        rewards = [t.reward for t in batch]
        exact = float(m.get("exact_token_fraction", 0.0))
        self.tokens_exact += exact * m["tokens"]
        self.tokens_total += m["tokens"]
        return StepMetrics(
            **{
                **m,
                "reward_mean": float(np.mean(rewards)),
                "reward_max": float(np.max(rewards)),
                "exact_token_fraction": exact,
                "staleness_mean": sum(k * v for k, v in hist.items()) / max(n, 1),
                "staleness_max": max(hist, default=0),
                "staleness_hist": hist,
                "publish_s": self.last_publish.get("seconds", 0.0),
                "publish_bytes": float(self.last_publish.get("bytes", 0.0)),
                "run_segment": self.run_segment,
                **service,
                **{f"dropped_{k}": v for k, v in self.buffer.dropped.items()},
            }
        )

    def oldlogit_status(self):
        """The old-logit service's :class:`protocol.OldLogitServiceStatus` now (None without one); a
        new service process since the last call counts as a restart (``ServiceCalls.restarts``).

        Raises:
            oldlogit_service.calls.ServiceNotBack: the service did not come back within
                ``oldlogit.restart_timeout_s``.
        """
        calls = self.route.calls
        self._oldlogit_status = calls.status() if calls is not None else None
        return self._oldlogit_status

    def evaluate(self, tag: str) -> dict[str, float]:
        """Mean reward on held-out env seeds (disjoint from training), one sample each, same sampling.

        With ``[agent]`` the agent runs on its held-out tasks instead (:meth:`trainer.driver.agent_runner.AgentRunner.evaluate`).
        Evaluation requests carry ``purpose="eval"``; training trajectories that finish meanwhile are
        held back for the next :meth:`collect`.

        Raises:
            TimeoutError: not every evaluation episode finished within ``env.eval_timeout_s`` (a rollout
                worker failed or hung); the message names the field and the count received.
        """
        self.wait_published()  # every worker serves the version being evaluated
        if self.agents is not None:
            return self.agents.evaluate(tag)
        k = self.cfg.env.eval_prompts
        if k == 0 or not len(self.pool):
            return {}
        t0 = time.perf_counter()
        seeds = list(range(self.cfg.env.train_seeds, self.cfg.env.train_seeds + k))
        reqs = [
            r.model_copy(update={"purpose": "eval"})
            for r in make_requests(self.cfg, seeds, f"eval-{tag}-", self.version, n=1)
        ]
        pending = list(reqs)  # requests no worker took yet (every worker busy with a late call)
        timeout = self.cfg.env.eval_timeout_s
        got: list[Trajectory] = []
        while len(got) < len(reqs):
            if pending:  # one sample per request, taken in order
                pending = pending[self.pool.submit(pending) :]
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(
                    f"env.eval_timeout_s: held-out evaluation {tag!r} got {len(got)} of {len(reqs)} episodes "
                    f"in {timeout:g} s (a rollout worker failed or hung)"
                )
            for t in self.pool.poll():
                (got if t.purpose == "eval" else self._held_back).append(t)
            time.sleep(0.2)
        self.times["eval"] += time.perf_counter() - t0
        r = [t.reward for t in got]
        return {"reward": float(np.mean(r)), "success_rate": float(np.mean([x > 0.5 for x in r])), "episodes": len(r)}

    def checkpoint(self) -> str:
        """Learner state (weights, optimizer, version, EWMA) plus the buffer accounting."""
        extra = {"buffer": self.buffer.state_dict(), "run_segment": self.run_segment}
        return self.learner.save_checkpoint(str(self.run_dir / "checkpoints"), extra)

    def replace_dead_workers(self, board: StatusBoard) -> None:
        """Rollout workers whose process died, or that hung (no finished trajectory for longer than
        ``rollout.hang_timeout_s`` with samples in flight: killed here): their in-flight samples are
        dropped (``worker_died`` / ``worker_hung``) and replacements start, at most
        ``rollout.max_restarts`` over the run; past that the job goes on with fewer and
        ``scale_note`` says so."""
        self.pool.kill_hung()
        deaths = self.pool.take_deaths()
        if not deaths:
            return
        if self.agents is None:  # agent sessions account for their own calls
            for lost, reason in deaths.values():
                self.buffer.note_lost(lost, reason)
        have = len(self.pool) + len(self.pool.starting)
        add = min(self.workers_wanted - have, self.cfg.rollout.max_restarts - self.restarts)
        if add > 0:
            self.pool.request(have + add)  # started in the background: admit_started_workers
            self.restarts += add
        what = {
            "worker_died": "died",
            "worker_hung": f"hung (no finished trajectory in {self.pool.hang_timeout_s or 0:g} s)",
        }
        note = (
            f"rollout worker(s) {', '.join(f'{w} {what[r]}' for w, (_, r) in sorted(deaths.items()))} "
            f"({sum(lost for lost, _ in deaths.values())} samples lost); "
            f"{self.workers_line()}, {self.restarts} of {self.cfg.rollout.max_restarts} restarts used"
        )
        self.report_workers(board, note)

    def apply_controls(self, board: StatusBoard) -> None:
        """Apply the latest scale request (one that arrives meanwhile stays pending for the next call).
        Extra workers are removed now; new ones start in the background (:meth:`admit_started_workers`),
        so the loop never waits for a placement."""
        want = board.take_scale_request()
        if want is None:
            return
        self.workers_wanted = want
        removed = self.pool.request(want)
        for _wid, lost in removed.items():
            self.buffer.note_lost(lost, "worker_removed")
        note = f"scaling rollout workers to {want}: {self.workers_line()}" + (
            f", {len(removed)} removed" if removed else ""
        )
        self.report_workers(board, note)

    def admit_started_workers(self, board: StatusBoard) -> None:
        """Rollout workers started in the background that are ready join at the current version;
        those not placed and started within ``rollout.start_timeout_s`` are given up (the job goes on
        with fewer). ``scale_note`` says which."""
        joined, gave_up = self.pool.admit_started()
        if not joined and not gave_up:
            return
        parts = [f"rollout worker(s) {', '.join(joined)} started"] if joined else []
        if gave_up:
            parts.append(
                f"{', '.join(gave_up)} not placed and started within rollout.start_timeout_s = "
                f"{self.cfg.rollout.start_timeout_s:g} s, given up"
            )
        note = f"{'; '.join(parts)}; {self.workers_line()}"
        self.report_workers(board, note)

    def report_workers(self, board: StatusBoard, note: str) -> None:
        """Print ``note`` and show it as ``/v1/status`` ``scale_note`` with the workers now."""
        self.console.print(note)
        board.update(scale_note=note, workers=self.pool.statuses())

    def workers_line(self) -> str:
        """``"<running> of <wanted> running[, <n> starting]"``: the rollout workers now."""
        starting = len(self.pool.starting)
        return f"{len(self.pool)} of {self.workers_wanted} running" + (f", {starting} starting" if starting else "")

    def status_fields(self, m: StepMetrics | None) -> dict[str, Any]:
        """The ``/v1/status`` fields now; those of the last step ``m`` when given (the old-logit
        service's status then is the one :meth:`step_metrics` read)."""
        st = self._oldlogit_status if m is not None else self.oldlogit_status()
        f = dict(
            learner_version=self.version,
            run_segment=self.run_segment,
            oldlogit_route=self.route.name,
            workers=self.pool.statuses(),
            buffer_size=len(self.buffer),
            buffer_staleness_hist=self.buffer.staleness_histogram(self.version),
            generated=self.buffer.submitted,
            consumed=self.buffer.consumed,
            in_flight=self.buffer.in_flight,
            dropped=dict(self.buffer.dropped),
            oldlogit=st,
            last_publish_s=self.last_publish.get("seconds"),
            last_publish_unix=self.last_publish.get("unix"),
            gateway=self.agents.gateway.status() if self.agents is not None else None,
        )
        if m is not None:
            f.update(
                last_batch_staleness_hist=m.staleness_hist,
                exact_token_fraction=m.exact_token_fraction,
                proxy_fraction=1.0 - m.exact_token_fraction,
                mask_kept_fraction=_finite_or_none(m.mask_kept_fraction),
                tokens_per_s=_finite_or_none(m.tokens_per_s) or 0.0,
                skipped_steps=m.skipped_steps,
            )
            extra = m.model_extra or {}
            if "ewma_beta" in extra:
                f["ewma"] = EwmaStatus(
                    beta=extra["ewma_beta"],
                    total_weight=extra["ewma_total_weight"],
                    resets=int(extra["ewma_resets"]),
                    bytes_held=int(extra.get("ewma_bytes_held", 0)),
                )
        return f

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.wait_published()
        if self.agents is not None:
            with contextlib.suppress(Exception):
                self.agents.close()
        with contextlib.suppress(Exception):
            self.pool.shutdown()
        with contextlib.suppress(Exception):
            self.learner.shutdown()
        if self.route.oldlogit is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.route.oldlogit)


def run_job(cfg: JobConfig, console: Console | None = None) -> dict[str, Any]:
    """Run one job to ``controller.total_steps`` (or the time budget); returns the summary dict.

    The summary is also written to ``<run_dir>/summary.json``; metrics go to ``metrics.jsonl`` (and
    TensorBoard), plots to ``reward.png`` / ``staleness.png``.
    """
    console = console or Console(soft_wrap=True)  # one line per step at any width
    defaults_env()
    run_dir = Path(cfg.logging.run_dir)
    write_resolved(cfg, run_dir)
    t_start = time.perf_counter()
    board = StatusBoard()
    server = None
    if cfg.server.enabled:
        token = cfg.server.token.get_secret_value() if cfg.server.token else None
        server = ApiServer(
            board,
            cfg.server.host,
            cfg.server.port,
            token,
            docs=cfg.server.docs,
            max_body_bytes=cfg.server.max_body_bytes,
            max_workers=cfg.rollout.max_workers,
        ).start()
        write_private(run_dir / "token", server.token)
        if server.token_for_reads:
            console.print(
                f"[yellow]server.host={cfg.server.host} is not loopback: every endpoint requires the token[/yellow]"
            )
        (run_dir / "server.json").write_text(json.dumps({"url": server.url}))
        console.print(f"status API: [bold]{server.url}/v1/status[/bold]  (bearer token in {run_dir / 'token'})")
    log = MetricsLog(run_dir, tensorboard=cfg.logging.tensorboard)
    summary: dict[str, Any] = {"state": "failed", "end_reason": "failed: start-up"}
    stop = StopSignal()
    try:
        with ray_session(cfg), stop.installed():  # after ray.init: Ray installs its own SIGTERM handler
            job = Job(cfg, console)
            try:
                summary = _loop(job, board, log, t_start, stop)
            except Exception as e:
                summary = {"state": "failed", "end_reason": f"failed: {failed_part(e)}", "error": one_line(e)}
                raise
            finally:
                board.update(state=summary["state"])
                job.shutdown()
    except Exception as e:
        if summary["end_reason"] == "failed: start-up":  # the part that could not start
            summary["end_reason"] = f"failed: start-up: {failed_part(e)}"
        summary.setdefault("error", one_line(e))
        raise
    finally:
        log.close()
        if server is not None:
            server.stop()
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if cfg.logging.plots:
        summary["plots"] = [str(p) for p in plot_run(run_dir)]
    console.print_json(json.dumps(summary, default=str))
    return summary


def _loop(job: Job, board: StatusBoard, log: MetricsLog, t_start: float, stop: StopSignal) -> dict[str, Any]:
    """The recipe: each line of the iteration is one part's job (see the module docstring)."""
    cfg, console = job.cfg, job.console
    if job.version > 0:  # resumed: consumers loaded the folder (version 0); give them the resumed weights
        job.publish()
    before = job.evaluate("before")
    console.print(f"held-out reward before training: {before}")
    board.update(state="running", **job.status_fields(None))
    deadline = t_start + cfg.controller.time_budget_s if cfg.controller.time_budget_s else None
    t_loop = time.perf_counter()
    m = None
    nxt: TakenBatch | None = None  # the next batch, taken ahead and scored while the learner trained
    while job.version < cfg.controller.total_steps and not stop.requested:
        if deadline is not None and time.perf_counter() >= deadline:
            break
        job.apply_controls(board)  # control requests: scale workers, pause
        job.admit_started_workers(board)  # workers started in the background join at the current version
        job.replace_dead_workers(board)  # a worker process died: count its samples, start a replacement
        if held_by_pause(board):  # POST /v1/pause: no batch is taken until /v1/resume
            time.sleep(0.2)
            continue
        if nxt is None:  # no batch ready: admit and collect before taking one
            job.top_up()  # admit new groups under the staleness rule
            job.collect()  # finished trajectories into the buffer
        taken, nxt = nxt or job.take(), None  # a batch at the learner's version, its exact pi_old asked for
        if taken is None:
            time.sleep(0.05)
            continue
        step = job.async_train(taken)  # waits for its old logits, launches the learner step
        job.top_up()  # the room the new version opened is admitted while the learner trains
        nxt = job.take_ahead(step)  # the next batch, for version + 1, scored while the learner trains
        learned = job.finish_train(step)  # the step's metrics: version + 1 when applied
        if learned["applied"]:
            job.await_old_logits(nxt)  # the service answers the next batch before it takes the new version
            job.route.before_publish(job.collect)  # scorer routes: score finished work at the outgoing version
            job.publish()  # the new version to every consumer
        m = job.step_metrics(taken.trajectories, learned)  # typed: one name per concept
        log.log(job.version, m)
        if cfg.controller.checkpoint_every and job.version % cfg.controller.checkpoint_every == 0:
            job.checkpoint()
        board.update(**job.status_fields(m))
        console.print(
            f"step {m.consumed_version}->{job.version}  reward {m.reward_mean:.3f}  staleness mean {m.staleness_mean:.2f} "
            f"max {m.staleness_max}  exact {m.exact_token_fraction:.2f}  kept {m.mask_kept_fraction if m.mask_kept_fraction is not None else float('nan'):.2f}  "
            f"loss {m.loss:+.4f}  clip {m.clip_frac_step_max:.2f}  entropy {m.entropy:.2f}  len {m.response_tokens_mean:.0f}  "
            f"{m.tokens_per_s:.0f} tok/s  train {m.train_s:.1f}s"
        )
    t_end = time.perf_counter()
    loop_s = t_end - t_loop
    job.return_taken(nxt)  # taken ahead, never trained on: back to the buffer, unconsumed
    reason = end_reason(job.version, cfg.controller.total_steps, stop.requested)
    after = {} if stop.requested else job.evaluate("after")  # an interrupted run stops promptly
    if not stop.requested:
        console.print(f"held-out reward after training: {after}")
    job.collect()  # training trajectories that finished during the evaluation
    job.checkpoint()
    console.print(f"run ended: {reason} at version {job.version}")
    return {
        "state": "finished",
        "end_reason": reason,
        "steps": job.version,
        "reward_before": before,
        "reward_after": after,
        "tokens_exact": job.tokens_exact,
        "tokens_total": job.tokens_total,
        "exact_token_fraction": job.tokens_exact / job.tokens_total if job.tokens_total else 0.0,
        "ewma_resets": int((m.model_extra or {}).get("ewma_resets", 0)) if m else 0,
        "skipped_steps": m.skipped_steps if m else 0,
        "generated": job.buffer.submitted,
        "consumed": job.buffer.consumed,
        "dropped": dict(job.buffer.dropped),
        "accounting_ok": job.buffer.accounting_ok(),
        "worker_restarts": job.restarts,
        "run_segment": job.run_segment,
        "loop_s": loop_s,
        "train_steps": job.train_steps,
        "batches_taken_ahead": job.taken_ahead,
        **loop_per_step(
            t_end - job.first_launch if job.first_launch is not None else 0.0, job.times["train"], job.train_steps
        ),
        "time_split_s": dict(job.times),
        "wall_s": time.perf_counter() - t_start,
        "oldlogit_route": job.route.name,
        **job.route.service_record(),
        "method": cfg.loss.method,
        "gateway": job.agents.gateway.status().model_dump() if job.agents is not None else None,
    }
