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
failed export leaves ``out`` as it was.
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
    """The policy version exported (the learner's optimizer-step count, see docs/architecture.md)."""
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


def parse_version(value: str) -> int | Literal["latest"]:
    """``"latest"`` or a version number (``"12"`` -> 12).

    Raises:
        ExportError: neither (the message names ``--version`` and the value).
    """
    if value == "latest":
        return "latest"
    if not value.isdigit():
        raise ExportError(f"--version: {value!r} is not a version number or 'latest'")
    return int(value)


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


def checkpoint_tag(run_dir: str | Path, version: int | Literal["latest"]) -> str:
    """The tag of ``version``'s complete checkpoint in ``<run_dir>/checkpoints``.

    Raises:
        ExportError: no complete checkpoint at all, or none of ``version`` (the message lists the
            versions that are checkpointed).
    """
    from trainer.learner.checkpoint import checkpointed_versions, latest_tag, version_tag

    ckpt = Path(run_dir) / "checkpoints"
    have = checkpointed_versions(ckpt)
    if not have:
        raise ExportError(f"--version {version}: no complete checkpoint in {ckpt}")
    if version == "latest":
        return latest_tag(ckpt) or version_tag(have[-1])
    if version not in have:
        raise ExportError(
            f"--version {version}: not checkpointed in {ckpt} (checkpointed: {', '.join(map(str, have))})"
        )
    return version_tag(version)


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out: {str(out)!r} is a file")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"--out: {str(out)!r} exists and is not empty (--overwrite replaces it)")


def export_run(
    run_dir: str | Path,
    out: str | Path,
    version: int | Literal["latest"] = "latest",
    merge: bool = False,
    overwrite: bool = False,
) -> ExportRecord:
    """Write version ``version`` of the run in ``run_dir`` as a Hugging Face folder at ``out``.

    Every argument is checked before any weight is read. A full-weight run gives a ``full`` folder;
    a LoRA run an ``adapter`` folder, or with ``merge`` a ``merged`` full folder.

    Raises:
        ExportError: ``run_dir`` is not a run folder, ``version`` is not checkpointed there, ``merge``
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
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return record


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
