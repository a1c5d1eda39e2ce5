"""Rehearse the borrowed GPU machine on this box: the GPU check with only what that machine has.

The borrowed machine offers torch, transformers, peft, safetensors, tensorboard, prometheus-client,
typer, rich, httpx (and pip), with their dependencies, and nothing else. This builds a folder of
links to exactly those distributions of this interpreter (:data:`BORROWED` and their requirements,
extras left out, every package of :data:`deploy.gpu_wheels.CARRIED` left out even when one of them
requires it), then runs ``python -S -m deploy.gpu_check`` with that folder and the repository as
the whole ``PYTHONPATH`` (``-S``: no site-packages at all), so the check must install the carried
wheels and can import nothing else::

    python -m deploy.gpu_wheels --python-version 3.11 --out /tmp/w311 --tokenizer-out /tmp/tok
    python -m deploy.gpu_rehearse --wheels /tmp/w311 --tokenizer /tmp/tok --out /tmp/rehearsal.json

Its folders stay under ``--work`` (the links ``borrowed/``, the installed wheels ``carried/``, and
``torch_extensions/``, where DeepSpeed's CPU op is JIT-built once for these paths).

What it cannot rehearse: the borrowed machine's Python (3.12; here the cp311 builds of the same
wheels are installed) and its CUDA torch (the checks run with ``--device cpu``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from deploy.gpu_wheels import CARRIED, REPO

BORROWED = ("torch", "transformers", "peft", "safetensors", "tensorboard", "prometheus-client", "typer", "rich")
BORROWED += ("httpx", "pip")
"""The distributions the borrowed machine has installed (their requirements come with them)."""


def canonical(name: str) -> str:
    """PEP 503 normalised distribution name: ``Typing_Extensions`` -> ``typing-extensions``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: tuple[str, ...] = BORROWED, leave_out: set[str] | None = None) -> list[metadata.Distribution]:
    """The installed distributions of ``roots`` and of their requirements, recursively (requirements
    behind an ``extra`` marker skipped, absent ones ignored), minus the names in ``leave_out``."""
    skip = {canonical(n) for n in (leave_out or set())}
    seen: dict[str, metadata.Distribution] = {}
    stack = list(roots)
    while stack:
        key = canonical(stack.pop())
        if key in seen or key in skip:
            continue
        try:
            dist = metadata.distribution(key)
        except metadata.PackageNotFoundError:
            continue
        seen[key] = dist
        for req in dist.requires or []:
            if "extra ==" not in req:
                stack.append(re.match(r"[A-Za-z0-9_.-]+", req).group(0))
    return [seen[k] for k in sorted(seen)]


def link_site(dists: list[metadata.Distribution], folder: Path) -> list[str]:
    """Link every top-level file or folder each distribution installed (its modules, its
    ``.dist-info``) into ``folder``; returns the linked names."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for dist in dists:
        root = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in sorted(tops):
            src, dst = root / top, folder / top
            if src.exists() and not dst.exists() and top != "__pycache__":
                dst.symlink_to(src)
                names.append(top)
    return names


def main(argv: list[str] | None = None) -> int:
    """Build the borrowed machine's site folder and run the CPU check under it; its exit status."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheels", required=True, help="carried wheels built for this interpreter")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", type=Path, default=REPO / "runs" / "gpu-rehearse" / "work")
    a = ap.parse_args(argv)
    site, carried = a.work / "borrowed", a.work / "carried"
    shutil.rmtree(site, ignore_errors=True)  # the links; the installed wheels are kept while they match
    dists = closure(leave_out={p.name for p in CARRIED})
    linked = link_site(dists, site)
    print(f"[gpu_rehearse] {len(dists)} distributions ({len(linked)} links) in {site}: "
          f"{', '.join(canonical(d.metadata['Name']) for d in dists)}")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PYTHONPATH=os.pathsep.join((str(site), str(REPO))), PYTHONNOUSERSITE="1")
    # DeepSpeed's CPU op is JIT-built against the carried copy: in a folder of its own, so no other
    # interpreter's build of it is touched
    env["TORCH_EXTENSIONS_DIR"] = str(a.work / "torch_extensions")
    cmd = [
        sys.executable,
        "-S",
        "-m",
        "deploy.gpu_check",
        "--device",
        "cpu",
        "--wheels",
        a.wheels,
        "--site",
        str(carried),
    ]
    cmd += ["--tokenizer", a.tokenizer, "--out", a.out, "--budget-s", "3600"]  # a first JIT build takes minutes
    return subprocess.run(cmd, cwd=REPO, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
