"""Checkpoint and resume of the learner: weights, optimizer, version counter, EWMA, extra state.

Layout of ``directory`` (one sub-folder per checkpoint, tag ``v{version}``)::

    directory/
      v12/                      DeepSpeed's files (model + ZeRO-partitioned optimizer states, all ranks)
      v12/vintage_state.pt      version, skipped steps, EWMA state, settings, the caller's extra dict
      latest                    DeepSpeed's pointer (written by DeepSpeed)
      vintage_latest            vintage's pointer, written last: a checkpoint is complete only once
                                this names it, so a crash mid-save never becomes the resume point
      vintage_best.json         the driver's record of the best pinned held-out evaluation and its
                                checkpoint (``controller.keep_best``, :func:`write_best`)

Every rank must call :func:`save_checkpoint` / :func:`load_checkpoint` (DeepSpeed saves and loads
each rank's optimizer partition). ``extra`` is opaque to the learner: the controller stores its
buffer accounting and the old-logit snapshot index there. It must hold plain Python values
(dict, list, str, int, float, bool, None) and tensors, because it is read back with
``torch.load(weights_only=True)``.

A resumed learner continues the version sequence: after loading ``v12`` the next applied step
publishes version 13.

The weights of a checkpoint are read back without a learner or a DeepSpeed engine
(:func:`read_weights`, on CPU): ZeRO 0-2 keep the whole module state in
``mp_rank_00_model_states.pt``; ZeRO-3 keeps every rank's partition of the fp32 master weights in
``*_optim_states.pt``, put together by DeepSpeed's ``zero_to_fp32`` (a reader, not an engine).

With LoRA (``settings.lora.enabled``) the model files hold only the trainable parameters (the
adapter; DeepSpeed's ``exclude_frozen_parameters``), next to the optimizer state, version and EWMA
adapter average: the frozen base is the model folder, loaded again by the resuming learner. A
checkpoint resumes only into a learner with the same LoRA rank, alpha and target modules.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainer.learner.views import CheckpointedLearner

STATE_FILE = "vintage_state.pt"
LATEST_FILE = "vintage_latest"
BEST_FILE = "vintage_best.json"
"""The driver's record of the best pinned held-out evaluation (:func:`write_best`)."""
RECOVERY_FILE = "vintage_recovery.json"
"""The driver's list of checkpoints saved only for recovery (:func:`write_recovery`)."""
DEEPSPEED_LATEST_FILE = "latest"
"""DeepSpeed's own pointer (vintage loads by tag and never reads it)."""
FORMAT = 1
MODEL_STATES_FILE = "mp_rank_00_model_states.pt"
"""DeepSpeed's module state file of ZeRO 0-2 (the whole module, written by rank 0)."""


def _barrier(core: CheckpointedLearner) -> None:
    if core.world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def save_checkpoint(
    core: CheckpointedLearner, directory: str | Path, *, extra: dict[str, Any] | None = None, tag: str | None = None
) -> Path:
    """Save ``core`` under ``directory/tag`` (default tag ``v{version}``) and return that folder.

    Saved: model weights and optimizer state (DeepSpeed, every rank's partition), the version
    counter, skipped-step count, applied optimizer steps (the learning-rate schedule's position), the EWMA weights/total/counters, the settings (for information)
    and ``extra``. Raises whatever DeepSpeed or the filesystem raises; the ``vintage_latest``
    pointer is only moved after everything is written.
    """
    directory = Path(directory)
    tag = tag or f"v{core.version}"
    directory.mkdir(parents=True, exist_ok=True)
    lora = core.settings.lora.enabled
    with _trainable_module_state(core.engine) if lora else contextlib.nullcontext():
        core.engine.save_checkpoint(
            str(directory), tag=tag, client_state={"vintage_version": core.version}, exclude_frozen_parameters=lora
        )
    if core.rank == 0:
        state = {
            "format": FORMAT,
            "version": core.version,
            "skipped_steps": core.skipped_steps,
            "optimizer_steps": core.optimizer_steps,
            "entropy_control": core.entropy_control.state_dict(),
            "ewma": core.ewma.state_dict() if core.ewma is not None else None,
            "settings": core.settings.model_dump(mode="json"),
            "extra": extra or {},
        }
        tmp = directory / tag / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, directory / tag / STATE_FILE)
        tmp_latest = directory / (LATEST_FILE + ".tmp")
        tmp_latest.write_text(tag)
        os.replace(tmp_latest, directory / LATEST_FILE)
    _barrier(core)
    return directory / tag


@contextlib.contextmanager
def _trainable_module_state(engine: Any) -> Iterator[None]:
    """While saving, DeepSpeed's module state holds exactly the trainable parameters (the adapter).

    ``exclude_frozen_parameters`` drops the frozen parameters that ``named_parameters()`` lists, and
    that lists a tied weight once: the alias (a tied ``lm_head.weight``, a whole embedding) would
    still be saved. The engine's ``module_state_dict`` is shadowed for the duration of the save.
    """
    inner = engine.module_state_dict
    trainable = {name for name, p in engine.module.named_parameters() if p.requires_grad}

    def state_dict(*args: Any, **kwargs: Any) -> Any:
        sd = inner(*args, **kwargs)
        for name in [k for k in sd if k not in trainable]:
            del sd[name]
        return sd

    engine.module_state_dict = state_dict
    try:
        yield
    finally:
        del engine.module_state_dict


def latest_tag(directory: str | Path) -> str | None:
    """Tag of the newest complete checkpoint in ``directory``, or None if there is none."""
    p = Path(directory) / LATEST_FILE
    return p.read_text().strip() if p.is_file() else None


def version_tag(version: int) -> str:
    """The tag of a version's checkpoint: ``v{version}``."""
    return f"v{version}"


def checkpointed_versions(directory: str | Path) -> list[int]:
    """Versions with a complete checkpoint in ``directory`` (its ``v{N}`` folders holding
    :data:`STATE_FILE`, written last), ascending; empty when the folder does not exist."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = (re.fullmatch(r"v(\d+)", p.name) for p in d.iterdir() if (p / STATE_FILE).is_file())
    return sorted(int(m.group(1)) for m in found if m)


def checkpoints_to_remove(
    versions: list[int], latest: int | None, keep: int, best: int | None = None, extra: tuple[int, ...] = ()
) -> list[int]:
    """Versions whose checkpoints go under the retention rule: the newest ``keep`` regular
    checkpoints stay (``keep = 0``: every regular one stays), and so do the one ``latest`` names
    (the resume point) and ``best`` (the best pinned held-out evaluation's version,
    ``controller.keep_best``), on top of the ``keep``. ``extra``: versions saved only because they
    were evaluated or for recovery; they do not count among the newest ``keep`` and go unless they
    are ``latest`` or ``best``.

    Example: versions ``[2, 4, 6, 8]``, latest 8, keep 2 -> ``[2, 4]``; latest 4, keep 1 ->
    ``[2, 6]``; latest 8, keep 1, best 4 -> ``[2, 6]``; latest 8, keep 2, best 4, extra (4,) ->
    ``[2]`` (4 is the best, 6 and 8 the two newest regular ones).
    """
    regular = sorted(v for v in versions if v not in extra)
    newest = regular[-keep:] if keep > 0 else regular
    return [v for v in sorted(versions) if v not in newest and v not in (latest, best)]


def prune_checkpoints(
    directory: str | Path, keep: int, best: int | None = None, extra: tuple[int, ...] = ()
) -> list[int]:
    """Remove the complete checkpoints of ``directory`` that :func:`checkpoints_to_remove` names
    (the newest ``keep`` regular ones, the resume point and ``best`` stay; ``extra`` as there);
    returns the versions removed. Raises what the filesystem raises."""
    tag = latest_tag(directory)
    latest = int(tag[1:]) if tag and re.fullmatch(r"v\d+", tag) else None
    gone = checkpoints_to_remove(checkpointed_versions(directory), latest, keep, best, extra)
    for v in gone:
        shutil.rmtree(Path(directory) / version_tag(v))
    return gone


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def remove_checkpoint(directory: str | Path, version: int) -> str | None:
    """Remove ``version``'s checkpoint from ``directory`` and return the resume point's tag after it.

    When it is the resume point (``vintage_latest`` names it), both pointers (``vintage_latest`` and
    DeepSpeed's ``latest``) first move to the newest remaining complete checkpoint, or are removed
    when none remains, so a crash between the two steps never leaves a pointer to a missing folder.
    Raises what the filesystem raises.
    """
    d, tag = Path(directory), version_tag(version)
    latest = latest_tag(d)
    if latest == tag:
        rest = [v for v in checkpointed_versions(d) if v != version]
        latest = version_tag(rest[-1]) if rest else None
        for name in (LATEST_FILE, DEEPSPEED_LATEST_FILE):
            p = d / name
            if latest is not None and (name == LATEST_FILE or p.is_file()):
                _write_atomic(p, latest)
            else:
                p.unlink(missing_ok=True)
    if (d / tag).is_dir():
        shutil.rmtree(d / tag)
    return latest


def write_best(directory: str | Path, record: dict[str, Any] | None) -> None:
    """Write ``record`` (the driver's best pinned held-out evaluation: plain JSON values) as
    ``directory / BEST_FILE`` atomically; None removes the file. ``directory`` is created if needed."""
    d = Path(directory)
    if record is None:
        (d / BEST_FILE).unlink(missing_ok=True)
        return
    d.mkdir(parents=True, exist_ok=True)
    _write_atomic(d / BEST_FILE, json.dumps(record, indent=1))


def _read_json(path: Path, missing: Any) -> Any:
    """The JSON value in ``path``, or ``missing`` when there is no such file.

    Raises:
        ValueError: the file is not JSON (the message names it, the line and the reason).
    """
    if not path.is_file():
        return missing
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None


def write_recovery(directory: str | Path, versions: set[int]) -> None:
    """Record ``versions`` (checkpoints saved only for recovery) as ``directory / RECOVERY_FILE``,
    atomically; an empty set removes the file."""
    d = Path(directory)
    if not versions:
        (d / RECOVERY_FILE).unlink(missing_ok=True)
        return
    d.mkdir(parents=True, exist_ok=True)
    _write_atomic(d / RECOVERY_FILE, json.dumps(sorted(versions)))


def read_recovery(directory: str | Path) -> set[int]:
    """The versions :func:`write_recovery` left in ``directory`` (empty: no file).

    Raises:
        ValueError: the file is not a JSON list of ints (the message names it).
    """
    p = Path(directory) / RECOVERY_FILE
    versions = _read_json(p, [])
    if not isinstance(versions, list) or not all(isinstance(v, int) for v in versions):
        raise ValueError(f"{p}: not a list of versions: {versions!r}")
    return set(versions)


def read_best(directory: str | Path) -> dict[str, Any] | None:
    """The record :func:`write_best` left in ``directory`` (None: no file).

    Raises:
        ValueError: the file is not a JSON object (the message names it).
    """
    p = Path(directory) / BEST_FILE
    if not p.is_file():
        return None
    record = _read_json(p, None)
    if not isinstance(record, dict):
        raise ValueError(f"{p}: holds a JSON {type(record).__name__}, not an object")
    return record


def read_weights(directory: str | Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The policy weights of checkpoint ``tag`` (default: the newest complete one), read on CPU
    without a learner or a DeepSpeed engine, in the learner's dtype (``settings.dtype``).

    Full-weight training: ``{HF name: tensor}`` of the whole model, tied weights under both names
    sharing one tensor (as ``state_dict()`` lists them). ZeRO 0-2: the module state DeepSpeed
    saved; ZeRO-3: the fp32 master weights of every rank's partition (``zero_to_fp32``, which reads
    with pickle, as DeepSpeed's own resume does), cast to the learner's dtype - the same values
    as the module it trained, which holds that cast after every step.

    LoRA: the adapter only, ``{protocol.adapter_key name: tensor}`` (peft's saved-adapter naming,
    A ``[r, in]``, B ``[out, r]``); the base is the model folder.

    Raises:
        FileNotFoundError: no complete checkpoint (or not that tag), or a DeepSpeed file of it is missing.
        ValueError: an unknown format, or a LoRA checkpoint whose module state holds a name that is
            not an adapter factor.
    """
    state = read_state(directory, tag)
    tag = tag or latest_tag(directory)
    folder = Path(directory) / str(tag)
    settings = state.get("settings") or {}
    dtype = getattr(torch, settings.get("dtype", "float32"))
    if int(settings.get("zero_stage", 0)) == 3:
        return _zero3_weights(folder, dtype)
    path = folder / MODEL_STATES_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: checkpoint {tag!r} has no module state")
    module = torch.load(path, map_location="cpu", mmap=True, weights_only=True)["module"]
    if not (settings.get("lora") or {}).get("enabled"):
        return dict(module)
    from modelkit.lora import peft_to_adapter

    out = {}
    for name, t in module.items():
        key = peft_to_adapter(name)
        if key is None:
            raise ValueError(f"{path}: {name!r} in a LoRA checkpoint is not an adapter factor")
        out[key] = t
    return out


def _zero3_weights(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Whole fp32 weights of a ZeRO-3 checkpoint folder (every rank's ``*_optim_states.pt``), cast to ``dtype``."""
    if not any(folder.glob("*_optim_states.pt")):
        raise FileNotFoundError(f"{folder}: no *_optim_states.pt (the ZeRO-3 partitions of the weights)")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # progress lines
        fp32 = get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)
    out: dict[str, torch.Tensor] = {}
    cast: dict[int, torch.Tensor] = {}  # tied names share one tensor: cast once, keep it shared
    for name, t in fp32.items():
        if id(t) not in cast:
            cast[id(t)] = t.detach().to(dtype)
        out[name] = cast[id(t)]
    return out


def read_state(directory: str | Path, tag: str | None = None) -> dict[str, Any]:
    """vintage's own state of a checkpoint (version, EWMA, extra...) without touching a learner.

    Raises:
        FileNotFoundError: no complete checkpoint (or not that tag) in ``directory``.
    """
    tag = tag or latest_tag(directory)
    if tag is None:
        raise FileNotFoundError(f"no complete checkpoint in {directory} ({LATEST_FILE} missing)")
    path = Path(directory) / tag / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: checkpoint {tag!r} is incomplete")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {state.get('format')!r}, this build reads {FORMAT}")
    return state


def load_checkpoint(core: CheckpointedLearner, directory: str | Path, *, tag: str | None = None) -> dict[str, Any]:
    """Restore ``core`` from ``directory`` (the newest complete checkpoint unless ``tag``).

    Restores weights and optimizer state (DeepSpeed), ``version``, ``skipped_steps``,
    ``optimizer_steps`` (the learning-rate schedule's position), the adaptive entropy coefficient
    and last entropy, and the EWMA state, and returns the ``extra`` dict saved with it.

    Raises:
        FileNotFoundError: no complete checkpoint.
        ValueError: the checkpoint has EWMA state but ``core`` has no EWMA (or the reverse), its
            LoRA settings (on/off, rank, alpha, target modules) differ from ``core``'s, or an
            unknown format.
    """
    state = read_state(directory, tag)
    tag = tag or latest_tag(directory)
    _check_lora(core, state, tag)
    lora = core.settings.lora.enabled
    load_path, _ = core.engine.load_checkpoint(
        str(directory), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False,
        load_module_strict=not lora,  # a LoRA checkpoint holds the adapter only; the base is the model folder
    )  # fmt: skip
    if load_path is None:
        raise FileNotFoundError(f"DeepSpeed found no checkpoint {tag!r} in {directory}")
    if (state["ewma"] is None) != (core.ewma is None):
        raise ValueError(
            f"checkpoint {tag!r} {'has no' if state['ewma'] is None else 'has an'} EWMA state but the learner's proxy is {core.settings.loss.proxy!r}"
        )
    if core.ewma is not None:
        core.ewma.load_state_dict(state["ewma"])
    core.version = int(state["version"])
    core.skipped_steps = int(state["skipped_steps"])
    # the learning-rate schedule's count; a checkpoint written before it was kept counts every
    # version's optimizer steps as applied
    s = core.settings
    core.optimizer_steps = int(state.get("optimizer_steps", core.version * s.ppo_epochs * s.ppo_mini_batches))
    core.entropy_control.load_state_dict(state.get("entropy_control"))
    _barrier(core)
    return dict(state["extra"])


def _check_lora(core: CheckpointedLearner, state: dict[str, Any], tag: str | None) -> None:
    """Raise ValueError naming the field when the checkpoint's LoRA settings do not fit ``core``'s."""
    saved = (state.get("settings") or {}).get("lora") or {"enabled": False}
    want = core.settings.lora.model_dump(mode="json")
    if not saved.get("enabled") and not want["enabled"]:
        return
    for field in ("enabled", "rank", "alpha", "target_modules"):
        if saved.get(field) != want[field]:
            raise ValueError(
                f"lora.{field}: checkpoint {tag!r} was saved with {saved.get(field)!r}, this learner has {want[field]!r}"
            )
