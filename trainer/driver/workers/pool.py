"""The driver's handle on the rollout workers: create, scale, feed, poll and update them.

Workers are independent Ray actors (:data:`rollout.worker_actor.RolloutWorker`); adding or removing one
never stops the others. A removed worker's unfinished training samples are counted as lost by the
caller; so are those of a worker whose process died, which every call notices and leaves out, and
those of a worker that hung (:meth:`WorkerPool.kill_hung`), which is killed: both are reported by
:meth:`WorkerPool.take_deaths` with the reason. Samples of held-out evaluation requests
(``purpose = "eval"``) are never in those counts: their requests are sent again (see below).

Hangs (with ``hang_timeout_s`` set): a worker answers its calls between two engine steps; one stuck
inside a step (an environment that never returns, a wedged engine) answers nothing. The pool never
blocks on it: a poll, status or submission waits at most :data:`CALL_WAIT_S`, a weight update at
most ``hang_timeout_s``; a call not answered by then is *late*: it is kept, its answer (finished
trajectories, an accepted submission's count) is taken in by a later :meth:`WorkerPool.poll`, and
until it arrives the worker gets no new call. A publication it missed meanwhile is not queued behind
(payloads would pile up in the object store): once its late answers are in, it is sent the newest
publication before anything else.

A publication a worker applied outside :meth:`WorkerPool.update_weights`'s own answers - a joiner's
catch-up in :meth:`WorkerPool.admit_started`, a late worker's update or catch-up taken in by a
poll - is not yet checked against its manifest: :meth:`WorkerPool.take_unverified` hands those
workers to the caller, which checks their served fingerprints as after a publication. A worker with samples in flight and no finished trajectory for
longer than ``hang_timeout_s`` is hung (:func:`hung_workers`).

Requests lost with a worker: the pool remembers which request ids each worker holds (samples
taken, their trajectories not polled yet; a trajectory's id names its request:
:func:`rollout.worker.sample_id`), and which of them are evaluation requests. When a worker is
buried, killed or removed, the ids it held are handed out by :meth:`WorkerPool.take_lost_requests`
(with the reason: :meth:`WorkerPool.take_lost`), so a caller waiting for one (the gateway, the env
loop's held-out evaluation) resubmits it at once instead of waiting for a result nothing will deliver.

The pool may be fed from several threads (the driver and the gateway): one lock guards the worker
table, the in-flight counts and the late calls; remote calls are made outside it, except while scaling.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import ray

from protocol import RolloutRequest, Trajectory, WeightManifest, WorkerStatus
from rollout.engine import EngineConfig
from rollout.worker_actor import RolloutWorker
from trainer.driver.workers.held import HeldRequests

CALL_WAIT_S = 5.0
"""Longest wait, seconds, for a worker's answer to a poll, status or submission when hang detection
is on; a healthy worker answers within one engine step. An answer that comes later is not lost."""

WORKER_DIED, WORKER_HUNG, WORKER_REMOVED = "worker_died", "worker_hung", "worker_removed"
"""Reasons a worker's in-flight samples are lost: its process died; it hung and was killed; a scale
request removed it."""


def _number(wid: str) -> int:
    """The number in a worker id (``rollout-12`` -> 12): the newest worker has the largest."""
    return int(wid.split("-")[1])


def hung_workers(
    in_flight: Mapping[str, int], last_progress: Mapping[str, float], now: float, timeout_s: float | None
) -> list[str]:
    """Workers with samples in flight whose last progress is more than ``timeout_s`` seconds before ``now``.

    A worker's last progress is the last time one of its trajectories arrived, or the time work
    reached it while it had none in flight (an idle worker is never hung). ``timeout_s`` None or 0
    disables the rule. Same clock for every time (seconds).

    Example: timeout 10 s at now = 100: a worker with 3 in flight and last progress at 85 is hung
    (15 s); one at 95 is not (5 s); one with 0 in flight and last progress at 0 is not (idle).
    """
    if not timeout_s:
        return []
    return sorted(w for w, n in in_flight.items() if n > 0 and now - last_progress.get(w, now) > timeout_s)


class WorkerPool:
    """``num_workers`` rollout actors built from one :class:`EngineConfig`, addressed by id.

    ``hang_timeout_s``: seconds without a finished trajectory (while samples are in flight) after
    which a worker is hung (see the module docstring); None or 0: no hang detection, and every call
    waits for its answer. ``clock``: monotonic seconds (a test may pass its own). ``oldlogit``: the
    old-logit service handle workers score their prefixes with on ``interrupt_sync``, each call
    waiting at most ``oldlogit_restart_timeout_s`` for a restarting service. ``worker_options``:
    further keyword arguments of every worker's constructor (:class:`rollout.worker_actor.RolloutWorkerActor`:
    ``torch_threads``, ``yield_cpu``).
    """

    def __init__(
        self,
        engine_config: EngineConfig,
        actor_options: dict | None = None,
        max_num_seqs: int = 64,
        oldlogit: Any = None,
        oldlogit_restart_timeout_s: float = 600.0,
        start_timeout_s: float = 300.0,
        hang_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        worker_options: dict | None = None,
    ):
        self.engine_config, self.max_num_seqs = engine_config, max_num_seqs
        self.start_timeout_s = start_timeout_s
        self.hang_timeout_s = hang_timeout_s or None
        self.clock = clock
        self.actor_options = actor_options or {"num_cpus": 1.0}
        self.worker_options = dict(worker_options or {})
        self.oldlogit = oldlogit  # interrupt_sync: workers score their prefixes there at each update
        self.oldlogit_restart_timeout_s = oldlogit_restart_timeout_s
        self.workers: dict[str, Any] = {}
        self.starting: dict[str, tuple[Any, Any, float]] = {}
        """Workers launched and not ready yet: id -> (actor, its ``ready`` reference, deadline)."""
        self.in_flight: dict[str, int] = {}
        self.last_progress: dict[str, float] = {}
        self._ids = itertools.count()
        self._latest: tuple[WeightManifest, Any] | None = None
        self._lock = threading.RLock()
        self._harvesting = threading.Lock()
        self._died: dict[str, tuple[int, str]] = {}
        self._late: dict[str, list[tuple[str, Any, int]]] = {}  # wid -> [(method, ref, samples)], call order
        self._behind: set[str] = set()  # late workers that missed a publication
        self._unverified: dict[str, WeightManifest] = {}  # applied outside update_weights' answers
        self.held = HeldRequests()
        """The requests each worker holds and those lost with a worker (under the lock)."""

    def __len__(self) -> int:
        return len(self.workers)

    def worker_ids(self) -> list[str]:
        """Ids of the live workers (those still starting left out)."""
        with self._lock:
            return sorted(self.workers, key=_number)

    def scale_to(self, n: int) -> tuple[list[str], dict[str, int]]:
        """Add or remove workers to reach ``n`` and wait for the new ones; returns (added ids,
        {removed id: lost samples}). Used at start-up; a running job uses :meth:`request` and
        :meth:`admit_started`, which never wait.

        A worker that is not placed and started within ``start_timeout_s`` (e.g. the cluster has no
        room for it) is killed: the pool then holds fewer than ``n``. One that dies while starting
        (its node was lost before Ray marked it dead) is placed again, within the same
        ``start_timeout_s``.
        """
        removed = self.request(n)
        added: list[str] = []
        while self.starting:
            joined, _ = self.admit_started()
            added += joined
            if self.starting:
                time.sleep(0.1)
        return added, removed

    def request(self, n: int) -> dict[str, int]:
        """Move toward ``n`` workers without waiting for any start: new workers are launched and
        join when :meth:`admit_started` finds them ready (each within ``start_timeout_s``); extra
        workers are removed now, those still starting first. Returns {removed id: lost training
        samples}; the requests they held go to :meth:`take_lost` with reason :data:`WORKER_REMOVED`."""
        removed: dict[str, int] = {}
        with self._lock:
            while len(self.workers) + len(self.starting) < n:
                self._launch(f"rollout-{next(self._ids)}", time.monotonic() + self.start_timeout_s)
            while self.starting and len(self.workers) + len(self.starting) > n:
                ray.kill(self.starting.pop(max(self.starting, key=_number))[0])
            while len(self.workers) > n:
                wid = max(self.workers, key=_number)
                actor = self.workers.pop(wid)
                removed[wid] = max(0, self.in_flight.pop(wid) - self.held.lose(wid, WORKER_REMOVED))
                self.last_progress.pop(wid, None)
                self._late.pop(wid, None)
                self._behind.discard(wid)
                try:
                    ray.get(actor.close.remote(), timeout=30)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    pass  # already dead, or hung: nothing to close
                finally:
                    ray.kill(actor)
        return removed

    def _launch(self, wid: str, deadline: float) -> None:
        """Create worker ``wid``'s actor; it must be ready by ``deadline`` (monotonic seconds)."""
        actor = RolloutWorker.options(**self.actor_options).remote(
            self.engine_config,
            worker_id=wid,
            max_num_seqs=self.max_num_seqs,
            oldlogit=self.oldlogit,
            oldlogit_restart_timeout_s=self.oldlogit_restart_timeout_s,
            **self.worker_options,
        )
        self.starting[wid] = (actor, actor.ready.remote(), deadline)

    def admit_started(self) -> tuple[list[str], list[str]]:
        """Workers whose start finished join the pool at the current version (the newest
        publication is installed first); one not ready by its deadline is killed; one that died
        while starting (its node was lost) is launched again under the same deadline. Never waits
        for a start. Returns (joined ids, ids given up because ``start_timeout_s`` passed)."""
        joined, gave_up = [], []
        with self._lock:
            for wid, (actor, ready, deadline) in list(self.starting.items()):
                done, _ = ray.wait([ready], timeout=0)
                if not done:
                    if time.monotonic() >= deadline:
                        ray.kill(actor)
                        del self.starting[wid]
                        gave_up.append(wid)
                    continue
                del self.starting[wid]
                try:
                    ray.get(ready)
                except ray.exceptions.RayActorError:  # died while starting: place it again
                    ray.kill(actor)
                    if time.monotonic() < deadline:
                        self._launch(wid, deadline)
                    else:
                        gave_up.append(wid)
                    continue
                if self._latest is not None:  # a late joiner starts at the current version
                    ray.get(actor.update_weights.remote(*self._latest))
                    self._unverified[wid] = self._latest[0]
                self.workers[wid], self.in_flight[wid] = actor, 0
                self.last_progress[wid] = self.clock()
                joined.append(wid)
        return joined, gave_up

    def _bury(self, wid: str, reason: str = WORKER_DIED) -> None:
        """Forget a worker whose process died (or that hung); its in-flight training samples are
        recorded as lost, the requests it held go to :meth:`take_lost`."""
        with self._lock:
            if wid in self.workers:
                del self.workers[wid]
                self._died[wid] = (max(0, self.in_flight.pop(wid, 0) - self.held.lose(wid, reason)), reason)
                self.last_progress.pop(wid, None)
                self._late.pop(wid, None)
                self._behind.discard(wid)
                self._unverified.pop(wid, None)

    def _hold(self, wid: str, request_id: str, n: int, purpose: str = "train") -> None:
        """``wid`` took ``n`` samples of ``request_id``, a request of ``purpose``, if it is live (lock held)."""
        if wid in self.workers:
            self.held.hold(wid, request_id, n, purpose)

    def take_lost(self) -> list[tuple[str, str]]:
        """``(request id, reason)`` of the requests a worker held when it died, hung, was killed or
        was removed (their trajectories will never arrive), since the last call (of this or
        :meth:`take_lost_requests`), in the order lost; each once. ``reason`` is the worker's
        (:data:`WORKER_DIED`, :data:`WORKER_HUNG`, :data:`WORKER_REMOVED`, or the reason it was killed with)."""
        with self._lock:
            return self.held.take_lost()

    def take_lost_requests(self) -> list[str]:
        """The ids of :meth:`take_lost`."""
        return [rid for rid, _ in self.take_lost()]

    def take_unverified(self) -> dict[str, WeightManifest]:
        """``{worker id: manifest}`` of the live workers that applied a publication since the last
        call whose served fingerprint nobody has checked (a joiner's catch-up, a late worker's
        update or catch-up; see the module docstring), and forget them."""
        with self._lock:
            out = {w: m for w, m in self._unverified.items() if w in self.workers}
            self._unverified = {}
        return out

    def mark_unverified(self, wid: str, manifest: WeightManifest) -> None:
        """Hand ``wid`` (applied ``manifest``, not checked yet: e.g. it was late when asked) to the
        next :meth:`take_unverified` again, unless it is gone."""
        with self._lock:
            if wid in self.workers:
                self._unverified[wid] = manifest

    def take_deaths(self) -> dict[str, tuple[int, str]]:
        """``{worker id: (in-flight training samples lost, reason)}`` of workers found dead
        (:data:`WORKER_DIED`), killed as hung (:data:`WORKER_HUNG`) or killed by :meth:`kill` since
        the last call; samples of evaluation requests are left out (their requests: :meth:`take_lost`)."""
        with self._lock:
            died, self._died = self._died, {}
        return died

    def kill_hung(self) -> list[str]:
        """Kill every worker that is hung now (:func:`hung_workers`); they are reported by
        :meth:`take_deaths` with reason :data:`WORKER_HUNG`. Returns their ids."""
        with self._lock:
            hung = hung_workers(self.in_flight, self.last_progress, self.clock(), self.hang_timeout_s)
            actors = [self.workers[w] for w in hung]
            for wid in hung:
                self._bury(wid, WORKER_HUNG)
        for actor in actors:
            ray.kill(actor)
        return hung

    def _call_all(
        self, method: str, *args: Any, wait_s: float | None = None, only: list[str] | None = None
    ) -> dict[str, Any]:
        """``method`` on every worker (of ``only``, when given) that has no late call, at once;
        answers within ``wait_s`` seconds (None: however long they take). A worker found dead is
        buried and left out; an unanswered call becomes late. A worker with late calls that misses
        ``update_weights`` is marked behind (:meth:`_harvest` catches it up)."""
        with self._lock:
            refs = {}
            for wid, a in self.workers.items():
                if only is not None and wid not in only:
                    continue
                if wid not in self._late:
                    refs[wid] = getattr(a, method).remote(*args)
                elif method == "update_weights":
                    self._behind.add(wid)
        return self._answers(method, refs, wait_s)

    def _answers(self, method: str, refs: dict[str, Any], wait_s: float | None) -> dict[str, Any]:
        if refs:
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=wait_s)
        out = {}
        for wid, ref in refs.items():
            if not ray.wait([ref], timeout=0)[0]:
                with self._lock:
                    if wid in self.workers:
                        self._late.setdefault(wid, []).append((method, ref, 0))
                continue
            try:
                out[wid] = ray.get(ref)
            except ray.exceptions.RayActorError:
                self._bury(wid)
        return out

    def _harvest(self) -> dict[str, list[Trajectory]]:
        """Take in the late calls answered since (in call order per worker): ``{worker id: trajectories}``
        of late polls; a late submission's accepted count corrects the in-flight count. A worker whose
        late calls are all in and that missed a publication is sent the newest one (a late call).

        Raises:
            Exception: what a late call raised (other than its worker's death), e.g. a refused update.
        """
        got: dict[str, list[Trajectory]] = {}
        with self._harvesting:
            with self._lock:
                late = {wid: list(calls) for wid, calls in self._late.items()}
            for wid, calls in late.items():
                done = 0
                try:
                    for method, ref, n in calls:
                        if not ray.wait([ref], timeout=0)[0]:
                            break
                        done += 1
                        result = ray.get(ref)
                        if method == "update_weights" and self._latest is not None:
                            self.mark_unverified(wid, self._latest[0])
                        if method == "poll":
                            got.setdefault(wid, []).extend(result)
                        elif method == "submit":
                            with self._lock:
                                if wid in self.in_flight:
                                    self.in_flight[wid] += result - n
                except ray.exceptions.RayActorError:
                    self._bury(wid)
                finally:
                    with self._lock:
                        if wid in self._late:
                            del self._late[wid][:done]
                            if not self._late[wid]:
                                del self._late[wid]
                        if wid not in self._late and wid in self._behind and self._latest is not None:
                            self._behind.discard(wid)
                            ref = self.workers[wid].update_weights.remote(*self._latest)
                            self._late[wid] = [("update_weights", ref, 0)]
        return got

    @property
    def _wait_s(self) -> float | None:
        return CALL_WAIT_S if self.hang_timeout_s else None

    def submit(self, requests: list[RolloutRequest]) -> int:
        """Spread requests over workers, fewest in-flight first; returns samples submitted.

        The lock covers only the bookkeeping: the remote calls run outside it, so a poll that waits
        for a worker's current step never delays a submission from another thread.
        Workers with a late call get nothing; a submission not answered within :data:`CALL_WAIT_S`
        counts as accepted (the worker queues it; a later :meth:`poll` corrects the count) and the
        worker becomes late. Requests left when every worker is late are not submitted.
        """
        total = 0
        pending = list(requests)
        while pending:
            r = pending[0]
            with self._lock:
                ready = {w: n for w, n in self.in_flight.items() if w not in self._late}
                if not ready:
                    return total
                wid = min(ready, key=ready.get)
                actor = self.workers[wid]
                if self.in_flight[wid] == 0:  # the hang clock starts when work reaches an idle worker
                    self.last_progress[wid] = self.clock()
                self.in_flight[wid] += r.sampling.n
            ref = actor.submit.remote([r])
            try:
                n = ray.get(ref, timeout=self._wait_s)
            except ray.exceptions.GetTimeoutError:
                with self._lock:
                    if wid in self.workers:
                        self._late.setdefault(wid, []).append(("submit", ref, r.sampling.n))
                    self._hold(wid, r.request_id, r.sampling.n, r.purpose)
                n = r.sampling.n
            except BaseException as e:
                with self._lock:
                    if wid in self.in_flight:
                        self.in_flight[wid] -= r.sampling.n
                if not isinstance(e, ray.exceptions.RayActorError):
                    raise
                self._bury(wid)  # the worker died: the request goes to another one
                continue
            else:
                with self._lock:
                    if wid in self.in_flight:
                        self.in_flight[wid] += n - r.sampling.n
                    self._hold(wid, r.request_id, n, r.purpose)
            total += n
            pending.pop(0)
        return total

    def poll(self) -> list[Trajectory]:
        """Finished trajectories from every live worker (remote calls outside the lock, as in
        :meth:`submit`), those of late polls answered since included; a worker found dead is buried
        (see :meth:`take_deaths`). A worker's trajectories arriving are its progress (:func:`hung_workers`).

        Raises:
            Exception: what a late call raised, other than its worker's death (:meth:`_harvest`).
        """
        got = self._harvest()
        for wid, g in self._call_all("poll", wait_s=self._wait_s).items():
            got.setdefault(wid, []).extend(g)
        out: list[Trajectory] = []
        now = self.clock()
        with self._lock:
            for wid, g in got.items():
                if wid in self.in_flight:
                    self.in_flight[wid] -= len(g)
                    if g:
                        self.last_progress[wid] = now
                self.held.release(wid, g)
                out += g
        return out

    def update_weights(self, manifest: WeightManifest, payload_ref: Any) -> list[int]:
        """Apply a publication on every worker (:meth:`rollout.worker.RolloutWorkerCore.update_weights`); returns the versions of
        those that answered (within ``hang_timeout_s``; a worker with a late call is not waited for)."""
        with self._lock:
            self._latest = (manifest, payload_ref)
        return list(self._call_all("update_weights", manifest, payload_ref, wait_s=self.hang_timeout_s).values())

    def fingerprints(self, only: list[str] | None = None) -> dict[str, dict[str, Any]]:
        """``{worker id: served-fingerprint report}`` (:meth:`rollout.worker.RolloutWorkerCore.fingerprint`)
        of each live worker (of ``only``, when given); workers with a late call are left out."""
        return self._call_all("fingerprint", wait_s=self._wait_s, only=only)

    def kill(self, wids: list[str], reason: str) -> None:
        """Kill workers ``wids`` now; :meth:`take_deaths` reports them with ``reason`` and their
        in-flight training samples, so the caller replaces them as it replaces dead ones."""
        with self._lock:
            actors = [self.workers[w] for w in wids if w in self.workers]
            for wid in wids:
                self._bury(wid, reason)
        for actor in actors:
            ray.kill(actor)

    def statuses(self) -> list[WorkerStatus]:
        """Each live worker's status (workers with a late call are left out)."""
        return list(self._call_all("status", wait_s=self._wait_s).values())

    def shutdown(self) -> None:
        self.scale_to(0)
