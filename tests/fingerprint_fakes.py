"""Stand-ins for the rollout pool and the old-logit service calls in the fingerprint checks' unit tests."""

from __future__ import annotations


class FakePool:
    """The pool's fingerprint side: canned reports, what was killed and marked unverified."""

    def __init__(self, reports):
        self.reports, self.killed, self.unverified = reports, [], {}

    def fingerprints(self, only=None):
        return {w: r for w, r in self.reports.items() if only is None or w in only}

    def worker_ids(self):
        return sorted(self.reports)

    def mark_unverified(self, wid, manifest):
        self.unverified[wid] = manifest

    def take_unverified(self):
        out, self.unverified = self.unverified, {}
        return out

    def kill(self, wids, reason):
        self.killed.append((wids, reason))


class FakeCalls:
    """The old-logit service's calls: answers ``fingerprint`` with a canned report, records the methods."""

    def __init__(self, report):
        self.report, self.calls = report, []

    def call(self, method, *args):
        self.calls.append(method)
        return self.report if method == "fingerprint" else None
