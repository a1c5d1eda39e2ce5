"""``Publisher``: the learner's versions published to every consumer, one publication applied at a time.

The learner packs a version into the object store and is free again (the driver handles manifests
and references only). The consumers then take it in the order the route decides
(:mod:`trainer.driver.publication.routes`): on the ``none`` and ``snapshot`` routes in the
background, so the loop and the learner go on while each worker switches between two tokens;
scorer routes keep the scorer in lockstep with the workers, so :meth:`Publisher.publish` waits for
them.

Invariants: a publication starts only after the previous one was applied (:meth:`Publisher.wait`
first, which raises the previous one's failure, if any); :attr:`Publisher.served_version` is the
last version every consumer applied; each version's learner fingerprint is in the ledger before any
consumer applies it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

from trainer.driver.config.schema import JobConfig
from trainer.driver.publication.fingerprint_check import FingerprintCheck
from trainer.driver.publication.routes import Route
from trainer.driver.records.ledger import Ledger

if TYPE_CHECKING:
    from trainer.driver.workers.pool import WorkerPool
    from trainer.learner import LearnerGroup


class Publisher:
    """Publishes the learner's current version (see the module docstring).

    Args:
        cfg: the job config (``rollout.dtype``, ``rollout.inject_mismatch_std``, ``controller.seed``).
        learner: the learner ranks (``async_publish``).
        route: the old-logit route: what the service installs and in which order.
        pool: the rollout workers (``update_weights``).
        fingerprints: told of each publication before it is applied, and checks it after.
        ledger: gets a ``published`` row per version, with its learner fingerprint.
        times: the loop's timers; ``times["publish"]`` gains the learner's part of each publication.
    """

    def __init__(
        self,
        cfg: JobConfig,
        learner: LearnerGroup,
        route: Route,
        pool: WorkerPool,
        fingerprints: FingerprintCheck,
        ledger: Ledger,
        times: Counter,
    ) -> None:
        self.cfg, self.learner, self.route, self.pool = cfg, learner, route, pool
        self.fingerprints, self.ledger, self.times = fingerprints, ledger, times
        self.served_version = 0
        """The last version applied by every rollout worker and scorer: the oldest version new work
        may still be sampled with. 0 until the first publication is applied (a resumed job's
        consumers start from the model folder's weights)."""
        self.last: dict[str, float] = {}
        """The last publication: the learner's ``seconds``, its ``bytes``, its ``unix`` time and,
        once applied, the consumers' ``applied_s``."""
        self._applying: threading.Thread | None = None
        self._apply_error: BaseException | None = None

    def publish(self) -> None:
        """Publish the learner's current version to every rollout worker and the old-logit service,
        after waiting for the previous publication (:meth:`wait`, which raises its failure)."""
        self.wait()
        t0 = time.perf_counter()
        noise = self.cfg.rollout.inject_mismatch_std
        manifest, ref = self.learner.async_publish(
            self.cfg.rollout.dtype, mismatch_std=noise, mismatch_seed=self.cfg.controller.seed * 100_003
        )
        scorer_weights = self.route.scorer_publication(
            (manifest, ref), self.cfg.rollout.dtype, self.learner.async_publish, perturbed=noise > 0
        )
        self.fingerprints.published(manifest)  # no publication thread runs now
        self.ledger("published", [], published=manifest.version, fingerprint=manifest.fingerprint)
        self.last = {"seconds": time.perf_counter() - t0, "bytes": manifest.total_bytes, "unix": time.time()}
        self.times["publish"] += self.last["seconds"]

        def apply() -> None:
            t1 = time.perf_counter()
            try:
                self.route.publish(lambda: self.pool.update_weights(manifest, ref), scorer_weights)
                self.fingerprints.check_fingerprints(manifest, scorer_weights)
                self.served_version = manifest.version
            except BaseException as e:  # raised by the next wait
                self._apply_error = e
            self.last["applied_s"] = time.perf_counter() - t1

        if self.route.background_publish:
            self._applying = threading.Thread(target=apply, name=f"publish-v{manifest.version}", daemon=True)
            self._applying.start()
        else:
            apply()
            self.wait()

    def wait(self) -> None:
        """Wait until every consumer has applied the last publication; re-raise its failure, if any."""
        th, self._applying = self._applying, None
        if th is not None:
            th.join()
        err, self._apply_error = self._apply_error, None
        if err is not None:
            raise err
