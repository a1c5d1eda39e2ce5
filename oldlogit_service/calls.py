"""Calls to the old-logit service's Ray actor that wait out its restart, and only that.

Ray restarts the service's actor (``oldlogit.max_restarts``) when its process or its node dies. Until
the new process is up, calls to it fail with ``ActorUnavailableError`` (the actor is restarting or
unreachable) or ``ActorDiedError`` (the death is known, the restart not yet scheduled, e.g. while no
node has the resources it needs), or Ray holds them queued without failing them. Every call the
driver makes to the service, and every call a rollout worker makes on the ``interrupt_sync`` route,
goes through :class:`ServiceCalls`:

* a call that fails so is submitted again after a pause, until it is answered or
  :attr:`RestartWait.timeout_s` seconds have passed since its first failure; then
  :class:`ServiceNotBack` (the run ends ``failed: old-logit service``);
* a call with no answer yet is looked at every :attr:`RestartWait.probe_s` seconds: while the actor's
  state in Ray's control store (GCS) is ``ALIVE`` the call is working and is waited for without a
  bound; once it is ``RESTARTING`` the call counts as failed then, like one that raised;
* an actor whose GCS state is ``DEAD`` will not be restarted (its ``max_restarts`` are used up, or it
  was killed for good): :class:`ServiceGone` at once instead of waiting out the bound.

A restarted service holds no version until the next publication (its constructor runs again, see
:mod:`oldlogit_service.actor`): a call submitted again is answered by it as by any service that never
held the versions asked for - their tokens are ``missing`` and the learner uses its proxy. Each call
made through here is safe to submit again: ``score``, ``score_prefixes``, ``attach_old_logprobs`` and
``status`` change nothing that matters, and republishing the newest version with the same checksum
is a no-op (``update_weights``).

Restarts are counted by the service's ``started_unix`` (a new process has a new one), read at every
:meth:`ServiceCalls.status`; a restart Ray hides entirely (a call in flight retried by
``max_task_retries`` on the new process) is counted this way too.
"""

from __future__ import annotations

import functools
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

NOT_WORKING_STATES = frozenset({"RESTARTING", "DEAD"})
"""GCS actor states in which a call without an answer is not being worked on."""


class ServiceNotBack(RuntimeError):
    """The old-logit service did not answer within the restart bound (the message names the field)."""


class ServiceGone(ServiceNotBack):
    """The service's actor is ``DEAD`` in the GCS: Ray will not restart it, nothing is waited for."""


class NoAnswer(RuntimeError):
    """A call with no answer after :attr:`RestartWait.probe_s` while its actor is not ``ALIVE``."""

    def __init__(self, probe_s: float, state: str) -> None:
        super().__init__(f"no answer after {probe_s:g} s and the actor is {state}")
        self.state = state


def actor_state(handle: Any) -> str | None:
    """The GCS state of ``handle``'s actor: ``"ALIVE"``, ``"RESTARTING"``, ``"DEAD"``,
    ``"PENDING_CREATION"`` or ``"DEPENDENCIES_UNREADY"``; None when it cannot be read.

    Read from Ray's control store directly (``ray._private.state``, which needs no dashboard).
    """
    try:
        from ray._private import state as gcs_state

        return gcs_state.actors(actor_id=handle._actor_id.hex()).get("State")
    except Exception:  # a fake handle, no connection, or another Ray version: the state is unknown
        return None


@dataclass
class RestartWait:
    """Retry rule for calls to a restarting actor, and its record.

    A call's first try waits for its answer with no time limit (in slices, with a state reader:
    below). If it fails with one of :data:`RESTART_ERRORS`, it is
    tried again after pauses of ``first_pause_s``, doubled each time up to ``max_pause_s``
    (0.5, 1, 2, 4, 8, 8, ... s), each try waiting for its answer at most until ``timeout_s`` after
    the first failure. No try starts when the pause before it would reach that bound: the last
    failure is then raised as :class:`ServiceNotBack`.

    Example (``timeout_s = 30``, every try failing at once): tries at 0, 0.5, 1.5, 3.5, 7.5, 15.5
    and 23.5 s, each retry given the seconds left until 30 (29.5, 28.5, 26.5, 22.5, 14.5, 6.5); the
    next pause (8 s) would end at 31.5 > 30, so ``ServiceNotBack`` is raised at 23.5 s after 7 tries.

    With a ``state`` reader (:func:`actor_state`), the first try waits in slices of ``probe_s``
    seconds and reads the state after each slice without an answer: ``ALIVE`` (or unknown) waits on;
    ``RESTARTING`` or ``DEAD`` makes the call count as failed at that moment. After any failure, a
    ``DEAD`` state raises :class:`ServiceGone` at once.

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
    probe_s: float = 10.0
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

    def call(self, attempt: Callable[[float | None, bool], T], state: Callable[[], str | None] | None = None) -> T:
        """``attempt(timeout, again)``'s result, retried through a restart (see the class docstring).

        ``attempt`` waits for the call's answer at most ``timeout`` seconds (None: no limit), after
        submitting it again when ``again`` is true, and raises ``ray.exceptions.GetTimeoutError``
        when the seconds pass. ``state`` reads the actor's GCS state (None: never read).

        Raises:
            ServiceGone: a try failed and ``state`` says ``DEAD``.
            ServiceNotBack: every try up to the bound failed with a restart error (or timed out);
                its message starts with :attr:`part` and names :attr:`setting` and the last error.
            Exception: any other error of ``attempt``, at once.
        """
        try:
            return self._first_try(attempt, state)
        except (*RESTART_ERRORS, NoAnswer) as e:
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
            dead = first.state == "DEAD" if isinstance(first, NoAnswer) else state is not None and state() == "DEAD"
            if dead:
                raise self._gone(first) from first
            if t0 + self.pause(1) >= deadline:
                raise first
            self.sleep(self.pause(1))
            for tried in retrying:
                with tried:
                    with self._lock:
                        self.retries += 1
                    try:
                        return attempt(deadline - self.clock(), True)
                    except RESTART_ERRORS as e:
                        if state is not None and state() == "DEAD":
                            raise self._gone(e) from e
                        raise
            raise AssertionError("unreachable: tenacity returns or raises")  # pragma: no cover
        except (*RESTART_ERRORS, NoAnswer, ray.exceptions.GetTimeoutError) as e:
            raise ServiceNotBack(
                f"{self.part}: not back within {self.setting} = {self.timeout_s:g} s after a call failed "
                f"({type(e).__name__}: {_first_line(e)})"
            ) from e
        finally:
            with self._lock:
                self._waiting -= 1
                if self._waiting == 0:
                    self.unavailable_s += self.clock() - self._since

    def _first_try(self, attempt: Callable[[float | None, bool], T], state: Callable[[], str | None] | None) -> T:
        """The call's first answer, waited for while its actor is ``ALIVE`` (or its state unknown).

        Raises:
            NoAnswer: no answer yet and the actor is ``RESTARTING`` or ``DEAD``.
        """
        if state is None:
            return attempt(None, False)
        while True:
            try:
                return attempt(self.probe_s, False)
            except ray.exceptions.GetTimeoutError:
                now = state()
                if now in NOT_WORKING_STATES:
                    raise NoAnswer(self.probe_s, now) from None

    def _gone(self, e: BaseException) -> ServiceGone:
        """The error for a call whose actor is ``DEAD`` (``e``: the failure that found it so)."""
        return ServiceGone(
            f"{self.part}: its actor is dead and Ray will not restart it (restarts used up or killed "
            f"for good; {type(e).__name__}: {_first_line(e)})"
        )


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else ""


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
    ``read_state(handle)`` reads the actor's GCS state (default :func:`actor_state`; None: never read).
    """

    def __init__(
        self, handle: Any, wait: RestartWait, read_state: Callable[[Any], str | None] | None = actor_state
    ) -> None:
        self.handle = handle
        self.wait = wait
        self.read_state = read_state
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
            ServiceNotBack: the service did not answer within the bound (:class:`ServiceGone`: its
                actor is dead for good).
        """

        def attempt(timeout: float | None, again: bool) -> Any:
            if again:
                pending.ref = pending.submit()
            return ray.get(pending.ref, timeout=timeout)

        state = None if self.read_state is None else functools.partial(self.read_state, self.handle)
        return self.wait.call(attempt, state)

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
