"""A consumer whose served fingerprint cannot be judged (it could not read its weights back, or
what it should serve is unknown) is counted as ``fingerprint_unverified`` in the step metrics,
``/v1/status`` and the summary; with ``rollout.unverified_fingerprint = "mismatch"`` such a
rollout worker is restarted like a mismatched one. Hand-written reports; stand-ins for the pool
and the old-logit service handle."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from rich.console import Console

from protocol import JobStatus
from tests.fingerprint_fakes import FakeCalls as _Calls
from tests.fingerprint_fakes import FakePool as _Pool
from trainer.driver.config.schema import load_config, one_line
from trainer.driver.loop.report import status_fields
from trainer.driver.publication.fingerprint_check import FingerprintCheck
from trainer.driver.publication.fingerprints import (
    FINGERPRINT_MISMATCH,
    is_unverified,
    mismatched_workers,
    unverified_workers,
)
from trainer.driver.sources.buffer import TrajectoryBuffer

A, B, C = "a" * 16, "b" * 16, "c" * 16
FULL = SimpleNamespace(version=1, adapter=None, fingerprint=A)
REPORTS = {
    "rollout-0": {"version": 1, "served": A, "applied": A},  # serves v1: verified
    "rollout-1": {"version": 1, "served": None, "applied": A},  # could not read its weights back
    "rollout-2": {"version": 1, "served": B, "applied": A},  # serves other weights: a mismatch
    "rollout-3": {"version": 0, "served": None, "applied": None},  # did not take v1: not judged, not counted
}


def test_which_reports_cannot_be_judged():
    assert [w for w, r in REPORTS.items() if is_unverified(FULL, r, merges_adapters=True)] == ["rollout-1"]
    assert not is_unverified(FULL, None, merges_adapters=True)  # no answer: asked again later, not counted
    no_fingerprint = SimpleNamespace(version=1, adapter=None, fingerprint=None)
    assert is_unverified(no_fingerprint, {"version": 1, "served": A}, merges_adapters=False)  # nothing to compare to
    adapter = SimpleNamespace(version=2, adapter=object(), fingerprint=C)
    # a worker that merges an adapter should serve its own merge, unknown here; the service holds the adapter
    assert is_unverified(adapter, {"version": 2, "served": A, "applied": None}, merges_adapters=True)
    assert not is_unverified(adapter, {"version": 2, "served": A, "applied": None}, merges_adapters=False)
    assert unverified_workers(FULL, REPORTS) == ["rollout-1"]
    assert mismatched_workers(FULL, REPORTS) == ["rollout-2"]
    assert mismatched_workers(FULL, REPORTS, unverified="count") == ["rollout-2"]
    assert mismatched_workers(FULL, REPORTS, unverified="mismatch") == ["rollout-1", "rollout-2"]


@pytest.mark.parametrize(
    ("setting", "killed", "mismatches"),
    [(None, ["rollout-2"], 1), ("count", ["rollout-2"], 1), ("mismatch", ["rollout-1", "rollout-2"], 2)],
)
def test_unverifiable_consumers_are_counted_and_restarted_only_when_asked(monkeypatch, setting, killed, mismatches):
    """After v1: rollout-1 and the old-logit service report no served fingerprint (2 unverified);
    rollout-2 serves other weights (a mismatch). A joiner that cannot read back counts once more."""
    import ray

    monkeypatch.setattr(ray, "kill", lambda *a, **k: pytest.fail("the service is never restarted here"))
    cfg = load_config(None, [] if setting is None else [f'rollout.unverified_fingerprint="{setting}"'])
    calls = _Calls({"version": 1, "served": None})  # the service could not read back either
    f = FingerprintCheck(
        cfg, Console(quiet=True), _Pool(REPORTS), SimpleNamespace(calls=calls, oldlogit="service-handle")
    )
    f.check_fingerprints(FULL, (FULL, "ref"))
    assert f.pool.killed == [(killed, FINGERPRINT_MISMATCH)]
    assert (f.mismatches, f.unverified) == (mismatches, 2)
    assert calls.calls == ["fingerprint"]  # counted, not restarted (the setting is the rollout workers')

    f.pool = _Pool({"rollout-4": {"version": 1, "served": None, "applied": A}})
    f.pool.unverified = {"rollout-4": FULL}  # a joiner caught up outside the publication
    assert f.check_joined_workers() == (["rollout-4"] if setting == "mismatch" else [])
    assert (f.mismatches, f.unverified) == (mismatches + (setting == "mismatch"), 3)


def test_the_count_reaches_the_status():
    job = SimpleNamespace(
        version=1, run_segment=0, route=SimpleNamespace(name="none"), pool=SimpleNamespace(statuses=lambda: []),
        buffer=TrajectoryBuffer(capacity=4, max_staleness=1), publisher=SimpleNamespace(last={}),
        source=SimpleNamespace(status=lambda: None), fingerprints=SimpleNamespace(mismatches=1, unverified=3), evals=SimpleNamespace(resubmitted=0),
    )  # fmt: skip
    s = JobStatus(**status_fields(job, None))
    assert (s.fingerprint_mismatch, s.fingerprint_unverified) == (1, 3)


def test_the_setting_refuses_other_values():
    with pytest.raises(ValidationError) as e:
        load_config(None, ['rollout.unverified_fingerprint="ignore"'])
    assert one_line(e.value) == "rollout.unverified_fingerprint: Input should be 'count' or 'mismatch' (got 'ignore')"
