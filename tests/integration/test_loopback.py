"""A private cluster listens on loopback only: the bind interposer, and a whole `vintage run` job.

The job runs as a user starts it (the `vintage` CLI in a subprocess, private local Ray cluster,
tiny model, the transformers engine); from start-up to exit, every TCP/UDP socket its process tree
listens on is listed twice a second, and each must be in 127.0.0.0/8 or ``::1``. The same job is
stopped with SIGTERM and must end cleanly.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rollout.httpserve import is_loopback_host
from trainer.driver.cluster import netguard, owned
from trainer.driver.cluster.netguard import library_path, listening_sockets, loopback_env

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

BIND = """
import socket
for fam, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::"), (socket.AF_INET, "127.0.0.2")):
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.bind((host, 0))
    print(s.getsockname()[0])
v6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
v6.bind(("::", 0))
print(v6.getsockname()[0])
"""


def test_interposer_turns_wildcard_binds_into_loopback():
    out = subprocess.run([sys.executable, "-c", BIND], env=loopback_env(), capture_output=True, text=True, check=True)
    # 0.0.0.0 -> 127.0.0.1; dual-stack :: -> IPv4-mapped loopback; explicit hosts untouched; v6-only :: -> ::1
    assert out.stdout.split() == ["127.0.0.1", "::ffff:127.0.0.1", "127.0.0.2", "::1"]
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "VINTAGE_LOOPBACK_BIND")}
    plain = subprocess.run([sys.executable, "-c", BIND], env=env, capture_output=True, text=True, check=True)
    assert plain.stdout.split() == ["0.0.0.0", "::", "127.0.0.2", "::"]


IN_PROCESS = """
import ray
from trainer.driver.config.schema import load_config
from trainer.driver.cluster.session import ray_session

with ray_session(load_config(None, ['model.path="tiny"', "rollout.num_workers=1"])):
    print(ray.get(ray.remote(lambda: 6 * 7).remote()))
"""


def test_private_cluster_started_in_process_authenticates_its_own_driver():
    """A job started from Python (``run_job`` in a benchmark or a notebook, not ``vintage run``):
    Ray read its token-auth mode when it was imported, so the driver must refresh it to talk to
    the token-authenticated cluster it starts; its own port is not covered, and it says so."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "VINTAGE_LOOPBACK_BIND", "RAY_AUTH_MODE")}
    out = subprocess.run(
        [sys.executable, "-c", IN_PROCESS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.split()[-1] == "42", out.stderr[-2000:]
    assert "its own Ray port listens on every interface" in out.stderr


def test_the_test_sessions_cluster_listens_on_loopback_only_with_token_authentication(ray_cluster):
    """The session's shared cluster (``ray_cluster``): every socket its processes (this process's
    children: GCS, raylet, workers) listen on is on loopback, they were started with token
    authentication, and this process's environment no longer carries the cluster's settings. Under
    ``make test`` (pytest started with the bind interposer) the test process's own sockets, its Ray
    driver port among them, are on loopback too."""
    own = netguard.active()
    sockets = [s for s in listening_sockets(os.getpid()) if own or s[0] != os.getpid()]
    names = {name for _pid, name, _host, _port in sockets}
    assert {"gcs_server", "raylet"} <= names, sockets
    assert [s for s in sockets if not is_loopback_host(s[2])] == []
    gcs = next(psutil.Process(pid) for pid, name, _h, _p in sockets if name == "gcs_server")
    assert gcs.environ()["RAY_AUTH_MODE"] == "token" and len(gcs.environ()["RAY_AUTH_TOKEN"]) >= 16
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ
    assert ray_cluster.get(ray_cluster.remote(lambda: 6 * 7).remote()) == 42  # the driver still authenticates


def test_loopback_classification():
    assert [is_loopback_host(h) for h in ("127.0.0.1", "127.5.0.1", "::1", "::ffff:127.0.0.1")] == [True] * 4
    assert [is_loopback_host(h) for h in ("0.0.0.0", "::", "192.0.2.2", "::ffff:10.0.0.1")] == [False] * 4
    assert is_loopback_host("localhost") and not is_loopback_host("example.org")


def test_running_job_listens_on_loopback_only_and_stops_cleanly_on_sigterm(tmp_path, tiny_model_path):
    """Sockets are sampled from start-up to exit; after two steps the job gets SIGTERM: it stops
    after the current step, checkpoints, and exits 0 with ``end_reason = "interrupted"``."""
    library_path()  # built before the job starts, as `make install` does
    run_dir = tmp_path / "run"
    cmd = [
        str(Path(sys.executable).parent / "vintage"), "run", str(ROOT / "deploy/configs/tiny.toml"),
        "--set", f'logging.run_dir="{run_dir}"', "--set", "controller.total_steps=40",
        "--set", "env.eval_prompts=0", "--set", "ray.num_cpus=4",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "VINTAGE_LOOPBACK_BIND")}
    log = tmp_path / "out.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    owned.own(("job", proc.pid), functools.partial(owned.stop_group, proc.pid, 10.0))  # also if pytest is ended
    seen: dict[tuple[str, int], set[str]] = {}  # every name a socket was seen under: one that exits reads "?"
    metrics, signalled = run_dir / "metrics.jsonl", False
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:  # from start-up to shutdown
            for _pid, name, host, port in listening_sockets(proc.pid):
                seen.setdefault((host, port), set()).add(name)
            if not signalled and metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                proc.send_signal(signal.SIGTERM)
                signalled = True
            time.sleep(0.5)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        owned.disown(("job", proc.pid))
    assert proc.returncode == 0, log.read_text()[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["end_reason"] == "interrupted" and 2 <= summary["steps"] < 40 and summary["accounting_ok"]
    assert (run_dir / "checkpoints").is_dir()
    assert "Started a local Ray instance" not in log.read_text()  # Ray's start-up INFO line is off
    names = set().union(*seen.values())
    # the cluster's own servers and the learner were inspected while the job trained (the kernel
    # keeps the first 15 characters of a process name: "ray::LearnerCor")
    assert {"gcs_server", "raylet"} <= names and any("LearnerCor" in n for n in names), seen
    exposed = {f"{h}:{p}": n for (h, p), n in seen.items() if not is_loopback_host(h)}
    assert exposed == {}
