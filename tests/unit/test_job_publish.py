"""Publisher.publish: the learner's part returns before the consumers apply (none/snapshot routes), one
publication is applied at a time, a consumer's failure surfaces at the next wait, and scorer routes
keep the scorer in lockstep (a recording learner and a gated pool stand in for the Ray actors)."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from rich.console import Console

from trainer.driver.config.schema import load_config
from trainer.driver.publication.fingerprint_check import FingerprintCheck
from trainer.driver.publication.publisher import Publisher
from trainer.driver.publication.routes import Route, ScorerRoute


class Learner:
    def __init__(self):
        self.published = []

    def async_publish(self, dtype="float32", transport="host", mismatch_std=0.0, mismatch_seed=0):
        self.published.append(dtype)
        return Manifest(len(self.published)), f"ref-{len(self.published)}"


class Manifest:
    def __init__(self, version):
        self.version, self.total_bytes, self.adapter, self.fingerprint = version, 100, None, f"{version:016x}"


class GatedPool:
    """``update_weights`` blocks until the test opens the gate; records what was applied."""

    def __init__(self, fail_at=None):
        self.gate, self.started, self.applied, self.fail_at = threading.Event(), threading.Event(), [], fail_at

    def update_weights(self, manifest, ref):
        self.started.set()
        assert self.gate.wait(30)
        if manifest.version == self.fail_at:
            raise RuntimeError(f"worker refused version {manifest.version}")
        self.applied.append((manifest.version, ref))

    def fingerprints(self):
        return {}  # no worker reports a fingerprint: nothing to judge

    def worker_ids(self):
        return []


class Scorer:
    """A stand-in old-logit service handle: ``update_weights.remote`` records the call order."""

    def __init__(self, log):
        self.update_weights = self
        self.fingerprint = _Method({"version": None, "served": None})
        self.log = log

    def remote(self, manifest, ref):
        self.log.append(("scorer", manifest.version))
        return "done"


class _Method:
    def __init__(self, answer):
        self.answer = answer

    def remote(self):
        return self.answer


def publisher(pool, route):
    cfg = load_config(None, [])
    rows = []
    ledger = lambda event, ids, reason=None, **fields: rows.append({"event": event, "ids": ids, **fields})  # noqa: E731
    p = Publisher(
        cfg, Learner(), route, pool, FingerprintCheck(cfg, Console(quiet=True), pool, route), ledger, Counter()
    )
    p.ledger_rows = rows
    return p


def test_publish_returns_before_the_workers_apply_and_the_next_waits():
    pool = GatedPool()
    j = publisher(pool, Route())
    j.publish()  # returns although no worker has applied version 1
    assert pool.started.wait(30) and pool.applied == [] and j.learner.published == ["float32"]
    assert j.served_version == 0  # the workers still serve version 0
    nxt = threading.Thread(target=j.publish)
    nxt.start()
    nxt.join(0.2)
    assert nxt.is_alive() and j.learner.published == ["float32"]  # version 2 waits for version 1
    pool.gate.set()
    nxt.join(30)
    j.wait()
    assert pool.applied == [(1, "ref-1"), (2, "ref-2")]
    assert j.served_version == 2
    assert j.ledger_rows == [  # each version's learner fingerprint, for checks of what was served
        {"event": "published", "ids": [], "published": 1, "fingerprint": "0000000000000001"},
        {"event": "published", "ids": [], "published": 2, "fingerprint": "0000000000000002"},
    ]


def test_a_failed_apply_is_raised_by_the_next_wait():
    pool = GatedPool(fail_at=1)
    j = publisher(pool, Route())
    j.publish()
    pool.gate.set()
    with pytest.raises(RuntimeError, match="worker refused version 1"):
        j.wait()
    assert j.served_version == 0  # not applied: still the version before
    j.wait()  # raised once


def test_scorer_routes_wait_for_workers_then_scorer(monkeypatch):
    import ray

    log = []
    monkeypatch.setattr(ray, "get", lambda x, timeout=None: x)
    pool = GatedPool()
    pool.gate.set()
    orig = pool.update_weights
    pool.update_weights = lambda m, r: (log.append(("workers", m.version)), orig(m, r))
    j = publisher(pool, ScorerRoute("interrupt_sync", Scorer(log)))
    j.publish()
    assert log == [("workers", 1), ("scorer", 1)] and j._applying is None  # applied before returning
