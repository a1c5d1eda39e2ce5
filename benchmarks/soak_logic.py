"""The pure logic of the chaos soak (:mod:`benchmarks.bench_soak`): which part is killed when, whether
a run's ledger closes by trajectory id, whether every trained trajectory came from verified weights,
and how much the long-lived processes' resident memory grew.

Nothing here starts a process or reads the clock; the soak feeds it what it recorded.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from trainer.driver.records.ledger import fates, lineage

ENV_KINDS = ("rollout_worker", "oldlogit", "learner", "node")
"""Parts killed while the env loop trains."""
AGENT_KINDS = ("rollout_worker", "oldlogit", "learner", "agent", "node")
"""Parts killed while an outside agent trains through the gateway."""
KINDS = frozenset(AGENT_KINDS)


@dataclass(frozen=True)
class PlannedKill:
    """One kill of the schedule: ``kind`` in phase ``phase`` at ``at_s`` seconds after the phase's start."""

    phase: str
    at_s: float
    kind: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_every(every: Sequence[float]) -> tuple[float, float]:
    if len(every) != 2:
        raise ValueError(f"kill_every: expected two numbers (lo hi), got {list(every)!r}")
    lo, hi = float(every[0]), float(every[1])
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo <= 0 or hi < lo:
        raise ValueError(f"kill_every: expected 0 < lo <= hi, finite, got {list(every)!r}")
    return lo, hi


def kill_schedule(
    seed: int,
    phases: Sequence[tuple[str, float, Sequence[str]]],
    every: Sequence[float],
    max_kills: int,
    tail_s: float | None = None,
) -> list[PlannedKill]:
    """The kills of a soak, drawn from ``random.Random(seed)``.

    In each phase ``(name, duration_s, kinds)`` the gaps between kills (and from the phase's start
    to its first kill) are ``rng.uniform(lo, hi)`` seconds, ``every = (lo, hi)``; a kill must come
    ``tail_s`` (default ``lo``) before the phase's end, so the last one has time to recover. Kinds
    come from a bag of the phase's ``kinds``, shuffled and emptied before it is refilled, so every
    kind is hit once before any is hit twice. ``max_kills`` is shared out across the phases (the
    first ``max_kills % len(phases)`` get one more).

    Returns:
        The kills in order (phase by phase, then by time).

    Raises:
        ValueError: ``every`` not two finite numbers with ``0 < lo <= hi``, ``max_kills < 0``, a
            duration that is negative or not finite, an empty or unknown kind, no phases.
    """
    lo, _ = _check_every(every)
    if max_kills < 0:
        raise ValueError(f"max_kills: expected >= 0, got {max_kills!r}")
    if not phases:
        raise ValueError("phases: expected at least one phase")
    tail = lo if tail_s is None else float(tail_s)
    rng = random.Random(seed)
    out: list[PlannedKill] = []
    for i, (name, duration, kinds) in enumerate(phases):
        if not math.isfinite(duration) or duration < 0:
            raise ValueError(f"phases[{i}].duration_s: expected a finite number >= 0, got {duration!r}")
        bad = [k for k in kinds if k not in KINDS]
        if not kinds or bad:
            raise ValueError(f"phases[{i}].kinds: expected some of {sorted(KINDS)}, got {list(kinds)!r}")
        budget = max_kills // len(phases) + (i < max_kills % len(phases))
        t, bag = 0.0, []
        while budget > 0:
            t += rng.uniform(*_check_every(every))
            if t > duration - tail:
                break
            if not bag:
                bag = list(kinds)
                rng.shuffle(bag)
            out.append(PlannedKill(name, round(t, 3), bag.pop()))
            budget -= 1
    return out


# -- the ledger ------------------------------------------------------------------------------------


def manifest_fingerprints(events: Sequence[Mapping[str, Any]], v0: str | None) -> dict[int, str]:
    """``{version: learner fingerprint}`` of the ``published`` events in ``events`` (a lineage),
    with version 0 (the model folder, never published) from ``v0``.

    Raises:
        ValueError: two ``published`` events give one version different fingerprints (within one
            lineage a version names one set of weights).
    """
    out: dict[int, str] = {} if v0 is None else {0: v0}
    for e in events:
        if e["event"] != "published" or e.get("fingerprint") is None:
            continue
        v, fp = int(e["published"]), e["fingerprint"]
        if out.get(v, fp) != fp:
            raise ValueError(f"ledger: version {v} published with fingerprints {out[v]!r} and {fp!r}")
        out[v] = fp
    return out


def verify_consumed(
    kept: Sequence[Mapping[str, Any]], got: Mapping[str, list[str]], v0_fingerprint: str | None
) -> tuple[Counter, list[list[Any]]]:
    """Each consumed id of ``got`` (:func:`trainer.driver.records.ledger.fates` of the lineage ``kept``)
    judged ``verified`` (its stamped served fingerprint is its version's learner fingerprint),
    ``mismatch``, ``unknown_version`` or ``no_fingerprint``; and the mismatches, ``[id, version,
    served, expected]``."""
    stamps: dict[str, tuple[int, str | None]] = {}
    for e in kept:
        if e["event"] == "buffered":
            for i, s in zip(e["ids"], e.get("stamps") or [[None, None]] * len(e["ids"]), strict=True):
                stamps[i] = (s[0], s[1])
    manifests = manifest_fingerprints(kept, v0_fingerprint)
    verdict: Counter = Counter()
    mismatched = []
    for i, f in got.items():
        if f != ["consumed"]:
            continue
        version, served = stamps.get(i, (None, None))
        want = manifests.get(version) if version is not None else None
        if served is None:
            verdict["no_fingerprint"] += 1
        elif want is None:
            verdict["unknown_version"] += 1
        elif served != want:
            verdict["mismatch"] += 1
            mismatched.append([i, version, served, want])
        else:
            verdict["verified"] += 1
    return verdict, mismatched


def ledger_check(
    events: Sequence[Mapping[str, Any]], v0_fingerprint: str | None, summary: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Whether a run's ledger (:func:`trainer.driver.records.ledger.read_ledger`, every segment) closes.

    Over :func:`trainer.driver.records.ledger.lineage` (the events the final weights descend from), every
    id that arrived must have exactly one fate (:func:`trainer.driver.records.ledger.fates`: consumed,
    dropped with a reason, or buffered at the last checkpoint). Every consumed id must carry a
    verified version: the ``served_fingerprint`` stamped on its ``buffered`` event equals the
    learner's fingerprint of its ``policy_version`` (``published`` events; version 0 is
    ``v0_fingerprint``). With the run's ``summary`` (``summary.json``), the id counts must match its
    ``consumed`` and ``buffered`` and its accounting identity
    ``generated = consumed + sum(dropped) + buffered + in_flight`` must hold.

    Returns:
        ``closed`` (every rule holds), ``ids``, ``fates`` (count per fate), ``multiple`` and
        ``no_fate`` (offending ids, at most 20 each), ``rolled_back`` (ids that arrived only in
        events a resume cut: sampled after the checkpoint it went back to), ``fingerprints``
        (consumed ids by ``verified`` / ``mismatch`` / ``unknown_version`` / ``no_fingerprint``),
        ``mismatched`` (at most 20 ``[id, version, served, expected]``), and with ``summary`` the
        count checks.

    Raises:
        ValueError: a ``resumed`` event of a tag never checkpointed; conflicting fingerprints.
    """
    kept = lineage(list(events))
    got = fates(kept)
    arrived_all = {i for e in events if e["event"] in ("buffered", "dropped") for i in e["ids"]}
    verdict, mismatched = verify_consumed(kept, got, v0_fingerprint)
    fate_counts = Counter(f[0].split(":")[0] if len(f) == 1 else "multiple" if f else "none" for f in got.values())
    dropped_by = Counter(
        f[0].removeprefix("dropped:") for f in got.values() if len(f) == 1 and f[0].startswith("dropped:")
    )
    multiple = sorted(i for i, f in got.items() if len(f) > 1)
    no_fate = sorted(i for i, f in got.items() if not f)
    out: dict[str, Any] = {
        "ids": len(got),
        "fates": dict(fate_counts),
        "dropped_by_reason": dict(dropped_by),
        "multiple": multiple[:20],
        "no_fate": no_fate[:20],
        "rolled_back": len(arrived_all - set(got)),
        "fingerprints": {k: verdict.get(k, 0) for k in ("verified", "mismatch", "unknown_version", "no_fingerprint")},
        "mismatched": mismatched[:20],
        "versions_published": len(manifest_fingerprints(kept, v0_fingerprint)),
    }
    ok = not multiple and not no_fate and verdict["verified"] == sum(verdict.values())
    if summary is not None:
        dropped = summary.get("dropped", {})
        identity = summary.get("generated") == (
            summary.get("consumed", 0)
            + sum(dropped.values())
            + summary.get("buffered", 0)
            + summary.get("in_flight", 0)
        )
        out["summary_checks"] = {
            "consumed": [fate_counts.get("consumed", 0), summary.get("consumed")],
            "buffered": [fate_counts.get("buffered", 0), summary.get("buffered")],
            "identity": identity,
            "id_drops_within_counts": all(n <= dropped.get(r, 0) for r, n in dropped_by.items()),
        }
        ok = ok and identity and out["summary_checks"]["id_drops_within_counts"]
        ok = ok and all(a == b for a, b in (out["summary_checks"]["consumed"], out["summary_checks"]["buffered"]))
    out["closed"] = bool(ok)
    return out


# -- memory ------------------------------------------------------------------------------------


def rss_growth(
    samples: Mapping[str, Sequence[tuple[float, float]]], t0: float, t1: float
) -> dict[str, dict[str, float]]:
    """Resident-memory growth of each process between the first and the last quarter of ``[t0, t1]``.

    ``samples``: ``{process key: [(t_s, rss_bytes), ...]}``. A process counts as long-lived over the
    window when it has samples in both ``[t0, t0 + q]`` and ``[t1 - q, t1]``, ``q = (t1 - t0) / 4``;
    its entry is ``first_mib`` and ``last_mib`` (the mean RSS of each quarter, MiB = 2**20 bytes) and
    ``growth = last / first - 1``. Others are left out.

    Raises:
        ValueError: ``t1 <= t0``, or a value that is not finite.
    """
    if not (math.isfinite(t0) and math.isfinite(t1)) or t1 <= t0:
        raise ValueError(f"window: expected finite t0 < t1, got [{t0!r}, {t1!r}]")
    q = (t1 - t0) / 4
    out = {}
    for key, rows in samples.items():
        if any(not (math.isfinite(t) and math.isfinite(r)) for t, r in rows):
            raise ValueError(f"samples[{key!r}]: a time or RSS that is not finite")
        first = [r for t, r in rows if t0 <= t <= t0 + q]
        last = [r for t, r in rows if t1 - q <= t <= t1]
        if not first or not last or sum(first) <= 0:
            continue
        f, la = sum(first) / len(first), sum(last) / len(last)
        out[key] = {"first_mib": f / 2**20, "last_mib": la / 2**20, "growth": la / f - 1.0}
    return out


def worst_growth(growth: Mapping[str, Mapping[str, float]]) -> tuple[str | None, float | None]:
    """The key and growth of the process that grew most (``(None, None)`` for none)."""
    if not growth:
        return None, None
    key = max(growth, key=lambda k: growth[k]["growth"])
    return key, growth[key]["growth"]


def dropped_delta(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """``after - before`` per drop reason, the reasons that grew only (trajectories lost meanwhile)."""
    return {r: n - before.get(r, 0) for r, n in sorted(after.items()) if n - before.get(r, 0) > 0}
