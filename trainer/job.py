"""The driver: one async RL job, top to bottom.

    start Ray, the HTTP status server, the learner, the old-logit service and the rollout workers
    every consumer starts from the model folder (version 0); score held-out episodes (reward before)
    loop until total_steps:
        apply control requests (scale workers, pause)
        top up rollout requests under the staleness admission rule
        move finished trajectories into the buffer (old_logit_model/interrupt_sync: attach pi_old now,
            before their version is superseded)
        take a batch at the learner's version (stale ones are dropped, with a reason)
        snapshot route: ask the old-logit service for exact pi_old, per token
        learner step (exact where known, the configured proxy elsewhere); publish version + 1
        log metrics, update /v1/status
    score held-out episodes (reward after), write summary, plots, checkpoint

Invariants: the learner's version rises by exactly one per applied step and is published whole to
every consumer before the next batch is taken; every submitted sample is consumed, dropped with a
reason, buffered or in flight (``TrajectoryBuffer.accounting_ok``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import ray
from rich.console import Console

from protocol import EnvRef, EwmaStatus, OldLogitRequest, RolloutRequest, Trajectory
from trainer.buffer import TrajectoryBuffer, admission_capacity, token_staleness_histogram
from trainer.config import JobConfig, write_resolved
from trainer.metrics_log import MetricsLog, plot_run
from trainer.server import ApiServer, StatusBoard

ENV_VARS = (
    "OMP_NUM_THREADS",
    "DS_ACCELERATOR",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "TOKENIZERS_PARALLELISM",
    "VINTAGE_CACHE_DIR",
    "HF_HUB_DISABLE_PROGRESS_BARS",
    "VLLM_LOGGING_LEVEL",
    "TRANSFORMERS_VERBOSITY",
    "TORCH_EXTENSIONS_DIR",
)


def _defaults_env() -> None:
    for k, v in (
        ("OMP_NUM_THREADS", "1"),
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("TOKENIZERS_PARALLELISM", "false"),
        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
        ("RAY_memory_monitor_refresh_ms", "0"),
        ("VLLM_LOGGING_LEVEL", "ERROR"),
        ("TRANSFORMERS_VERBOSITY", "error"),
        # DeepSpeed's JIT ops (the CPU comm op) build once per virtual environment: two venvs
        # sharing ~/.cache/torch_extensions invalidate each other's build on every learner start.
        ("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions")),
    ):
        os.environ.setdefault(k, v)
    try:
        import torch

        os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    except ImportError:  # pragma: no cover
        pass


@contextlib.contextmanager
def ray_session(cfg: JobConfig):
    """Connect to ``cfg.ray.address``, or start a private local cluster stopped on exit.

    The local cluster gets its own temp dir; Ray's memory monitor is off (it killed actors on a
    24 GiB box running several model copies) - size the job instead. With ``ray.loopback_only``
    every process it starts listens on loopback only, with token authentication
    (:func:`trainer.netguard.private_cluster_env`); the driver's own port is covered when the
    process was started with that environment (``vintage run`` re-executes itself so).

    Raises:
        trainer.netguard.LoopbackUnavailable: ``ray.loopback_only`` and no C compiler to build the
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
    from trainer import netguard

    os.environ.update(netguard.private_cluster_env())
    # Ray read this switch when it was imported; the node address must be loopback for this start
    import ray._private.ray_constants as ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
    if not netguard.active():
        print(
            "warning: ray.loopback_only: this driver process was not started with the bind interposer; "
            "its own Ray port listens on every interface (start jobs with `vintage run`)",
            file=sys.stderr,
        )


def resolve_model(cfg: JobConfig) -> Path:
    """The HF folder for ``model.path`` (``smollm2``, ``tiny`` or a folder)."""
    from trainer.modelhub import make_tiny_model, prepare_smollm2

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

    from trainer.weights import pack_weights, unpack_weights

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


class Job:
    """The parts of one running job and the bookkeeping the loop needs (see the module docstring)."""

    def __init__(self, cfg: JobConfig, console: Console):
        from oldlogit_service.actor import OldLogitServer
        from rollout.engine import EngineConfig
        from trainer.learner import LearnerGroup, LearnerSettings
        from trainer.pool import WorkerPool

        self.cfg, self.console = cfg, console
        self.run_dir = Path(cfg.logging.run_dir)
        self.model_path = resolve_model(cfg)
        c, s = cfg.controller, cfg.rollout.sampling
        self.group_size, self.batch_size = s.n, c.batch_groups * s.n
        self.buffer = TrajectoryBuffer(capacity=c.buffer_capacity, max_staleness=c.max_staleness)
        self.route = cfg.oldlogit_route
        ewma = cfg.ewma.model_copy(update={"window": max(cfg.ewma.window, c.max_staleness)})
        settings = LearnerSettings(
            model_path=str(self.model_path),
            zero_stage=cfg.learner.zero_stage,
            dtype=cfg.learner.dtype,
            lr=cfg.learner.lr,
            weight_decay=cfg.learner.weight_decay,
            grad_clip=cfg.learner.grad_clip,
            micro_batch_size=cfg.learner.micro_batch_size,
            loss=cfg.loss,
            ewma=ewma,
            temperature=s.temperature,
            max_token_staleness=c.max_token_staleness,
            seed=c.seed,
        )
        with console.status("starting learner ..."):
            self.learner = LearnerGroup(settings, world_size=cfg.learner.world_size, **cfg.learner.actor_options())
        self.oldlogit = None
        if self.route != "none":
            with console.status(f"starting old-logit service ({self.route}) ..."):
                self.oldlogit = OldLogitServer.options(**cfg.oldlogit.actor_options()).remote(
                    str(self.model_path),
                    route=self.route,
                    max_staleness=c.max_staleness,
                    memory_budget_bytes=cfg.oldlogit.memory_budget_bytes,
                )
                ray.get(self.oldlogit.ready.remote())
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
            oldlogit=self.oldlogit if self.route == "interrupt_sync" else None,
        )
        with console.status(f"starting {cfg.rollout.num_workers} rollout worker(s) ..."):
            self.pool.scale_to(cfg.rollout.num_workers)
        self.version = 0
        if c.resume_from:
            extra = self.learner.load_checkpoint(c.resume_from)
            self.buffer.load_state_dict(extra.get("buffer", {"submitted": 0, "consumed": 0, "dropped": {}}))
            self.version = self.learner.version()
            console.print(f"resumed from {c.resume_from} at version {self.version}")
        self.seeds = iter(range(self.buffer.submitted, 10**9))
        self.times = Counter()
        self.tokens_exact = self.tokens_total = 0
        self.last_publish: dict[str, float] = {}

    # -- the parts of one iteration ------------------------------------------------------------

    def publish(self) -> None:
        """Publish the learner's current version to every rollout worker and the old-logit service."""
        t0 = time.perf_counter()
        noise = self.cfg.rollout.inject_mismatch_std
        # payloads stay in the object store: the driver handles manifests and references only
        manifest, ref = self.learner.publish_ref(self.cfg.rollout.dtype)
        scorer_args = None
        if self.oldlogit is not None:
            if self.cfg.rollout.dtype != "float32" or noise > 0:
                scorer_args = self.learner.publish_ref("float32")
            else:
                scorer_args = (manifest, ref)
        if noise > 0:
            seed = self.cfg.controller.seed * 100_003 + manifest.version
            manifest, payload = perturbed(manifest, ray.get(ref), noise, seed=seed)
            ref = ray.put(payload)
        if self.route in ("old_logit_model", "interrupt_sync"):
            # the single-version scorer must still hold the outgoing version while finished trajectories are
            # collected and (interrupt_sync) while workers score their interrupted prefixes; then it moves on
            self.collect()
            self.pool.update_weights(manifest, ref)
            ray.get(self.oldlogit.update_weights.remote(*scorer_args))
        else:
            pending = [self.oldlogit.update_weights.remote(*scorer_args)] if scorer_args else []
            self.pool.update_weights(manifest, ref)
            ray.get(pending)
        self.last_publish = {"seconds": time.perf_counter() - t0, "bytes": manifest.total_bytes, "unix": time.time()}
        self.times["publish"] += self.last_publish["seconds"]

    def top_up(self) -> None:
        """Submit as many new groups as the staleness admission rule allows."""
        room = admission_capacity(
            self.version, self.cfg.controller.max_staleness, self.batch_size, self.buffer.submitted
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

    def collect(self, got: list[Trajectory] | None = None) -> None:
        """Move finished trajectories into the buffer (attaching exact pi_old on the scorer routes)."""
        got = self.pool.poll() if got is None else got
        if got and self.route in ("old_logit_model", "interrupt_sync"):
            t0 = time.perf_counter()
            got = ray.get(self.oldlogit.attach_old_logprobs.remote(got, self.cfg.rollout.sampling.temperature))
            self.times["old_logits"] += time.perf_counter() - t0
        for t in got:
            if t.finish_reason == "abort":
                self.buffer.reject("aborted")
            else:
                self.buffer.offer(t)

    def train(self, batch: list[Trajectory]) -> dict[str, Any]:
        """Exact pi_old where the route has it, one learner step, and publication of the new version."""
        from oldlogit_service.service import items_from_trajectories

        answer = None
        t0 = time.perf_counter()
        if self.route == "snapshot":
            req = OldLogitRequest(
                request_id=f"step-{self.version}",
                temperature=self.cfg.rollout.sampling.temperature,
                items=items_from_trajectories(batch),
            )
            answer = ray.get(self.oldlogit.score.remote(req))
        t1 = time.perf_counter()
        m = self.learner.train_step(batch, answer)
        t2 = time.perf_counter()
        self.times["old_logits"] += t1 - t0
        self.times["train"] += t2 - t1
        if m["applied"]:
            self.version = int(m["version"])
            self.publish()
        hist = token_staleness_histogram(batch, int(m["consumed_version"]))
        n = sum(hist.values())
        rewards = [t.reward for t in batch]
        exact = float(m.get("exact_token_fraction", 0.0))
        self.tokens_exact += exact * m["tokens"]
        self.tokens_total += m["tokens"]
        m.update(
            reward_mean=float(np.mean(rewards)),
            reward_max=float(np.max(rewards)),
            exact_fraction=exact,
            staleness_mean=sum(k * v for k, v in hist.items()) / max(n, 1),
            staleness_max=max(hist, default=0),
            staleness_hist=hist,
            publish_s=self.last_publish.get("seconds", 0.0),
            old_logits_s=t1 - t0,
            train_s=t2 - t1,
            **{f"dropped_{k}": v for k, v in self.buffer.dropped.items()},
        )
        return m

    def evaluate(self, tag: str) -> dict[str, float]:
        """Mean reward on held-out env seeds (disjoint from training), one sample each, same sampling."""
        k = self.cfg.env.eval_prompts
        if k == 0 or not len(self.pool):
            return {}
        t0 = time.perf_counter()
        seeds = list(range(self.cfg.env.train_seeds, self.cfg.env.train_seeds + k))
        reqs = make_requests(self.cfg, seeds, f"eval-{tag}-", self.version, n=1)
        self.pool.submit(reqs)
        got: list[Trajectory] = []
        while len(got) < len(reqs):
            polled = self.pool.poll()
            got += [t for t in polled if t.trajectory_id.startswith("eval-")]
            self.collect([t for t in polled if not t.trajectory_id.startswith("eval-")])
            time.sleep(0.2)
        self.times["eval"] += time.perf_counter() - t0
        r = [t.reward for t in got]
        return {"reward": float(np.mean(r)), "success_rate": float(np.mean([x > 0.5 for x in r])), "episodes": len(r)}

    def checkpoint(self) -> str:
        """Learner state (weights, optimizer, version, EWMA) plus the buffer accounting."""
        return self.learner.save_checkpoint(str(self.run_dir / "checkpoints"), {"buffer": self.buffer.state_dict()})

    def apply_controls(self, board: StatusBoard) -> None:
        want = board.desired_workers
        if want is not None and want != len(self.pool):
            added, removed = self.pool.scale_to(want)
            for _wid, lost in removed.items():
                self.buffer.note_lost(lost, "worker_removed")
            self.console.print(f"scaled rollout workers to {want} (+{len(added)} -{len(removed)})")
        board.desired_workers = None

    def status_fields(self, m: dict[str, Any] | None) -> dict[str, Any]:
        st = ray.get(self.oldlogit.status.remote()) if self.oldlogit is not None else None
        f = dict(
            learner_version=self.version,
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
        )
        if m is not None:
            exact = m["exact_fraction"]
            f.update(
                last_batch_staleness_hist=m["staleness_hist"],
                exact_fraction_by_route={self.route: exact},
                proxy_fraction=1.0 - exact,
                mask_kept_fraction=m.get("mask_kept_frac"),
                tokens_per_s=m.get("tokens_per_s", 0.0),
                skipped_steps=int(m["skipped_steps"]),
            )
            if "ewma_beta" in m:
                f["ewma"] = EwmaStatus(
                    beta=m["ewma_beta"],
                    total_weight=m["ewma_total_weight"],
                    resets=int(m["ewma_resets"]),
                    bytes_held=int(m.get("ewma_bytes", 0)),
                )
        return f

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.pool.shutdown()
        with contextlib.suppress(Exception):
            self.learner.shutdown()
        if self.oldlogit is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.oldlogit)


def run_job(cfg: JobConfig, console: Console | None = None) -> dict[str, Any]:
    """Run one job to ``controller.total_steps`` (or the time budget); returns the summary dict.

    The summary is also written to ``<run_dir>/summary.json``; metrics go to ``metrics.jsonl`` (and
    TensorBoard), plots to ``reward.png`` / ``staleness.png``.
    """
    console = console or Console()
    _defaults_env()
    run_dir = Path(cfg.logging.run_dir)
    write_resolved(cfg, run_dir)
    t_start = time.perf_counter()
    board = StatusBoard()
    server = None
    if cfg.server.enabled:
        server = ApiServer(board, cfg.server.host, cfg.server.port, cfg.server.token).start()
        (run_dir / "token").write_text(server.token)
        os.chmod(run_dir / "token", 0o600)
        (run_dir / "server.json").write_text(json.dumps({"url": server.url}))
        console.print(f"status API: [bold]{server.url}/v1/status[/bold]  (bearer token in {run_dir / 'token'})")
    log = MetricsLog(run_dir, tensorboard=cfg.logging.tensorboard)
    summary: dict[str, Any] = {"state": "failed"}
    with ray_session(cfg):
        job = Job(cfg, console)
        try:
            summary = _loop(job, board, log, t_start)
        finally:
            board.update(state=summary["state"])
            job.shutdown()
            log.close()
            if server is not None:
                server.stop()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if cfg.logging.plots:
        summary["plots"] = [str(p) for p in plot_run(run_dir)]
    console.print_json(json.dumps(summary, default=str))
    return summary


def _loop(job: Job, board: StatusBoard, log: MetricsLog, t_start: float) -> dict[str, Any]:
    cfg, console = job.cfg, job.console
    if job.version > 0:  # resumed: consumers loaded the folder (version 0); give them the resumed weights
        job.publish()
    before = job.evaluate("before")
    console.print(f"held-out reward before training: {before}")
    board.update(state="running", **job.status_fields(None))
    deadline = t_start + cfg.controller.time_budget_s if cfg.controller.time_budget_s else None
    t_loop = time.perf_counter()
    m = None
    while job.version < cfg.controller.total_steps and (deadline is None or time.perf_counter() < deadline):
        job.apply_controls(board)
        if board.paused:
            time.sleep(0.2)
            continue
        job.top_up()
        job.collect()
        batch = job.buffer.take(job.batch_size, job.version, job.group_size)
        if batch is None:
            time.sleep(0.05)
            continue
        m = job.train(batch)
        log.log(job.version, m)
        if cfg.controller.checkpoint_every and job.version % cfg.controller.checkpoint_every == 0:
            job.checkpoint()
        board.update(**job.status_fields(m))
        console.print(
            f"step {int(m['consumed_version'])}->{job.version}  reward {m['reward_mean']:.3f}  staleness mean {m['staleness_mean']:.2f} "
            f"max {m['staleness_max']}  exact {m['exact_fraction']:.2f}  kept {m.get('mask_kept_frac', float('nan')):.2f}  "
            f"loss {m['loss']:+.4f}  {m['tokens_per_s']:.0f} tok/s  train {m['train_s']:.1f}s"
        )
    loop_s = time.perf_counter() - t_loop
    after = job.evaluate("after")
    console.print(f"held-out reward after training: {after}")
    job.checkpoint()
    return {
        "state": "finished",
        "steps": job.version,
        "reward_before": before,
        "reward_after": after,
        "tokens_exact": job.tokens_exact,
        "tokens_total": job.tokens_total,
        "exact_fraction": job.tokens_exact / job.tokens_total if job.tokens_total else 0.0,
        "ewma_resets": int(m.get("ewma_resets", 0)) if m else 0,
        "skipped_steps": int(m["skipped_steps"]) if m else 0,
        "generated": job.buffer.submitted,
        "consumed": job.buffer.consumed,
        "dropped": dict(job.buffer.dropped),
        "accounting_ok": job.buffer.accounting_ok(),
        "loop_s": loop_s,
        "time_split_s": dict(job.times),
        "wall_s": time.perf_counter() - t_start,
        "route": job.route,
        "method": cfg.loss.method,
    }
