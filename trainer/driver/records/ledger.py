"""The ledger: where every finished trajectory of a run went, by ``trajectory_id``.

``<run_dir>/ledger.jsonl`` gets one line per event, appended (and flushed) as it happens, over
every run segment of the run folder::

    {"segment": 0, "version": 0, "event": "started", "ids": []}
    {"segment": 0, "version": 3, "event": "published", "published": 3, "fingerprint": "9f0c...", "ids": []}
    {"segment": 0, "version": 3, "event": "buffered", "stamps": [[3, "9f0c..."]], "ids": ["v3-5-24/0"]}
    {"segment": 0, "version": 3, "event": "consumed", "ids": [...]}
    {"segment": 0, "version": 4, "event": "dropped", "reason": "stale", "ids": [...]}
    {"segment": 0, "version": 4, "event": "dropped", "reason": "filtered", "ids": [...one group...]}
    {"segment": 0, "version": 4, "event": "checkpoint", "tag": "v4", "ids": [...buffered...]}
    {"segment": 1, "version": 4, "event": "resumed", "tag": "v4", "ids": [...restored...], "lost_at_restart": 2}

``version`` is the learner's when the event happened. A fresh run (segment 0) opens with a
``started`` line: a run started afresh in a folder that held another run replaces it, and
:func:`lineage` keeps nothing from before its last ``started`` line. A ``published`` line gives the learner's
fingerprint of each published version (``manifest.fingerprint``, :mod:`modelkit.fingerprint`); a
``dropped`` line with reason ``filtered`` names one whole group of equal rewards that dynamic
sampling dropped after it arrived (:meth:`trainer.driver.sources.buffer.TrajectoryBuffer.filter_groups`). A
``buffered`` line gives, per id, the version the trajectory was sampled at and the fingerprint its
worker read back from the weights it served (``Trajectory.policy_version``, ``served_fingerprint``),
so a reader can check that no trained trajectory came from weights other than its version's. A resume goes back to a checkpoint: what the
segment before did after it is not part of the run any more (its steps are trained again).
:func:`lineage` keeps the events the final weights descend from; over them every id that arrived
(``buffered``, or ``dropped`` on arrival) is consumed exactly once, dropped with a reason, or still
buffered at the last checkpoint. Samples lost in flight never had an id: they are counts only
(``lost_at_restart``, ``worker_died`` ...).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

LEDGER_FILE = "ledger.jsonl"


class Ledger:
    """Appends the events of one run segment to ``run_dir / LEDGER_FILE`` (a buffer's ``ledger``).

    Args:
        run_dir: the run folder.
        segment: the run segment (0 for a fresh run, which writes the ``started`` line; +1 at every resume).
        version: the learner's version now (read at every event).
    """

    def __init__(self, run_dir: str | Path, segment: int, version: Callable[[], int]):
        self.path = Path(run_dir) / LEDGER_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.segment, self.version = segment, version
        self._fh = self.path.open("a", buffering=1)  # one line per write reaches the file
        if segment == 0:  # before the job exists: a fresh run starts at version 0
            self._fh.write(json.dumps({"segment": 0, "version": 0, "event": "started", "ids": []}) + "\n")

    def __call__(self, event: str, ids: list[str], reason: str | None = None, **fields: Any) -> None:
        """Append ``event`` for ``ids`` (with its drop ``reason`` and any other ``fields``)."""
        row = {"segment": self.segment, "version": self.version(), "event": event}
        if reason is not None:
            row["reason"] = reason
        self._fh.write(json.dumps({**row, **fields, "ids": list(ids)}) + "\n")

    def close(self) -> None:
        self._fh.close()


def read_ledger(run_dir: str | Path) -> list[dict[str, Any]]:
    """The events of ``run_dir / LEDGER_FILE`` in order (a torn last line, from a killed driver, is skipped)."""
    rows = []
    for line in (Path(run_dir) / LEDGER_FILE).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def lineage(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events the final weights descend from: at every ``resumed`` event, the events after the
    last ``checkpoint`` of its tag are cut (an earlier segment's steps past that checkpoint were
    trained again); at every ``started`` event (a fresh run), every event before it is cut.

    Raises:
        ValueError: a ``resumed`` event whose tag no kept ``checkpoint`` event names.
    """
    kept: list[dict[str, Any]] = []
    for e in events:
        if e["event"] == "started":
            kept = []
        if e["event"] == "resumed":
            at = [i for i, k in enumerate(kept) if k["event"] == "checkpoint" and k["tag"] == e["tag"]]
            if not at:
                raise ValueError(f"ledger: segment {e['segment']} resumed from {e['tag']!r}, never checkpointed")
            kept = kept[: at[-1] + 1]
        kept.append(e)
    return kept


def fates(events: list[dict[str, Any]]) -> dict[str, list[str]]:
    """``{trajectory_id: [fate, ...]}`` over ``events`` (:func:`lineage` first): each ``consumed``,
    ``dropped:<reason>`` of an id, and ``buffered`` for the ids still saved by the last
    ``checkpoint`` event. Exactly once means one fate per id."""
    out: dict[str, list[str]] = {}
    arrived: set[str] = set()
    last_saved: list[str] = []
    for e in events:
        if e["event"] == "buffered":
            arrived.update(e["ids"])
        elif e["event"] == "consumed":
            for i in e["ids"]:
                out.setdefault(i, []).append("consumed")
        elif e["event"] == "dropped":
            for i in e["ids"]:
                arrived.add(i)
                out.setdefault(i, []).append(f"dropped:{e['reason']}")
        elif e["event"] == "checkpoint":
            last_saved = e["ids"]
    for i in last_saved:
        out.setdefault(i, []).append("buffered")
    for i in arrived:
        out.setdefault(i, [])
    return out
