"""The finished trajectories a checkpoint keeps for the driver, so a resume trains each exactly once.

A checkpoint folder (``<run_dir>/checkpoints/v{N}``, :mod:`trainer.learner.checkpoint`) holds,
beside the learner's files, :data:`TRAJECTORIES_FILE`: the trajectories that had finished and were
not yet consumed when it was saved, in the protocol's own JSON form (one
:class:`protocol.Trajectory` per line, ``model_dump_json``; arrays as base64 of their bytes, so
they come back bit for bit)::

    {"format": 1, "buffered": 3, "held_back": 0}     header: how many lines of each follow
    {"trajectory_id": "v4-7-32/0", ...}               the buffer's, held ones first (TrajectoryBuffer.saved)
    ...
    {"trajectory_id": ...}                            the source's held-back ones (TrajectorySource.pending)

Rules:

* the file is written before the learner saves (:func:`write_driver_state`, called by
  :meth:`trainer.driver.records.keeper.CheckpointKeeper.checkpoint`), to a temporary name then renamed, so
  a checkpoint that ``vintage_latest`` names always has it whole;
* the checkpoint's state lists the ids the file must hold (``buffer.buffered_ids``,
  ``source.held_back_ids``); reading checks them, line count and every message strictly (pydantic's
  strict JSON mode), so a file from another save or a damaged one is refused, never half-read;
* a checkpoint whose state lists no ids (none were saved) needs no file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from protocol import Trajectory

if TYPE_CHECKING:
    from trainer.driver.sources.buffer import TrajectoryBuffer
    from trainer.driver.sources.source import TrajectorySource

TRAJECTORIES_FILE = "trajectories.jsonl"
FORMAT = 1


@dataclass
class SavedTrajectories:
    """The trajectories of one checkpoint, in their saved order."""

    buffered: list[Trajectory]
    """The buffer's (:meth:`trainer.driver.sources.buffer.TrajectoryBuffer.saved`)."""
    held_back: list[Trajectory]
    """The source's, polled from the workers but not yet returned by its ``poll``."""


def write_trajectories(folder: str | Path, buffered: list[Trajectory], held_back: list[Trajectory]) -> Path:
    """Write ``folder / TRAJECTORIES_FILE`` atomically (a temporary file, flushed, then renamed)
    and return its path; ``folder`` is created if needed. Raises whatever the filesystem raises."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / TRAJECTORIES_FILE
    tmp = folder / (TRAJECTORIES_FILE + ".tmp")
    with tmp.open("w") as fh:
        fh.write(json.dumps({"format": FORMAT, "buffered": len(buffered), "held_back": len(held_back)}) + "\n")
        for t in (*buffered, *held_back):
            fh.write(t.model_dump_json() + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def write_driver_state(folder: str | Path, buffer: TrajectoryBuffer, source: TrajectorySource) -> dict[str, Any]:
    """The driver's share of a checkpoint saved in ``folder``: every finished trajectory not yet
    consumed - buffered, held in a batch taken ahead (saved as buffered, at the front: the resumed
    job takes it again) or held back by the source - written there (:func:`write_trajectories`);
    returns the state that lists them, ``{"buffer": buffer.state_dict() (its ``buffered_ids``),
    "source": {"cursor", "held_back_ids", "held_back_units"}}``."""
    state = source.state()
    write_trajectories(folder, buffer.saved(), state.pending)
    return {
        "buffer": buffer.state_dict(),
        "source": {
            "cursor": state.cursor,
            "held_back_ids": [t.trajectory_id for t in state.pending],
            "held_back_units": state.units,
        },
    }


def read_trajectories(folder: str | Path, buffered_ids: list[str], held_back_ids: list[str]) -> SavedTrajectories:
    """The trajectories saved in ``folder / TRAJECTORIES_FILE``, which must hold exactly
    ``buffered_ids`` then ``held_back_ids`` (the ids the checkpoint's state lists), in order.

    Raises:
        FileNotFoundError: the file is missing while ids are listed (the message names it).
        ValueError: a malformed file: a bad header, a line that is not a valid trajectory (strict
            JSON: no coercion), a line count or an id other than listed. One line naming the file
            and the line.
    """
    if not buffered_ids and not held_back_ids:
        return SavedTrajectories([], [])
    path = Path(folder) / TRAJECTORIES_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} missing: the checkpoint lists {len(buffered_ids) + len(held_back_ids)} saved trajectories"
        )
    lines = path.read_text().splitlines()
    want = {"format": FORMAT, "buffered": len(buffered_ids), "held_back": len(held_back_ids)}
    try:
        header = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: line 1: header is not JSON ({e.msg})") from None
    if header != want:
        raise ValueError(f"{path}: line 1: header {header!r}, the checkpoint expects {want!r}")
    n = len(buffered_ids) + len(held_back_ids)
    if len(lines) != 1 + n:
        raise ValueError(f"{path}: {len(lines) - 1} trajectory lines, the header says {n}")
    got: list[Trajectory] = []
    for k, (line, tid) in enumerate(zip(lines[1:], [*buffered_ids, *held_back_ids], strict=True), start=2):
        try:
            t = Trajectory.model_validate_json(line, strict=True)
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(str(x) for x in first["loc"]) or "trajectory"
            raise ValueError(f"{path}: line {k}: {loc}: {first['msg']}") from None
        if t.trajectory_id != tid:
            raise ValueError(f"{path}: line {k}: trajectory_id {t.trajectory_id!r}, the checkpoint lists {tid!r}")
        got.append(t)
    return SavedTrajectories(got[: len(buffered_ids)], got[len(buffered_ids) :])
