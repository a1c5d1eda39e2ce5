"""How the gateway generates: through the real rollout worker, one prompt-ids request per call.

Each call becomes a :class:`protocol.RolloutRequest` with ``prompt_ids`` (the worker's raw
"continue these ids" request kind): the worker samples it exactly like an in-process rollout, so
every token is stamped with the version that sampled it and a weight update falls between two
tokens of the call, which goes on under the new version (resumed from its prefix, or kept in the
engine with ``rollout.keep_requests_on_update``). The finished one-turn
:class:`protocol.Trajectory` carries the prompt (mask 0) followed by the sampled ids (mask 1),
their mu and versions.

:class:`WorkerBackend` works over anything with ``submit(requests) -> int`` and
``poll() -> list[Trajectory]`` (and, optionally, ``lost() -> list[str]``), all safe to call from two threads at once: a
:class:`rollout.worker.RolloutWorkerCore` (in-process, its own generation thread) or a
``trainer.driver.workers.pool.WorkerPool`` of Ray actors. A dispatcher thread polls while
calls are pending and hands each trajectory to the call waiting for its id; trajectories of other
requests are kept in :attr:`WorkerBackend.foreign` for their owner.

Every wait is bounded:

* a call ``submit`` did not take (it returned fewer samples than asked: the pool sends nothing
  while every worker is late, or when none is running) is submitted again, after 0.05 s, then
  twice as long each time up to 1 s, for at most ``submit_timeout_s`` seconds; past that it fails
  with :class:`Unavailable` ``not_taken``. The dispatcher polls meanwhile, which is what takes in
  the late workers' answers and frees them;
* a taken call whose worker died, hung or was removed with it (the source's ``lost()`` names its
  id; a ``WorkerPool``'s ``take_lost_requests``) is submitted again at once, to a live worker, at
  most :data:`LOST_RESUBMITS` times; past that it fails with :class:`Unavailable` ``worker_lost``.
  The client sees nothing of it but the wait;
* a taken call waits at most ``call_timeout_s`` seconds for its trajectory (a worker that hung
  with it, or died without being noticed, never delivers), then fails with :class:`Unavailable`
  ``timeout``;
* a submission that raises (the worker behind it died, a refused call other than a bad field)
  fails the call with :class:`Unavailable` ``submit_failed`` naming the error; a ``ValueError``
  (the worker refused a field of the request) is raised as it is;
* a call that ends in any way (result, failure, timeout, cancellation) leaves the pending list at
  once, so the dispatcher stops polling when no call is left. The result of a taken call that
  ended without it is discarded when it arrives (counted in :attr:`WorkerBackend.late_discarded`),
  never handed over as foreign.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from protocol import RolloutRequest, SamplingParams, Trajectory
from rollout.gateway.config import GatewayConfig

RESUBMIT_FIRST_S, RESUBMIT_MAX_S = 0.05, 1.0
"""Pause before the first resubmission of a call no worker took, and the longest pause (seconds);
the pause doubles in between."""

LOST_RESUBMITS = 3
"""Times a call is submitted again after the worker holding it was lost; one more loss fails it."""

ABANDONED_KEPT = 65536
"""Ids of ended calls whose result may still arrive that are remembered (the oldest are forgotten first)."""


class Unavailable(RuntimeError):
    """The backend cannot serve a call now (the gateway answers HTTP 503).

    ``reason``: ``not_taken`` (no worker took it within ``submit_timeout_s``), ``timeout`` (no
    result within ``call_timeout_s``), ``worker_lost`` (the worker holding it was lost more than
    :data:`LOST_RESUBMITS` times), ``submit_failed`` (submitting it raised) or ``poll_failed``
    (polling the workers raised).
    """

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class _WorkerLost(Exception):
    """The worker holding a taken call was lost (raised into the call's future, caught in ``generate``)."""


class WorkerBackend:
    """Async ``generate(prompt_ids, sampling)`` over a rollout worker (see the module docstring).

    Args:
        submit: ``submit(list[RolloutRequest]) -> int`` of a worker core or pool (samples taken).
        poll: ``poll() -> list[Trajectory]`` of the same.
        version: the serving policy version (admission and ``admitted_version``).
        poll_interval_s: dispatcher sleep between polls while calls are pending.
        submit_timeout_s: how long a call no worker took is submitted again, seconds.
        call_timeout_s: longest wait for a taken call's trajectory, seconds.
        lost: ``lost() -> list[str]``: ids of requests whose worker was lost since the last call
            (None: the source never loses one, e.g. an in-process core).

    Raises:
        ValueError: a timeout that is not positive (the message names the ``gateway`` setting).
    """

    def __init__(
        self,
        submit: Callable[[list[RolloutRequest]], int],
        poll: Callable[[], list[Trajectory]],
        version: Callable[[], int],
        poll_interval_s: float = 0.002,
        submit_timeout_s: float = 30.0,
        call_timeout_s: float = 600.0,
        lost: Callable[[], list[str]] | None = None,
    ):
        for name, v in (("submit_timeout_s", submit_timeout_s), ("call_timeout_s", call_timeout_s)):
            if not v > 0:
                raise ValueError(f"gateway.{name}: must be > 0, got {v!r}")
        self._submit, self._poll, self.version = submit, poll, version
        self._lost = lost or list
        self.poll_interval_s = poll_interval_s
        self.submit_timeout_s, self.call_timeout_s = submit_timeout_s, call_timeout_s
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._abandoned: OrderedDict[str, None] = OrderedDict()
        self._has_work = threading.Event()
        self._stop = threading.Event()
        self.foreign: list[Trajectory] = []
        self.resubmissions = 0
        """Submissions repeated because no worker took the call."""
        self.late_discarded = 0
        """Trajectories that arrived after their call had ended (timed out or failed); not used."""
        self.lost_resubmissions = 0
        """Calls submitted again because the worker holding them was lost."""
        self._thread = threading.Thread(target=self._dispatch, name="vintage-gateway-poll", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(
        cls,
        submit: Callable[[list[RolloutRequest]], int],
        poll: Callable[[], list[Trajectory]],
        version: Callable[[], int],
        config: GatewayConfig,
        lost: Callable[[], list[str]] | None = None,
    ) -> WorkerBackend:
        """The backend with the ``[gateway]`` section's ``submit_timeout_s`` and ``call_timeout_s``."""
        return cls(
            submit, poll, version, submit_timeout_s=config.submit_timeout_s, call_timeout_s=config.call_timeout_s,
            lost=lost,
        )  # fmt: skip

    @classmethod
    def over_core(cls, core: Any, **kw) -> WorkerBackend:
        """Backend over an in-process :class:`rollout.worker.RolloutWorkerCore`."""
        return cls(core.submit, core.poll, lambda: core.version, **kw)

    @property
    def pending(self) -> int:
        """Calls waiting now (to be taken by a worker, or for their trajectory)."""
        with self._lock:
            return len(self._waiting)

    async def generate(
        self, request_id: str, group_id: str, prompt_ids: list[int], sampling: SamplingParams, admitted_version: int
    ) -> Trajectory:
        """Sample one turn after ``prompt_ids``; returns the worker's trajectory for it.

        Raises:
            ValueError: the worker refused the request (the message names the field).
            Unavailable: no worker took it within ``submit_timeout_s``, no result within
                ``call_timeout_s``, its worker was lost more than :data:`LOST_RESUBMITS` times,
                submitting or polling the workers failed.
        """
        req = RolloutRequest(
            request_id=request_id,
            group_id=group_id,
            prompt_ids=prompt_ids,
            sampling=sampling,
            admitted_version=admitted_version,
        )
        losses = 0
        while True:
            try:
                return await self._attempt(req)
            except _WorkerLost:
                losses += 1
                if losses > LOST_RESUBMITS:
                    raise Unavailable(
                        "worker_lost", f"the rollout worker holding the call was lost {losses} times; retry"
                    ) from None
                with self._lock:
                    self.lost_resubmissions += 1

    async def _attempt(self, req: RolloutRequest) -> Trajectory:
        """Submit ``req`` once over, until taken, and wait for its trajectory (see :meth:`generate`);
        raises :class:`_WorkerLost` when the worker that took it was lost."""
        request_id = req.request_id
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._lock:
            self._waiting[request_id] = (loop, fut)
        self._has_work.set()
        taken = False
        try:
            taken = await self._submit_until_taken(req, fut)
            try:
                return await asyncio.wait_for(fut, self.call_timeout_s)
            except TimeoutError:
                raise Unavailable(
                    "timeout",
                    f"no result within gateway.call_timeout_s = {self.call_timeout_s:g} s "
                    "(the worker holding the call may have died or hung); retry",
                ) from None
        finally:
            with self._lock:
                if self._waiting.pop(request_id, None) is not None and taken:
                    self._abandon(request_id)
            fut.cancel()  # a result or failure the dispatcher hands over later has no caller

    async def _submit_until_taken(self, req: RolloutRequest, fut: asyncio.Future) -> bool:
        """Submit ``req`` until a worker takes it, for at most ``submit_timeout_s`` (see the module
        docstring); True once taken, False when ``fut`` failed first (polling failed)."""
        deadline = time.monotonic() + self.submit_timeout_s
        pause = RESUBMIT_FIRST_S
        while await self._submit_once(req) < req.sampling.n:
            if fut.done():
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(
                    "not_taken",
                    f"no rollout worker took the call within gateway.submit_timeout_s = {self.submit_timeout_s:g} s "
                    "(every worker is late or none is running); retry later",
                )
            with self._lock:
                self.resubmissions += 1
            await asyncio.sleep(min(pause, left))
            pause = min(2 * pause, RESUBMIT_MAX_S)
        return True

    async def _submit_once(self, req: RolloutRequest) -> int:
        """Samples of ``req`` a worker took. Raises ValueError (a refused field) as it is, any
        other failure as :class:`Unavailable` ``submit_failed``."""
        try:
            return await asyncio.to_thread(self._submit, [req])
        except ValueError:
            raise
        except Exception as e:
            raise Unavailable(
                "submit_failed", f"submitting the call to the rollout workers failed: {e!r}"[:500]
            ) from None

    def _abandon(self, request_id: str) -> None:
        """Remember that ``request_id``'s result, if it ever arrives, has no caller (lock held)."""
        self._abandoned[request_id] = None
        while len(self._abandoned) > ABANDONED_KEPT:
            self._abandoned.popitem(last=False)

    def _dispatch(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                idle = not self._waiting
            if idle:
                self._has_work.wait(0.05)
                self._has_work.clear()
                continue
            try:
                got = self._poll()
            except Exception as e:  # fail the waiting calls rather than hang them
                with self._lock:
                    failed, self._waiting = self._waiting, {}
                    for rid in failed:
                        self._abandon(rid)
                err = f"polling the rollout workers failed: {e!r}"[:500]
                for loop, fut in failed.values():
                    loop.call_soon_threadsafe(_fail, fut, Unavailable("poll_failed", err))
                continue
            lost = set(self._lost())
            with self._lock:
                orphaned = [(rid, self._waiting.pop(rid)) for rid in lost if rid in self._waiting]
                for rid, _ in orphaned:  # should a copy still arrive, it is discarded as late
                    self._abandon(rid)
            for _, (loop, fut) in orphaned:
                loop.call_soon_threadsafe(_fail, fut, _WorkerLost())
            for t in got:
                with self._lock:
                    w = self._waiting.pop(t.trajectory_id, None)
                    if w is None:
                        if t.trajectory_id in self._abandoned:
                            del self._abandoned[t.trajectory_id]
                            self.late_discarded += 1
                        else:
                            self.foreign.append(t)
                if w is not None:
                    w[0].call_soon_threadsafe(_resolve, w[1], t)
            if not got:
                time.sleep(self.poll_interval_s)

    def take_foreign(self) -> list[Trajectory]:
        """Trajectories polled here that belong to no gateway call (requests submitted by others)."""
        with self._lock:
            out, self.foreign = self.foreign, []
        return out

    def close(self) -> None:
        """Stop the dispatcher thread."""
        self._stop.set()
        self._has_work.set()
        self._thread.join(timeout=5)


def _resolve(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _fail(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
