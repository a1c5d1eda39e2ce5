"""Versions reaching their consumers: the old-logit routes (``routes``), the publisher that applies
one publication at a time (``publisher``), the fingerprint every consumer must serve at a version
(``fingerprints``) and its check against workers and trajectories (``fingerprint_check``).

Invariants: a version is published whole to every consumer before the next; a trajectory whose
fingerprint differs from its version's is never trained on. Imports ``config``, ``records``,
``sources`` and ``workers``."""
