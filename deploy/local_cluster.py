"""Start and stop a private Ray head on loopback, with token auth, for `ray job submit` here.

Only the cluster this module started is ever stopped: its own temp dir and ports, stopped by the
process group of the ``ray start --block`` it launched and the descendants of its members (never
``ray stop``, never kill by name). The process that starts a head or a node stops it when it ends,
also by SIGTERM, SIGINT or SIGHUP (:mod:`trainer.driver.cluster.owned`), unless it hands the head over
(:meth:`LocalRayHead.release`, as the ``start`` command does).
Ray >= 2.59 turns token authentication on for local clusters; the head is started with
``RAY_AUTH_MODE=token`` and a generated ``RAY_AUTH_TOKEN``, and clients get the same two variables
from :meth:`LocalRayHead.client_env`.

    python -m deploy.local_cluster start --state /tmp/vintage-head.json
    RAY_AUTH_MODE=token RAY_AUTH_TOKEN=... ray job submit --address http://127.0.0.1:PORT -- vintage run ...
    python -m deploy.local_cluster stop --state /tmp/vintage-head.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from trainer.driver.cluster import owned
from trainer.driver.cluster.owned import stop_group


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on this machine now (all bound at once, so never the same twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def outside_private_cluster(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without what a private loopback cluster gives its processes (the loopback bind
    interposer in ``LD_PRELOAD`` and ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``, :mod:`trainer.driver.cluster.netguard`):
    a cluster started here from such a process (a test session, a job) is a cluster of its own, whose
    ``ray start --address`` would otherwise refuse a second node and resolve 127.0.0.1 to an address
    the head does not listen on. Its token is set by the caller."""
    from trainer.driver.cluster.netguard import MARK

    env = dict(environ)
    lib = env.pop(MARK, None)
    if lib:
        preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p != lib]
        env["LD_PRELOAD"] = ":".join(preload)
        if not preload:
            env.pop("LD_PRELOAD")
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    return env


@dataclass
class LocalRayHead:
    pid: int
    gcs_port: int
    dashboard_port: int
    temp_dir: str
    token: str

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def client_env(self) -> dict[str, str]:
        """Environment for `ray job submit` / `ray.init(address=...)` clients of this head."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}

    @classmethod
    def start(
        cls, num_cpus: int = 4, timeout_s: float = 120.0, resources: dict[str, float] | None = None
    ) -> LocalRayHead:
        """Start ``ray start --head --block`` on 127.0.0.1 and wait until the job API answers.

        ``resources``: Ray custom resources of the head node (e.g. ``{"learner_node": 1}``).

        Raises:
            RuntimeError: the head exited or the dashboard did not answer within ``timeout_s``.
        """
        temp_dir = tempfile.mkdtemp(prefix="vray-")
        token = secrets.token_hex(16)
        # Ray's fixed defaults (agent HTTP 52365, client server 10001) collide with any other Ray
        # on the machine (a test session's ray.init, another head): every port is picked free here.
        gcs, dash, agent_http, client = free_ports(4)
        bindir = str(Path(sys.executable).parent)  # job entrypoints (`vintage run`) use this environment
        env = {
            **outside_private_cluster(os.environ),
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": token,
            "RAY_memory_monitor_refresh_ms": "0",
            "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
        }
        ray_bin = str(Path(bindir) / "ray")
        cmd = [
            ray_bin,
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            "--include-dashboard=true",
            f"--dashboard-agent-listen-port={agent_http}",
            f"--ray-client-server-port={client}",
            f"--temp-dir={temp_dir}",
            f"--num-cpus={num_cpus}",
            f"--resources={json.dumps(resources or {})}",
            "--disable-usage-stats",
        ]
        log = open(Path(temp_dir) / "ray-start.log", "w")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        head = cls(pid=proc.pid, gcs_port=gcs, dashboard_port=dash, temp_dir=temp_dir, token=token)
        owned.own(head.owner_key, functools.partial(head.stop, 10.0))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                head.stop(10.0)
                raise RuntimeError(f"ray start exited with {proc.returncode}; see {log.name}")
            try:
                r = httpx.get(
                    f"{head.dashboard_url}/api/version", headers={"Authorization": f"Bearer {token}"}, timeout=2
                )
                if r.status_code == 200:
                    return head
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        head.stop()
        raise RuntimeError(f"Ray dashboard did not answer on {head.dashboard_url} within {timeout_s} s")

    def add_node(
        self, num_cpus: int = 2, resources: dict[str, float] | None = None, timeout_s: float = 120.0
    ) -> LocalRayNode:
        """Start a second node of this cluster on this machine (``ray start --address ... --block``
        on 127.0.0.1, every port picked free) and wait until the head lists it alive.

        Raises:
            RuntimeError: the node exited or did not join within ``timeout_s``.
        """
        node_manager, object_manager, agent_http, agent_grpc, metrics, runtime_env = free_ports(6)
        resources = {**(resources or {}), f"vintage_node_{node_manager}": 1.0}  # tells this node apart
        env = {**outside_private_cluster(os.environ), **self.client_env(), "RAY_memory_monitor_refresh_ms": "0"}
        cmd = [
            str(Path(sys.executable).parent / "ray"), "start", "--block", f"--address={self.gcs_address}",
            "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}", f"--resources={json.dumps(resources)}",
            f"--node-manager-port={node_manager}", f"--object-manager-port={object_manager}",
            f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={runtime_env}", "--disable-usage-stats",
        ]  # fmt: skip
        log = open(Path(self.temp_dir) / f"ray-node-{node_manager}.log", "w")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        node = LocalRayNode(pid=proc.pid, node_manager_port=node_manager)
        owned.own(node.owner_key, functools.partial(node.stop, 10.0))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                node.stop(10.0)
                raise RuntimeError(f"ray start (node) exited with {proc.returncode}; see {log.name}")
            if node.resource in self.alive_resources():
                return node
            time.sleep(1.0)
        node.stop()
        raise RuntimeError(f"Ray node on port {node_manager} did not join within {timeout_s} s")

    def alive_resources(self) -> set[str]:
        """Names of the resources of every node the head lists alive (its state API, with the token);
        a node started by :meth:`add_node` has its own ``vintage_node_<port>``."""
        try:
            r = httpx.get(
                f"{self.dashboard_url}/api/v0/nodes", params={"limit": 100},
                headers={"Authorization": f"Bearer {self.token}"}, timeout=5,
            )  # fmt: skip
            rows = r.json()["data"]["result"]["result"] if r.status_code == 200 else []
        except (httpx.HTTPError, KeyError, TypeError, ValueError):
            return set()
        return {k for n in rows if n.get("state") == "ALIVE" for k in n.get("resources_total", {})}

    @property
    def owner_key(self) -> tuple[str, int]:
        """This head's key in :mod:`trainer.driver.cluster.owned` (its process group)."""
        return ("ray_head", self.pid)

    def release(self) -> None:
        """Hand this head over: the process that started it no longer stops it when it ends."""
        owned.disown(self.owner_key)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop exactly this head: SIGTERM then SIGKILL to its process group (and the descendants
        of its members); remove its temp dir. Idempotent."""
        stop_group(self.pid, timeout_s)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        owned.disown(self.owner_key)


@dataclass
class LocalRayNode:
    """A non-head node started by :meth:`LocalRayHead.add_node` (its ``ray start --block`` PID)."""

    pid: int
    node_manager_port: int

    @property
    def resource(self) -> str:
        """The custom resource only this node has (see :meth:`LocalRayHead.alive_resources`)."""
        return f"vintage_node_{self.node_manager_port}"

    @property
    def owner_key(self) -> tuple[str, int]:
        """This node's key in :mod:`trainer.driver.cluster.owned` (its process group)."""
        return ("ray_node", self.pid)

    def stop(self, timeout_s: float = 30.0, sig: int = signal.SIGTERM) -> None:
        """Stop exactly this node's processes (its process group and the descendants of its
        members): ``sig`` first, then SIGKILL. Idempotent."""
        stop_group(self.pid, timeout_s, first=sig)
        owned.disown(self.owner_key)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["start", "stop"])
    ap.add_argument("--state", default="runs/ray-head.json", help="where the head's PID, ports and token are kept")
    ap.add_argument("--num-cpus", type=int, default=4)
    a = ap.parse_args()
    state = Path(a.state)
    if a.action == "start":
        head = LocalRayHead.start(num_cpus=a.num_cpus)
        head.release()  # it outlives this command: `stop` ends it
        state.parent.mkdir(parents=True, exist_ok=True)
        state.write_text(json.dumps(asdict(head)))
        os.chmod(state, 0o600)
        print(json.dumps({"dashboard": head.dashboard_url, "gcs": head.gcs_address, "state": str(state)}))
    else:
        LocalRayHead(**json.loads(state.read_text())).stop()
        state.unlink()


if __name__ == "__main__":
    main()
