"""Keep a private Ray cluster's sockets on loopback.

Ray's gRPC servers (GCS, raylet, every worker and the driver) listen on every interface whatever
node address they are given, and Ray's GCS accepts job submissions: on a shared host that is code
execution for anyone who can reach the port. :func:`loopback_env` returns the environment that
makes every process started from it bind wildcard addresses to loopback instead (a small
``bind()`` interposer, ``loopback_bind.c``, loaded with ``LD_PRELOAD``; built once per virtual
environment with the system C compiler), and :func:`listening_sockets` lists what a process tree
listens on, to check it.

Only processes *started* with that environment are covered: the CLI re-executes itself with it
(:func:`reexec_with_loopback`) so the driver's own Ray port is covered too.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("loopback_bind.c")
MARK = "VINTAGE_LOOPBACK_BIND"
"""Set (to the library's path) in the environment of a process started with the interposer."""


class LoopbackUnavailable(RuntimeError):
    """The interposer cannot be built or loaded on this machine."""


def library_path(build_dir: str | os.PathLike | None = None) -> Path:
    """Path of the built interposer, building it first when missing (one build per source digest).

    ``build_dir`` defaults to ``<sys.prefix>/lib/vintage``. The build writes a temp file and renames
    it, so concurrent builds never leave a partial library.

    Raises:
        LoopbackUnavailable: no C compiler (``cc``/``gcc``) on ``PATH``, or the build failed.
    """
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    out_dir = Path(build_dir) if build_dir else Path(sys.prefix) / "lib" / "vintage"
    lib = out_dir / f"loopback_bind-{digest}.so"
    if lib.is_file():
        return lib
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise LoopbackUnavailable("ray.loopback_only: no C compiler (cc/gcc) on PATH to build the bind interposer")
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        r = subprocess.run(
            [cc, "-shared", "-fPIC", "-O2", "-o", tmp, str(SOURCE), "-ldl"], capture_output=True, text=True
        )
        if r.returncode != 0:
            raise LoopbackUnavailable(
                f"ray.loopback_only: building the bind interposer failed: {r.stderr.strip()[-300:]}"
            )
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def loopback_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: ``os.environ``) with the interposer prepended to ``LD_PRELOAD``.

    Raises:
        LoopbackUnavailable: see :func:`library_path`.
    """
    env = dict(os.environ if environ is None else environ)
    lib = str(library_path())
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p != lib]
    env["LD_PRELOAD"] = ":".join([lib, *preload])
    env[MARK] = lib
    return env


def private_cluster_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """:func:`loopback_env` plus what makes a private Ray cluster loopback-only and authenticated.

    * ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: Ray then takes the loopback address as the node's
      address (GCS, raylet and object manager addresses are 127.0.0.1, so every peer reaches the
      loopback-bound servers);
    * ``RAY_AUTH_MODE=token`` with a fresh 32-hex-digit ``RAY_AUTH_TOKEN`` (kept if already set):
      every gRPC call, job submissions included, must carry the token.

    Raises:
        LoopbackUnavailable: see :func:`library_path`.
    """
    env = loopback_env(environ)
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    env["RAY_AUTH_MODE"] = "token"
    if len(env.get("RAY_AUTH_TOKEN", "")) < 16:
        env["RAY_AUTH_TOKEN"] = secrets.token_hex(16)
    return env


def active() -> bool:
    """True when this process was started with the interposer loaded."""
    lib = os.environ.get(MARK)
    return bool(lib) and lib in os.environ.get("LD_PRELOAD", "").split(":")


def reexec_with_loopback() -> None:
    """Replace this process by the same command started with :func:`private_cluster_env` (no return).

    Does nothing when the interposer is already loaded. Uses ``sys.orig_argv`` so ``python -m ...``
    and console scripts are re-run exactly as invoked.

    Raises:
        LoopbackUnavailable: see :func:`library_path`.
    """
    if active():
        return
    env = private_cluster_env()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def listening_sockets(root_pid: int) -> list[tuple[int, str, str, int]]:
    """``(pid, process name, host, port)`` of every TCP/UDP socket listening in ``root_pid``'s tree."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        pids = {root_pid} | {p.pid for p in root.children(recursive=True)}
    except psutil.NoSuchProcess:
        return []
    out = []
    for c in psutil.net_connections("inet"):
        if c.pid in pids and c.laddr and (c.status == psutil.CONN_LISTEN or c.type == 2):  # 2: SOCK_DGRAM
            try:
                name = psutil.Process(c.pid).name()
            except psutil.NoSuchProcess:
                name = "?"
            out.append((c.pid, name, c.laddr.ip, c.laddr.port))
    return sorted(out)
