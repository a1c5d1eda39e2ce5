"""The driver's check that every consumer serves the version it was published (served fingerprints).

After a publication has been applied, each consumer reports what it serves, read back from its own
engine (:mod:`modelkit.fingerprint`): a rollout worker ``{"version", "served", "applied"}``
(:meth:`rollout.worker.RolloutWorkerCore.fingerprint`), the old-logit service ``{"version",
"served"}`` (:meth:`oldlogit_service.service.OldLogitService.fingerprint`). The expected value of a
consumer that holds the published tensors (every full-weight consumer, the service with adapters)
is ``manifest.fingerprint``, computed by the learner when it packed the payload; a rollout worker
that merges an adapter into its base serves merged weights, so its expected value is ``applied``,
the fingerprint of the merged tensors it handed to its engine.

A consumer whose served fingerprint differs from the expected one is restarted by the caller and
counted as ``fingerprint_mismatch``; a report for another version (the consumer did not take the
publication) is not judged. A report for the published version without a fingerprint on either
side (the engine could not read its weights back, or the expected value is unknown) cannot be
judged: :func:`is_unverified`; the caller counts it as ``fingerprint_unverified`` and, with
``rollout.unverified_fingerprint = "mismatch"``, restarts such a rollout worker like a mismatched one
(:func:`mismatched_workers`).

Trajectories are judged by the same rule (:func:`trajectory_mismatch`): each carries the
fingerprint its worker served at its ``policy_version`` (``Trajectory.served_fingerprint``), and the
driver keeps what each version should serve (:func:`expected_entries`): ``manifest.fingerprint``
under the version for full weights, known when the version is published; with adapters each
worker's own ``applied`` merge under ``(worker id, version)``, known when that worker's report is
checked. A trajectory whose fingerprint differs is dropped as ``fingerprint_mismatch``; one
without a fingerprint (an engine that cannot read its weights back, a gateway session segment that
no call reached) or of a version with no expected value (the model folder's version 0, versions before a resume) is not judged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from protocol import Trajectory, WeightManifest

ExpectedFingerprints = Mapping[int | tuple[str, int], str]
"""What each version should serve: ``{version: fingerprint}`` (full weights: every worker) and
``{(worker id, version): fingerprint}`` (a worker's own adapter merge; looked up first)."""

FINGERPRINT_MISMATCH = "fingerprint_mismatch"
"""Reason a consumer is restarted (and its in-flight samples lost): it serves other weights than
the version it was published."""

UNVERIFIED_COUNT, UNVERIFIED_MISMATCH = "count", "mismatch"
"""The values of ``rollout.unverified_fingerprint``: a rollout worker whose report cannot be judged
(:func:`is_unverified`) is only counted, or also restarted as a mismatch."""


def expected_fingerprint(manifest: WeightManifest, report: Mapping[str, Any], merges_adapters: bool) -> str | None:
    """What ``report``'s consumer should serve after applying ``manifest`` (None: unknown).

    ``merges_adapters``: the consumer merges an adapter publication into its own base (a rollout
    worker), so it serves the merged weights it applied (``report["applied"]``), not the adapter."""
    if manifest.adapter is not None and merges_adapters:
        return report.get("applied")
    return manifest.fingerprint


def is_mismatch(manifest: WeightManifest, report: Mapping[str, Any] | None, merges_adapters: bool) -> bool:
    """True when ``report`` (a consumer's fingerprint report) is for ``manifest.version`` and its
    ``served`` fingerprint differs from :func:`expected_fingerprint`; False when either is unknown
    or the report is for another version (the consumer did not take this publication)."""
    if report is None or report.get("version") != manifest.version:
        return False
    want, got = expected_fingerprint(manifest, report, merges_adapters), report.get("served")
    return want is not None and got is not None and got != want


def is_unverified(manifest: WeightManifest, report: Mapping[str, Any] | None, merges_adapters: bool) -> bool:
    """True when ``report`` is for ``manifest.version`` and cannot be judged: its ``served``
    fingerprint or :func:`expected_fingerprint` is None. False for no report (the consumer did not
    answer; it is asked again) and for a report of another version (it did not take this publication).

    Example: v1 with fingerprint ``"aa..."``: ``{"version": 1, "served": None}`` is unverified,
    ``{"version": 1, "served": "bb..."}`` is a mismatch (:func:`is_mismatch`), not unverified, and
    ``{"version": 0, "served": None}`` is neither."""
    if report is None or report.get("version") != manifest.version:
        return False
    return expected_fingerprint(manifest, report, merges_adapters) is None or report.get("served") is None


def unverified_workers(manifest: WeightManifest, reports: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Ids (sorted) of the rollout workers in ``reports`` ({worker id: report}) whose report of
    ``manifest`` cannot be judged (:func:`is_unverified`, adapters merged)."""
    return sorted(w for w, r in reports.items() if is_unverified(manifest, r, merges_adapters=True))


def mismatched_workers(
    manifest: WeightManifest, reports: Mapping[str, Mapping[str, Any]], unverified: str = UNVERIFIED_COUNT
) -> list[str]:
    """Ids (sorted) of the rollout workers in ``reports`` ({worker id: report}) that serve other
    weights than ``manifest`` (:func:`is_mismatch`, adapters merged); with ``unverified =
    "mismatch"`` (``rollout.unverified_fingerprint``) those whose report cannot be judged
    (:func:`unverified_workers`) too.

    Raises:
        ValueError: ``unverified`` is neither ``"count"`` nor ``"mismatch"``.
    """
    if unverified not in (UNVERIFIED_COUNT, UNVERIFIED_MISMATCH):
        raise ValueError(f"rollout.unverified_fingerprint: must be 'count' or 'mismatch', got {unverified!r}")
    bad = {w for w, r in reports.items() if is_mismatch(manifest, r, merges_adapters=True)}
    if unverified == UNVERIFIED_MISMATCH:
        bad.update(unverified_workers(manifest, reports))
    return sorted(bad)


def expected_entries(manifest: WeightManifest, reports: Mapping[str, Mapping[str, Any]]) -> dict:
    """The :data:`ExpectedFingerprints` entries ``manifest`` gives, with the workers' ``reports``
    ({worker id: report}) of it: ``{manifest.version: manifest.fingerprint}`` for full weights
    (nothing when the manifest has none); with an adapter ``{(worker id, version): applied}`` for
    each report of that version whose ``applied`` is known and equals its ``served`` (a worker
    found mismatched vouches for nothing).

    Example: full weights v3 with fingerprint ``"aa..."`` give ``{3: "aa..."}`` whatever the
    reports; an adapter v3 with reports ``w0: applied = served = "bb..."`` and ``w1: applied
    "bb...", served "cc..."`` give ``{("w0", 3): "bb..."}``."""
    if manifest.adapter is None:
        return {} if manifest.fingerprint is None else {manifest.version: manifest.fingerprint}
    return {
        (w, manifest.version): r["applied"]
        for w, r in reports.items()
        if r.get("version") == manifest.version and r.get("applied") is not None and r.get("served") == r["applied"]
    }


def prune_expected(expected: ExpectedFingerprints, oldest: int) -> dict:
    """``expected`` without the entries of versions below ``oldest`` (a trajectory of such a version
    is too stale to train on, so nothing is checked against them any more).

    Example: ``{1: "a", 2: "b", ("w0", 1): "c", ("w0", 3): "d"}`` with ``oldest = 2`` gives
    ``{2: "b", ("w0", 3): "d"}``."""
    return {k: v for k, v in expected.items() if (k if isinstance(k, int) else k[1]) >= oldest}


def trajectory_mismatch(t: Trajectory, expected: ExpectedFingerprints) -> bool:
    """True when ``t.served_fingerprint`` and the expected value of ``t.policy_version`` (its
    worker's own entry first, then the version's) are both known and differ.

    The fingerprint is of the weights at the trajectory's last version; tokens of earlier versions
    were sampled by a worker that passed those versions' checks (one that failed was killed with
    its samples in flight)."""
    want = expected.get((t.worker_id, t.policy_version), expected.get(t.policy_version))
    return want is not None and t.served_fingerprint is not None and t.served_fingerprint != want
