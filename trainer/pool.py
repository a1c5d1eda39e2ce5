"""The driver's handle on the rollout workers: create, scale, feed, poll and update them.

Workers are independent Ray actors (:data:`rollout.worker.RolloutWorker`); adding or removing one
never stops the others. A removed worker's unfinished samples are counted as lost by the caller; so
are those of a worker whose process died, which every call notices and leaves out (:meth:`take_deaths`).
The pool may be fed from several threads (the driver and the gateway): one lock guards the worker
table and the in-flight counts; remote calls are made outside it, except while scaling.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import ray

from protocol import RolloutRequest, Trajectory, WeightManifest, WorkerStatus
from rollout.engine import EngineConfig
from rollout.worker import RolloutWorker


class WorkerPool:
    """``num_workers`` rollout actors built from one :class:`EngineConfig`, addressed by id."""

    def __init__(
        self,
        engine_config: EngineConfig,
        actor_options: dict | None = None,
        max_in_flight: int = 64,
        oldlogit: Any = None,
        start_timeout_s: float = 300.0,
    ):
        self.engine_config, self.max_in_flight = engine_config, max_in_flight
        self.start_timeout_s = start_timeout_s
        self.actor_options = actor_options or {"num_cpus": 1.0}
        self.oldlogit = oldlogit  # interrupt_sync: workers score their prefixes there at each update
        self.workers: dict[str, Any] = {}
        self.in_flight: dict[str, int] = {}
        self._ids = itertools.count()
        self._latest: tuple[WeightManifest, Any] | None = None
        self._lock = threading.RLock()
        self._died: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.workers)

    def scale_to(self, n: int) -> tuple[list[str], dict[str, int]]:
        """Add or remove workers to reach ``n``; returns (added ids, {removed id: lost samples}).

        A worker that is not placed and started within ``start_timeout_s`` (e.g. the cluster has no
        room for it) is killed and no more are added this call: the pool then holds fewer than ``n``.
        """
        with self._lock:
            return self._scale_to(n)

    def _scale_to(self, n: int) -> tuple[list[str], dict[str, int]]:
        added, removed = [], {}
        while len(self.workers) < n:
            wid = f"rollout-{next(self._ids)}"
            actor = RolloutWorker.options(**self.actor_options).remote(
                self.engine_config,
                worker_id=wid,
                max_in_flight=self.max_in_flight,
                oldlogit=self.oldlogit,
            )
            try:
                ray.get(actor.ready.remote(), timeout=self.start_timeout_s)
            except ray.exceptions.GetTimeoutError:
                ray.kill(actor)
                break
            if self._latest is not None:  # a late joiner starts at the current version
                ray.get(actor.update_weights.remote(*self._latest))
            self.workers[wid], self.in_flight[wid] = actor, 0
            added.append(wid)
        while len(self.workers) > n:
            wid = max(self.workers, key=lambda w: int(w.split("-")[1]))
            actor = self.workers.pop(wid)
            removed[wid] = self.in_flight.pop(wid)
            try:
                ray.get(actor.close.remote(), timeout=30)
            except ray.exceptions.RayActorError:
                pass  # already dead: nothing to close
            finally:
                ray.kill(actor)
        return added, removed

    def _bury(self, wid: str) -> None:
        """Forget a worker whose process died; its in-flight samples are recorded as lost."""
        with self._lock:
            if wid in self.workers:
                del self.workers[wid]
                self._died[wid] = self.in_flight.pop(wid, 0)

    def take_deaths(self) -> dict[str, int]:
        """``{worker id: in-flight samples lost}`` of workers found dead since the last call."""
        with self._lock:
            died, self._died = self._died, {}
        return died

    def _call_all(self, method: str, *args: Any) -> dict[str, Any]:
        """``method`` on every worker at once; a worker found dead is buried and left out."""
        with self._lock:
            refs = {wid: getattr(a, method).remote(*args) for wid, a in self.workers.items()}
        out = {}
        for wid, ref in refs.items():
            try:
                out[wid] = ray.get(ref)
            except ray.exceptions.RayActorError:
                self._bury(wid)
        return out

    def submit(self, requests: list[RolloutRequest]) -> int:
        """Spread requests over workers, fewest in-flight first; returns samples submitted.

        The lock covers only the bookkeeping: the remote calls run outside it, so a poll that waits
        for a worker's current step never delays a submission from another thread.
        """
        total = 0
        pending = list(requests)
        while pending:
            r = pending[0]
            with self._lock:
                if not self.workers:
                    return total
                wid = min(self.in_flight, key=self.in_flight.get)
                actor = self.workers[wid]
                self.in_flight[wid] += r.sampling.n
            try:
                n = ray.get(actor.submit.remote([r]))
            except BaseException as e:
                with self._lock:
                    if wid in self.in_flight:
                        self.in_flight[wid] -= r.sampling.n
                if not isinstance(e, ray.exceptions.RayActorError):
                    raise
                self._bury(wid)  # the worker died: the request goes to another one
                continue
            with self._lock:
                if wid in self.in_flight:
                    self.in_flight[wid] += n - r.sampling.n
            total += n
            pending.pop(0)
        return total

    def poll(self) -> list[Trajectory]:
        """Finished trajectories from every live worker (remote calls outside the lock, as in
        :meth:`submit`); a worker found dead is buried (see :meth:`take_deaths`)."""
        got = self._call_all("poll")
        out: list[Trajectory] = []
        with self._lock:
            for wid, g in got.items():
                if wid in self.in_flight:
                    self.in_flight[wid] -= len(g)
                out += g
        return out

    def update_weights(self, manifest: WeightManifest, payload_ref: Any) -> list[int]:
        """Apply a publication on every worker (interrupt, update, resume); returns their versions."""
        with self._lock:
            self._latest = (manifest, payload_ref)
        return list(self._call_all("update_weights", manifest, payload_ref).values())

    def statuses(self) -> list[WorkerStatus]:
        """Each live worker's status."""
        return list(self._call_all("status").values())

    def shutdown(self) -> None:
        self.scale_to(0)
