"""The cluster session of one job: the Ray cluster it runs on, its signal handlers and its HTTP
status server.

Invariants: a Ray already initialised in the process is used and left as it is; otherwise the
session connects to ``ray.address`` or starts a private local cluster, and disconnects when it ends
(which stops a private cluster); a private cluster's processes (those ``ray.init`` started, and
theirs) are also stopped when the process ends any other way: SIGTERM, SIGINT or SIGHUP outside the
loop's own handling, a second signal during it, or an exit that skipped the session's end
(:mod:`trainer.driver.cluster.owned`); the process's own signal handlers are back once the job ends.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import signal
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import ray
from rich.console import Console

from trainer.driver.cluster import owned
from trainer.driver.cluster.environment import worker_env
from trainer.driver.cluster.server import ApiServer, StatusBoard
from trainer.driver.config.schema import JobConfig, write_private


@contextlib.contextmanager
def ray_session(cfg: JobConfig):
    """Connect to ``cfg.ray.address``, or start a private local cluster stopped on exit.

    The local cluster gets its own temp dir; Ray's memory monitor is off (it killed actors on a
    24 GiB box running several model copies) - size the job instead. With ``ray.loopback_only``
    every process it starts listens on loopback only, with token authentication
    (:func:`trainer.driver.cluster.netguard.private_cluster_env`); the driver's own port is covered when the
    process was started with that environment (``vintage run`` re-executes itself so).

    Raises:
        trainer.driver.cluster.netguard.LoopbackUnavailable: ``ray.loopback_only`` and no C compiler to build the
            bind interposer.
        ValueError: a driver that the cluster's actors could not reach (:func:`check_driver_reachable`).
    """
    if ray.is_initialized():
        yield
        return
    if not cfg.ray.address and cfg.ray.loopback_only:
        loopback_private_cluster()
    env = {"env_vars": worker_env(os.environ, cfg.thread_plan().yield_to_learner)}
    started: list[psutil.Process] = []  # the private cluster's processes
    if cfg.ray.address:
        from trainer.driver.cluster import netguard

        ray.init(address=cfg.ray.address, runtime_env=env, log_to_driver=True)
        try:
            check_driver_reachable(cfg.ray.address, netguard.active(), ray.util.get_node_ip_address())
        except ValueError:
            ray.shutdown()
            raise
    else:
        started = _start_private_cluster(cfg, env)
    try:
        yield
    finally:
        ray.shutdown()
        if started:
            owned.stop_processes(started, timeout_s=5.0)  # what shutdown left (none when it went well)
            owned.disown(_SESSION_KEY)


_SESSION_KEY = ("ray_session", "private_cluster")


def check_driver_reachable(address: str, loopback_bound: bool, advertised_ip: str) -> None:
    """Refuse the Ray cluster at ``address`` when its actors could not reach this driver: the
    process listens on loopback only (``loopback_bound``: the bind interposer is loaded,
    :func:`trainer.driver.cluster.netguard.active`) while the cluster was given ``advertised_ip``
    for it (Ray takes the address of the local node the driver joined), an address that is not
    loopback. Actors would then wait for ever for what the driver owns (weight publications,
    requests) as soon as they fetch it from another node.

    Raises:
        ValueError: that case; the message names ``ray.address`` and its value.
    """
    if loopback_bound and not ipaddress.ip_address(advertised_ip).is_loopback:
        raise ValueError(
            f"ray.address: {address!r}: this driver listens on loopback only (the bind interposer is in "
            f"LD_PRELOAD) but the cluster reaches it at {advertised_ip}; start the driver without the "
            "interposer (deploy.local_cluster.outside_private_cluster), or the cluster's nodes on loopback only"
        )


def _start_private_cluster(cfg: JobConfig, env: dict[str, Any]) -> list[psutil.Process]:
    """``ray.init`` of the private local cluster; returns the processes it started (this process's
    new children), which are owned (:mod:`trainer.driver.cluster.owned`) from before the call: a signal
    during the start, or a start that fails, stops what it had started."""
    before = {p.pid for p in psutil.Process().children()}

    def new_children() -> list[psutil.Process]:
        return [p for p in psutil.Process().children() if p.pid not in before]

    owned.own(_SESSION_KEY, lambda: owned.stop_processes(new_children(), timeout_s=5.0))
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
    try:
        ray.init(
            resources=dict(custom) or None,
            num_cpus=cfg.ray.num_cpus or max(2, int(np.ceil(need)) + 2),
            include_dashboard=False,
            _temp_dir=tempfile.mkdtemp(prefix="vintage-ray-"),
            runtime_env=env,
            log_to_driver=True,
            logging_level=logging.WARNING,  # no "Started a local Ray instance" line
        )
    except BaseException:
        owned.stop_processes(new_children(), timeout_s=5.0)
        owned.disown(_SESSION_KEY)
        raise
    started = new_children()
    owned.own(_SESSION_KEY, lambda: owned.stop_processes(started, timeout_s=5.0))
    return started


def loopback_private_cluster() -> None:
    """Give the processes of a private cluster started next from this process (``ray.init`` without
    an address) the loopback-only, token-authenticated environment
    (:func:`trainer.driver.cluster.netguard.private_cluster_env`, set in ``os.environ``), and make
    this process's Ray client authenticate to it. This process's own Ray port is covered only when
    it was started with the bind interposer; otherwise a warning says so.

    Raises:
        trainer.driver.cluster.netguard.LoopbackUnavailable: no C compiler to build the bind interposer.
    """
    from trainer.driver.cluster import netguard

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


class StopSignal:
    """SIGINT / SIGTERM ask the loop to stop; a second signal exits at once.

    The first signal sets :attr:`requested`: the loop leaves after the current step, the job
    checkpoints, stops every actor and writes ``summary.json`` (``end_reason = "interrupted"``).
    A second signal stops what this process owns (a private cluster: :mod:`trainer.driver.cluster.owned`)
    and ends the process immediately with status 130. Handlers are installed only in the main
    thread (a job run from another thread keeps the process's handlers).
    """

    def __init__(self) -> None:
        self.requested = False

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            owned.stop_owned()  # os._exit runs no exit handler
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


def start_status_server(cfg: JobConfig, board: StatusBoard, console: Console) -> ApiServer | None:
    """Start the HTTP status server of ``[server]`` over ``board`` (None when ``server.enabled`` is
    false). Its bearer token goes to ``<run_dir>/token`` (owner-only) and its URL to
    ``<run_dir>/server.json``; the console says where, and warns when a host that is not loopback
    makes every endpoint require the token."""
    if not cfg.server.enabled:
        return None
    run_dir = Path(cfg.logging.run_dir)
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
    return server
