"""What the GPU check carries to a borrowed machine: wheels for the packages it lacks, and a tokenizer.

The borrowed machine (one GPU, Python 3.12, torch, transformers, peft and their dependencies, no
package registry, no model hub) lacks pydantic, DeepSpeed and a few small libraries vintage's
plain classes import. This module fills two ignored folders of the working tree, which then travel
with it (``carry = ["deploy/gpu"]``):

* ``deploy/gpu/wheels/``: one wheel per entry of :data:`CARRIED`, at the version installed here
  (the version the tests ran with). Binary wheels are downloaded for the target interpreter
  (``pip download --only-binary=:all: --python-version 3.12 --platform ... --no-deps``); DeepSpeed,
  published as an sdist only, is built here into a ``py3-none-any`` wheel with its ops left out
  (``DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation``): the learner passes torch's own
  AdamW, so no DeepSpeed kernel is used on the GPU (on CPU its communication op is JIT-built, which
  needs the carried ``ninja``);
* ``deploy/gpu/tokenizer/``: SmolLM2's tokenizer files (``tokenizer.json``,
  ``tokenizer_config.json``, ``chat_template.jinja``), from which the check builds the tiny random
  model (``modelkit.modelhub.make_tiny_model``); the model weights are never carried.

Every file is listed with its size, and the run fails when the carried total exceeds
``--limit-mib`` (60 MiB; what one device call may carry is 64 MiB, the repository's tracked files
included)::

    python -m deploy.gpu_wheels                        # cp312 wheels (the borrowed machine)
    python -m deploy.gpu_wheels --python-version 3.11  # this box's interpreter, for a rehearsal
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from importlib import metadata, util
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WHEELS = REPO / "deploy" / "gpu" / "wheels"
DEFAULT_TOKENIZER = REPO / "deploy" / "gpu" / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
"""The files of an HF folder that ``AutoTokenizer.from_pretrained`` and the chat template need."""
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_28_x86_64")
"""Platform tags accepted for binary wheels: glibc 2.17 and 2.28 (torch's own CUDA wheels need 2.28)."""
LIMIT_MIB = 60.0
"""Default ceiling of the carried total (wheels + tokenizer), MiB."""

Kind = Literal["binary", "pure", "sdist"]


@dataclass(frozen=True)
class Carried:
    """One package the borrowed machine lacks.

    Attributes:
        name: its distribution name on the package index.
        kind: ``binary`` (a compiled wheel for the target interpreter and platform), ``pure`` (a
            ``py3-none-any`` wheel) or ``sdist`` (built into a wheel here).
        why: who imports it.
    """

    name: str
    kind: Kind
    why: str
    module: str = ""
    """The top-level module it installs; empty when that module is the name with ``-`` as ``_``."""

    @property
    def import_name(self) -> str:
        """The module whose absence shows the package is missing."""
        return self.module or self.name.replace("-", "_")


CARRIED: tuple[Carried, ...] = (
    Carried("pydantic", "pure", "protocol messages, learner settings, engine config"),
    Carried("pydantic-core", "binary", "pydantic's validator"),
    Carried("annotated-types", "pure", "pydantic"),
    Carried("typing-inspection", "pure", "pydantic"),
    Carried("typing-extensions", "pure", "pydantic (a release at least as new as pydantic needs)"),
    Carried("deepspeed", "sdist", "the learner's engine"),
    Carried("hjson", "pure", "deepspeed config"),
    Carried("py-cpuinfo", "pure", "deepspeed accelerator detection", module="cpuinfo"),
    Carried("msgpack", "binary", "deepspeed"),
    Carried("einops", "pure", "deepspeed"),
    Carried("ninja", "binary", "deepspeed's JIT build of its CPU communication op (CPU runs only)"),
    Carried("xxhash", "binary", "publication checksums (protocol.weights_digest)"),
)
"""What travels, in install order. Everything else the check imports (torch, transformers, numpy,
safetensors, tokenizers, packaging, psutil, tqdm) is on the borrowed machine."""
SITE_ENV = "VINTAGE_GPU_CHECK_SITE"
"""Set in a run started by :func:`rerun_with_wheels`: the folder the carried wheels were installed into."""


def pinned_versions(packages: tuple[Carried, ...] = CARRIED) -> dict[str, str]:
    """``{name: version}`` of each package as installed in this interpreter.

    Raises:
        LookupError: a package is not installed here (the message names it).
    """
    out = {}
    for p in packages:
        try:
            out[p.name] = metadata.version(p.name)
        except metadata.PackageNotFoundError:
            raise LookupError(
                f"{p.name}: not installed in {sys.prefix}; install vintage first (make install)"
            ) from None
    return out


def download_command(p: Carried, version: str, dest: Path, python_version: str) -> list[str]:
    """The ``pip`` arguments that fetch ``p`` at ``version`` into ``dest`` (a wheel, or the sdist).

    Binary wheels are asked for the target interpreter (``--python-version``, cpython ABI) and every
    platform of :data:`PLATFORMS`; pure wheels need only ``--only-binary``.

    Raises:
        ValueError: ``python_version`` is not ``MAJOR.MINOR`` (e.g. ``3.12``).
    """
    parts = python_version.split(".")
    if len(parts) != 2 or not all(x.isdigit() for x in parts):
        raise ValueError(f"python_version: {python_version!r} is not MAJOR.MINOR (e.g. 3.12)")
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), f"{p.name}=={version}"]
    if p.kind == "sdist":
        return [*base, "--no-binary", ":all:"]
    if p.kind == "pure":
        return [*base, "--only-binary", ":all:"]
    plats = [x for plat in PLATFORMS for x in ("--platform", plat)]
    return [*base, "--only-binary", ":all:", "--python-version", python_version, "--implementation", "cp", *plats]


def build_sdist_wheel(sdist: Path, dest: Path) -> Path:
    """Build ``sdist`` into a wheel in ``dest`` with DeepSpeed's ops left out; returns the wheel.

    Raises:
        RuntimeError: pip failed, or the wheel is not ``py3-none-any`` (something was compiled).
    """
    env = {**os.environ, "DS_BUILD_OPS": "0", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dest), str(sdist)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1 or not wheels[0].name.endswith("-py3-none-any.whl"):
        raise RuntimeError(f"build of {sdist.name}: expected one py3-none-any wheel, got {[w.name for w in wheels]}")
    return wheels[0]


def fetch(p: Carried, version: str, dest: Path, python_version: str) -> Path:
    """Download (or build) the wheel of ``p`` into ``dest``; returns its path.

    Raises:
        RuntimeError: pip failed or left no single file (the message names the package).
    """
    with tempfile.TemporaryDirectory(prefix=f"vintage-{p.name}-") as tmp:
        cmd = download_command(p, version, Path(tmp), python_version)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = sorted(Path(tmp).iterdir())
        if proc.returncode != 0 or len(got) != 1:
            raise RuntimeError(f"{p.name}=={version}: {' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
        wheel = build_sdist_wheel(got[0], Path(tmp) / "built") if p.kind == "sdist" else got[0]
        return Path(shutil.copy2(wheel, dest / wheel.name))


def copy_tokenizer(src: Path, dest: Path) -> list[Path]:
    """Copy :data:`TOKENIZER_FILES` of the HF folder ``src`` into ``dest``; returns the copies.

    Raises:
        FileNotFoundError: a file is missing in ``src`` (the message names it).
    """
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for name in TOKENIZER_FILES:
        if not (src / name).is_file():
            raise FileNotFoundError(f"tokenizer: {src / name} missing")
        out.append(Path(shutil.copy2(src / name, dest / name)))
    return out


def size_report(files: list[Path]) -> tuple[list[str], int]:
    """One line per file (``name  size MiB``, largest first) and a total line; the total in bytes.

    MiB are 2**20 bytes, printed with two decimals. Example: files of 1 MiB and 0.5 MiB give the
    lines ``"a.whl     1.00 MiB"``, ``"b.whl     0.50 MiB"`` and a total of 1,572,864 bytes.
    """
    sized = sorted(((f.stat().st_size, f.name) for f in files), key=lambda x: (-x[0], x[1]))
    total = sum(s for s, _ in sized)
    label = f"total ({len(sized)} files)"
    width = max([len(n) for _, n in sized] + [len(label)])
    lines = [f"{n:<{width}}  {s / 2**20:7.2f} MiB" for s, n in sized]
    lines.append(f"{label:<{width}}  {total / 2**20:7.2f} MiB")
    return lines, total


def check_limit(total_bytes: int, limit_mib: float = LIMIT_MIB) -> None:
    """Raise when the carried total is over the limit.

    Raises:
        ValueError: ``total_bytes`` > ``limit_mib`` * 2**20 (the message names both).
    """
    if total_bytes > limit_mib * 2**20:
        raise ValueError(f"carried total: {total_bytes / 2**20:.2f} MiB is over --limit-mib {limit_mib:g}")


def missing_modules(packages: tuple[Carried, ...] = CARRIED) -> list[str]:
    """The import names of ``packages`` that this interpreter cannot import, in order."""
    return [p.import_name for p in packages if util.find_spec(p.import_name) is None]


def _interpreter_flags() -> list[str]:
    """The site-related flags this interpreter runs with, for the interpreters it starts."""
    return [f for f, on in (("-S", sys.flags.no_site), ("-s", sys.flags.no_user_site)) if on]


def install_wheels(wheels: Path, target: Path) -> str:
    """Install every ``*.whl`` of ``wheels`` into ``target``, without an index or dependencies.

    With pip (``pip install --no-index --no-deps --target``, which refuses a wheel whose tags do
    not fit this interpreter) when this interpreter has it, else by unpacking each wheel into
    ``target`` (a wheel is a zip of its installed files). A ``target`` that already holds these
    wheels (its ``.vintage-wheels`` record lists the same names and sizes) is kept as it is, so
    what was JIT-built against it stays valid. Returns ``"pip"``, ``"unzip"`` or ``"kept"``.

    Raises:
        FileNotFoundError: ``wheels`` holds no wheel (the message says how to fill it).
        RuntimeError: pip failed (its output tail in the message).
    """
    files = sorted(wheels.glob("*.whl"))
    if not files:
        raise FileNotFoundError(f"--wheels: no *.whl in {wheels}; run `make gpu-wheels` where a registry is reachable")
    record = "".join(f"{f.name} {f.stat().st_size}\n" for f in files)
    marker = target / ".vintage-wheels"
    if marker.is_file() and marker.read_text() == record:
        return "kept"
    target.mkdir(parents=True, exist_ok=True)
    how = _install(files, target)
    marker.write_text(record)
    return how


def _install(files: list[Path], target: Path) -> str:
    """pip (``--no-index --no-deps --upgrade --target``) or, without pip, unzip each wheel into ``target``."""
    if util.find_spec("pip") is None:
        for f in files:
            with zipfile.ZipFile(f) as z:
                z.extractall(target)
        return "unzip"
    cmd = [sys.executable, *_interpreter_flags(), "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    cmd += ["--disable-pip-version-check", "--upgrade", "--target", str(target), *map(str, files)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"pip install --target {target} exited {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}"
        )
    return "pip"


def rerun_with_wheels(module: str, argv: list[str], wheels: Path, site: Path | None = None) -> int:
    """Install the carried wheels into ``site`` (default: a temporary folder, removed afterwards) and
    run ``python -m module argv`` with it first on ``PYTHONPATH``, its ``bin`` on ``PATH`` and
    :data:`SITE_ENV` set; returns that run's exit status."""
    folder = site or Path(tempfile.mkdtemp(prefix="vintage-gpu-site-"))
    t0 = time.perf_counter()
    try:
        how = install_wheels(wheels, folder)
        print(f"[gpu_wheels] {wheels}/*.whl -> {folder}: {how} ({time.perf_counter() - t0:.1f} s)")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), str(REPO), env.get("PYTHONPATH", "")) if p)
        env["PATH"] = os.pathsep.join((str(folder / "bin"), env.get("PATH", "")))
        env[SITE_ENV] = str(folder)
        return subprocess.run(
            [sys.executable, *_interpreter_flags(), "-m", module, *argv], cwd=REPO, env=env
        ).returncode
    finally:
        if site is None:
            shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Fill the wheel and tokenizer folders, print the sizes; exit 1 when over the limit."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_WHEELS, help="wheel folder (emptied first)")
    ap.add_argument("--tokenizer-out", type=Path, default=DEFAULT_TOKENIZER)
    ap.add_argument("--python-version", default="3.12", help="target interpreter of the binary wheels")
    ap.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    a = ap.parse_args(argv)
    from modelkit.modelhub import prepare_smollm2

    versions = pinned_versions()
    shutil.rmtree(a.out, ignore_errors=True)
    a.out.mkdir(parents=True)
    wheels = []
    for p in CARRIED:
        print(f"[gpu_wheels] {p.name}=={versions[p.name]} ({p.kind}) ...", flush=True)
        wheels.append(fetch(p, versions[p.name], a.out, a.python_version))
    tok = copy_tokenizer(prepare_smollm2(log=lambda *x, **k: None), a.tokenizer_out)
    lines, total = size_report(wheels + tok)
    print("\n".join(lines))
    print(f"[gpu_wheels] wheels in {a.out}, tokenizer in {a.tokenizer_out}")
    try:
        check_limit(total, a.limit_mib)
    except ValueError as e:
        print(f"[gpu_wheels] {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
