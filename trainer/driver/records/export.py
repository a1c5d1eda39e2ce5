"""Export a checkpointed version of a run as a Hugging Face folder (``vintage export``).

Reads only files, never starts a learner, DeepSpeed engine or Ray: the run folder's
``config.resolved.json`` (``model.path``: the base model folder, its config and tokenizer) and the
checkpoint ``<run_dir>/checkpoints/v{N}`` (:func:`trainer.learner.checkpoint.read_weights`: the
weights on CPU, in the learner's dtype, every ZeRO stage). What is written (``kind``):

- ``full`` (a full-weight run): ``config.json``, ``model.safetensors`` (tied weights stored once, as
  ``save_pretrained`` stores them), ``generation_config.json`` (the base folder's), tokenizer files;
  ``transformers.AutoModelForCausalLM.from_pretrained`` loads it.
- ``adapter`` (a LoRA run): peft's ``adapter_config.json`` and ``adapter_model.safetensors`` plus the
  tokenizer; ``peft.PeftModel.from_pretrained(base, folder)`` loads it on the base model.
- ``merged`` (a LoRA run with ``merge``): a ``full`` folder of ``W0 + (alpha / r) * B @ A``
  (:func:`modelkit.lora.merged_weights`), the weights rollout workers run for that version.

Every folder also holds :data:`RECORD_FILE` (the run, version, kind, dtype, base folder, ZeRO stage,
sampling temperature: the exported model's log-probs equal the learner's at that temperature).

Invariant: a folder at ``out`` is whole. It is written beside ``out`` and renamed into place, so a
failed export leaves ``out`` as it was. Its files have ordinary permissions (0644 and folders 0755
under the usual umask 022, :func:`ordinary_permissions`): safetensors writes its files owner-only
(0600), which a model server running as another user could not read.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

RESOLVED_CONFIG = "config.resolved.json"
RECORD_FILE = "vintage-export.json"


class ExportRecord(BaseModel):
    """What one export wrote (also saved as :data:`RECORD_FILE` in the folder)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_dir: str
    version: int
    """The policy version exported: the number of rollout batches the learner has trained on with at
    least one applied optimizer step (one version per batch, whatever its number of optimizer steps)."""
    kind: Literal["full", "adapter", "merged"]
    out: str
    dtype: str
    """Dtype of the saved weights: the learner's (``learner.dtype``)."""
    base_model: str
    """The base model folder (``model.path`` resolved): config, tokenizer, and with LoRA the base weights."""
    zero_stage: int
    temperature: float
    """The run's sampling temperature; the learner's log-probs are of ``softmax(logits / T)``."""
    lora: dict[str, Any] | None = None
    """Rank, alpha and target modules of a LoRA run, else None."""


class ExportError(ValueError):
    """An export that cannot be made; the one-line message names the argument and its value."""


VersionChoice = int | Literal["latest", "best"]
"""A checkpointed version number, ``"latest"`` (the resume point) or ``"best"`` (the best pinned
held-out evaluation's version, :func:`best_version`)."""


def parse_version(value: str) -> VersionChoice:
    """``"latest"``, ``"best"`` or a version number (``"12"`` -> 12).

    Raises:
        ExportError: none of them (the message names ``--version`` and the value).
    """
    if value in ("latest", "best"):
        return value
    if not value.isdigit():
        raise ExportError(f"--version: {value!r} is not a version number, 'latest' or 'best'")
    return int(value)


def best_version(run_dir: str | Path) -> int:
    """The version of the run's best pinned held-out evaluation (``controller.keep_best``):
    the one ``<run_dir>/checkpoints/vintage_best.json`` names (kept current while the run goes),
    else ``summary.json``'s ``best_version``.

    Raises:
        ExportError: neither names one (the message names ``--version best`` and ``run_dir``), or
            the record is malformed.
    """
    from trainer.learner.checkpoint import read_best

    d = Path(run_dir)
    try:
        record = read_best(d / "checkpoints")
    except ValueError as e:
        raise ExportError(f"--version best: {e}") from None
    if record is None and (d / "summary.json").is_file():
        try:
            record = {"version": json.loads((d / "summary.json").read_text()).get("best_version")}
        except (json.JSONDecodeError, AttributeError):
            record = None
    version = (record or {}).get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ExportError(
            f"--version best: {str(run_dir)!r} has no best version (no pinned held-out evaluation was kept: "
            "it needs controller.eval_every > 0 and controller.keep_best = true)"
        )
    return version


def run_config(run_dir: str | Path) -> dict[str, Any]:
    """The resolved config a run wrote (plain JSON; secrets are redacted there).

    Raises:
        ExportError: ``run_dir`` is not a folder or holds no :data:`RESOLVED_CONFIG`.
    """
    d = Path(run_dir)
    if not d.is_dir():
        raise ExportError(f"RUN_DIR: {str(run_dir)!r} is not a folder")
    path = d / RESOLVED_CONFIG
    if not path.is_file():
        raise ExportError(f"RUN_DIR: {str(run_dir)!r} has no {RESOLVED_CONFIG} (not a vintage run folder)")
    return json.loads(path.read_text())


def checkpoint_tag(run_dir: str | Path, version: VersionChoice) -> str:
    """The tag of ``version``'s complete checkpoint in ``<run_dir>/checkpoints`` (``"best"``:
    :func:`best_version`'s, e.g. ``"v20"``).

    Raises:
        ExportError: no complete checkpoint at all, no best version, or none of ``version`` (the
            message lists the versions that are checkpointed).
    """
    from trainer.learner.checkpoint import checkpointed_versions, latest_tag, version_tag

    ckpt = Path(run_dir) / "checkpoints"
    have = checkpointed_versions(ckpt)
    if not have:
        raise ExportError(f"--version {version}: no complete checkpoint in {ckpt}")
    if version == "latest":
        return latest_tag(ckpt) or version_tag(have[-1])
    name = version
    if version == "best":
        version = best_version(run_dir)
        name = f"best (version {version})"
    if version not in have:
        raise ExportError(f"--version {name}: not checkpointed in {ckpt} (checkpointed: {', '.join(map(str, have))})")
    return version_tag(version)


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out: {str(out)!r} is a file")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"--out: {str(out)!r} exists and is not empty (--overwrite replaces it)")


def export_run(
    run_dir: str | Path,
    out: str | Path,
    version: VersionChoice = "latest",
    merge: bool = False,
    overwrite: bool = False,
) -> ExportRecord:
    """Write version ``version`` of the run in ``run_dir`` as a Hugging Face folder at ``out``
    (``"latest"``: the resume point; ``"best"``: the best pinned held-out evaluation's version).

    Every argument is checked before any weight is read. A full-weight run gives a ``full`` folder;
    a LoRA run an ``adapter`` folder, or with ``merge`` a ``merged`` full folder.

    Raises:
        ExportError: ``run_dir`` is not a run folder, ``version`` is not checkpointed there (or the
            run has no best version), ``merge``
            on a run without LoRA, or ``out`` is a file or a non-empty folder (without ``overwrite``).
        FileNotFoundError: a checkpoint file or the base model folder is missing (the message names it).
        ValueError: the checkpoint's weights do not fit the base model's architecture.
    """
    from trainer.learner.checkpoint import read_state

    cfg = run_config(run_dir)
    tag = checkpoint_tag(run_dir, version)
    ckpt = Path(run_dir) / "checkpoints"
    state = read_state(ckpt, tag)
    settings = state.get("settings") or {}
    lora = settings.get("lora") or {"enabled": False}
    if merge and not lora["enabled"]:
        raise ExportError("--merge: the run trained full weights (lora.enabled = false); its export is a full model")
    out = Path(out)
    _check_out(out, overwrite)
    from modelkit.modelhub import model_folder

    model = cfg.get("model") or {}
    base = model_folder(str(model.get("path", "smollm2")), int(model.get("tiny_seed", 0)))
    kind: Literal["full", "adapter", "merged"] = "full" if not lora["enabled"] else "merged" if merge else "adapter"
    record = ExportRecord(
        run_dir=str(run_dir), version=int(state["version"]), kind=kind, out=str(out),
        dtype=str(settings.get("dtype", "float32")), base_model=str(base), zero_stage=int(settings.get("zero_stage", 0)),
        temperature=float(settings.get("temperature", 1.0)),
        lora={k: lora[k] for k in ("rank", "alpha", "target_modules")} if lora["enabled"] else None,
    )  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write(record, ckpt, tag, base, tmp, lora)
        (tmp / RECORD_FILE).write_text(record.model_dump_json(indent=1))
        ordinary_permissions(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return record


def process_umask() -> int:
    """This process's umask, read without changing it (``os.umask`` would, for every thread at once);
    0o022 where ``/proc/self/status`` does not say (not Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def ordinary_permissions(folder: str | Path) -> None:
    """Give ``folder``, every folder in it and every file in it the permissions a plain ``open`` or
    ``mkdir`` would: 0o666 / 0o777 less the umask (0644 / 0755 under umask 022). Links are left alone."""
    mask = process_umask()
    root = Path(folder)
    root.chmod(0o777 & ~mask)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            p = Path(dirpath) / name
            if not p.is_symlink():
                p.chmod(0o777 & ~mask)
        for name in filenames:
            p = Path(dirpath) / name
            if not p.is_symlink():
                p.chmod(0o666 & ~mask)


def _write(record: ExportRecord, ckpt: Path, tag: str, base: Path, tmp: Path, lora: dict[str, Any]) -> None:
    """The folder of ``record.kind`` into ``tmp``."""
    from modelkit.export import save_adapter, save_full_model, save_tokenizer
    from trainer.learner.checkpoint import read_weights
    from trainer.learner.lora_config import LoraSettings

    weights = read_weights(ckpt, tag)
    if record.kind == "full":
        save_full_model(weights, base, tmp)
    else:
        settings = LoraSettings.model_validate(lora)
        if record.kind == "adapter":
            save_adapter(weights, settings.spec(), base, tmp, dropout=settings.dropout)
        else:
            import torch

            from modelkit.lora import load_base_weights, merged_weights

            dtype = getattr(torch, record.dtype)
            base_weights = {k: v.to(dtype) for k, v in load_base_weights(base).items()}
            save_full_model(merged_weights(base_weights, weights, settings.spec()), base, tmp)
    save_tokenizer(base, tmp)
