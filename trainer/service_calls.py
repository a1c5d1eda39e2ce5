"""The driver's calls to the old-logit service, waiting out a restart of its actor.

Ray restarts the service's actor (``oldlogit.max_restarts``) when its process or its node dies. Until
the new process is up, calls to it fail with ``ActorUnavailableError`` (the actor is restarting or
unreachable) or ``ActorDiedError`` (the death is known, the restart not yet scheduled, e.g. while no
node has the resources it needs). Every driver call to the service goes through
:class:`ServiceCalls`, which submits such a call again after a pause, until it is answered or
:attr:`RestartWait.timeout_s` seconds have passed since its first failure; then the run fails with
:class:`ServiceNotBack` (``failed: old-logit service``).

A restarted service holds no version until the next publication (its constructor runs again, see
:mod:`oldlogit_service.actor`): a call submitted again is answered by it as by any service that never
held the versions asked for - their tokens are ``missing`` and the learner uses its proxy. Each call
the driver makes is safe to submit again: ``score`` and ``status`` change nothing that matters,
and republishing the newest version with the same checksum is a no-op (``update_weights``).

Restarts are counted by the service's ``started_unix`` (a new process has a new one), read at every
:meth:`ServiceCalls.status`; a restart Ray hides entirely (a call in flight retried by
``max_task_retries`` on the new process) is counted this way too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import ray
import tenacity

T = TypeVar("T")

RESTART_ERRORS: tuple[type[BaseException], ...] = (
    ray.exceptions.ActorUnavailableError,
    ray.exceptions.ActorDiedError,
)
"""Failures of a call to an actor that Ray may be restarting: the call is submitted again."""


class ServiceNotBack(RuntimeError):
    """The old-logit service did not answer within the restart bound (the message names the field)."""


@dataclass
class RestartWait:
    """Retry rule for calls to a restarting actor, and its record.

    A call is first made with no time limit. If it fails with one of :data:`RESTART_ERRORS`, it is
    tried again after pauses of ``first_pause_s``, doubled each time up to ``max_pause_s``
    (0.5, 1, 2, 4, 8, 8, ... s), each try waiting for its answer at most until ``timeout_s`` after
    the first failure. No try starts when the pause before it would reach that bound: the last
    failure is then raised as :class:`ServiceNotBack`.

    Example (``timeout_s = 30``, every try failing at once): tries at 0, 0.5, 1.5, 3.5, 7.5, 15.5
    and 23.5 s, each retry given the seconds left until 30 (29.5, 28.5, 26.5, 22.5, 14.5, 6.5); the
    next pause (8 s) would end at 31.5 > 30, so ``ServiceNotBack`` is raised at 23.5 s after 7 tries.

    Attributes updated by :meth:`call` (safe from several threads): ``outages`` (calls that failed
    at least once), ``retries`` (tries after a failure), ``unavailable_s`` (``clock`` seconds during
    which at least one call was between its first failure and its answer or giving up: calls waiting
    at the same time count once).
    """

    timeout_s: float
    part: str = "old-logit service"
    setting: str = "oldlogit.restart_timeout_s"
    first_pause_s: float = 0.5
    max_pause_s: float = 8.0
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    outages: int = 0
    retries: int = 0
    unavailable_s: float = 0.0
    _waiting: int = field(default=0, repr=False)
    _since: float = field(default=0.0, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def pause(self, n: int) -> float:
        """Seconds before retry ``n`` (1-based): ``min(first_pause_s * 2 ** (n - 1), max_pause_s)``."""
        return min(self.first_pause_s * 2 ** (n - 1), self.max_pause_s)

    def call(self, attempt: Callable[[float | None], T]) -> T:
        """``attempt(timeout)``'s result, retried through a restart (see the class docstring).

        ``attempt`` gets None on the first try (wait as long as the answer takes) and the seconds
        left until the bound on a retry; it raises ``ray.exceptions.GetTimeoutError`` when they pass.

        Raises:
            ServiceNotBack: every try up to the bound failed with a restart error (or timed out);
                its message starts with :attr:`part` and names :attr:`setting` and the last error.
            Exception: any other error of ``attempt``, at once.
        """
        try:
            return attempt(None)
        except RESTART_ERRORS as e:
            first = e
        t0 = self.clock()
        deadline = t0 + self.timeout_s
        with self._lock:
            self.outages += 1
            if self._waiting == 0:
                self._since = t0
            self._waiting += 1
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type((*RESTART_ERRORS, ray.exceptions.GetTimeoutError)),
            wait=lambda rs: self.pause(rs.attempt_number + 1),
            stop=lambda rs: self.clock() + rs.upcoming_sleep >= deadline,
            sleep=self.sleep,
            reraise=True,
        )
        try:
            if t0 + self.pause(1) >= deadline:
                raise first
            self.sleep(self.pause(1))
            for tried in retrying:
                with tried:
                    with self._lock:
                        self.retries += 1
                    return attempt(deadline - self.clock())
            raise AssertionError("unreachable: tenacity returns or raises")  # pragma: no cover
        except (*RESTART_ERRORS, ray.exceptions.GetTimeoutError) as e:
            raise ServiceNotBack(
                f"{self.part}: not back within {self.setting} = {self.timeout_s:g} s after a call failed "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            ) from e
        finally:
            with self._lock:
                self._waiting -= 1
                if self._waiting == 0:
                    self.unavailable_s += self.clock() - self._since


@dataclass
class PendingCall:
    """A submitted service call: its current result reference and how to submit it again."""

    ref: ray.ObjectRef
    """The reference of the latest submission (replaced when the call is submitted again)."""
    submit: Callable[[], ray.ObjectRef]
    calls: ServiceCalls = field(repr=False)

    def result(self) -> Any:
        """The call's answer, waiting out a restart (:meth:`ServiceCalls.result`)."""
        return self.calls.result(self)


class ServiceCalls:
    """The old-logit service's actor handle with calls that wait out its restart (:class:`RestartWait`).

    ``submit(method, *args)`` returns a :class:`PendingCall` at once; ``result(pending)`` or
    ``call(method, *args)`` wait for the answer. :meth:`status` also counts restarts.
    """

    def __init__(self, handle: Any, wait: RestartWait) -> None:
        self.handle = handle
        self.wait = wait
        self.restarts = 0
        """Service processes seen after the first one (a changed ``started_unix``)."""
        self._started: float | None = None

    def submit(self, method: str, *args: Any) -> PendingCall:
        """Submit ``handle.<method>.remote(*args)``; nothing waits."""

        def again() -> ray.ObjectRef:
            return getattr(self.handle, method).remote(*args)

        return PendingCall(again(), again, self)

    def result(self, pending: PendingCall) -> Any:
        """``pending``'s answer; after a restart error the call is submitted again (``pending.ref``
        then names the new submission).

        Raises:
            ServiceNotBack: the service did not answer within the bound.
        """

        def attempt(timeout: float | None) -> Any:
            if timeout is None:
                return ray.get(pending.ref)
            pending.ref = pending.submit()
            return ray.get(pending.ref, timeout=timeout)

        return self.wait.call(attempt)

    def call(self, method: str, *args: Any) -> Any:
        """Submit ``method`` and wait for its answer (:meth:`result`)."""
        return self.result(self.submit(method, *args))

    def status(self) -> Any:
        """The service's :class:`protocol.OldLogitServiceStatus`; a new ``started_unix`` counts a restart."""
        st = self.call("status")
        if st.started_unix is not None:
            if self._started is not None and st.started_unix != self._started:
                self.restarts += 1
            self._started = st.started_unix
        return st

    def record(self) -> dict[str, float]:
        """``oldlogit_restarts``, ``oldlogit_outages`` (calls that failed at least once),
        ``oldlogit_retries`` and ``oldlogit_unavailable_s`` so far (for metrics and the summary)."""
        w = self.wait
        return {
            "oldlogit_restarts": self.restarts,
            "oldlogit_outages": w.outages,
            "oldlogit_retries": w.retries,
            "oldlogit_unavailable_s": w.unavailable_s,
        }
