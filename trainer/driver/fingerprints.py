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
counted as ``fingerprint_mismatch``; a report for another version, or without a fingerprint on
either side, is not judged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from protocol import WeightManifest

FINGERPRINT_MISMATCH = "fingerprint_mismatch"
"""Reason a consumer is restarted (and its in-flight samples lost): it serves other weights than
the version it was published."""


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


def mismatched_workers(manifest: WeightManifest, reports: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Ids (sorted) of the rollout workers in ``reports`` ({worker id: report}) that serve other
    weights than ``manifest`` (:func:`is_mismatch`, adapters merged)."""
    return sorted(w for w, r in reports.items() if is_mismatch(manifest, r, merges_adapters=True))
