"""Calls to the old-logit service through a restart: the retry rule (a fake clock and a fake call
raising Ray's restart errors) and the handle wrapper (a fake handle; ``ray.get`` resolves its fake
references)."""

from __future__ import annotations

import pytest
import ray

from protocol import OldLogitServiceStatus
from trainer.job import failed_part
from trainer.service_calls import PendingCall, RestartWait, ServiceCalls, ServiceNotBack

UNAVAILABLE = ray.exceptions.ActorUnavailableError("the actor is restarting", None)
DIED = ray.exceptions.ActorDiedError()


class Clock:
    """A fake monotonic clock; ``sleep`` advances it and records the pause."""

    def __init__(self):
        self.now, self.pauses = 0.0, []

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.pauses.append(s)
        self.now += s


def waiting(timeout_s, clock):
    return RestartWait(timeout_s, sleep=clock.sleep, clock=clock)


def test_pauses_double_from_half_a_second_up_to_eight():
    w = RestartWait(30.0)
    assert [w.pause(n) for n in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_a_service_that_never_comes_back_is_given_up_when_the_next_pause_would_pass_the_bound():
    # tries at 0, 0.5, 1.5, 3.5, 7.5, 15.5, 23.5 s; the next pause (8 s) would end at 31.5 > 30
    clock, timeouts = Clock(), []

    def attempt(timeout):
        timeouts.append(timeout)
        raise UNAVAILABLE

    w = waiting(30.0, clock)
    with pytest.raises(ServiceNotBack) as e:
        w.call(attempt)
    assert timeouts == [None, 29.5, 28.5, 26.5, 22.5, 14.5, 6.5]
    assert clock.pauses == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0] and clock.now == 23.5
    assert (w.outages, w.retries, w.unavailable_s) == (1, 6, 23.5)
    msg = str(e.value)
    assert msg.startswith(
        "old-logit service: not back within oldlogit.restart_timeout_s = 30 s after a call failed "
        "(ActorUnavailableError: The actor None is unavailable: the actor is restarting."
    )
    assert "\n" not in msg and isinstance(e.value.__cause__, ray.exceptions.ActorUnavailableError)
    assert failed_part(e.value) == "old-logit service"  # the run ends "failed: old-logit service"


def test_a_restart_that_ends_in_time_answers_the_call_submitted_again():
    clock, timeouts = Clock(), []
    errors = [DIED, UNAVAILABLE]  # death known first, then restarting

    def attempt(timeout):
        timeouts.append(timeout)
        if errors:
            raise errors.pop(0)
        return "answer"

    w = waiting(30.0, clock)
    assert w.call(attempt) == "answer"
    assert timeouts == [None, 29.5, 28.5] and clock.pauses == [0.5, 1.0]
    assert (w.outages, w.retries, w.unavailable_s) == (1, 2, 1.5)
    assert w.call(lambda timeout: "next") == "next" and (w.outages, w.retries) == (1, 2)  # a healthy call: no record


def test_a_retry_that_waits_out_the_bound_gives_up_with_the_timeout():
    clock = Clock()

    def attempt(timeout):
        if timeout is None:
            raise UNAVAILABLE
        clock.now += timeout  # ray.get waited until the bound
        raise ray.exceptions.GetTimeoutError("Get timed out: some object(s) not ready.")

    w = waiting(30.0, clock)
    with pytest.raises(ServiceNotBack, match=r"= 30 s after a call failed \(GetTimeoutError: Get timed out"):
        w.call(attempt)
    assert clock.pauses == [0.5] and clock.now == 30.0 and (w.retries, w.unavailable_s) == (1, 30.0)


def test_other_errors_are_raised_at_once():
    clock, tries = Clock(), []

    def attempt(timeout):
        tries.append(timeout)
        raise ValueError("request: bad item")

    w = waiting(30.0, clock)
    with pytest.raises(ValueError, match="request: bad item"):
        w.call(attempt)
    assert tries == [None] and clock.pauses == [] and (w.outages, w.retries) == (0, 0)


def test_a_bound_shorter_than_the_first_pause_raises_the_first_failure():
    clock = Clock()
    w = waiting(0.25, clock)
    with pytest.raises(ServiceNotBack, match=r"= 0.25 s after a call failed \(ActorDiedError"):
        w.call(lambda timeout: (_ for _ in ()).throw(DIED))
    assert clock.pauses == [] and (w.outages, w.retries) == (1, 0)


class Handle:
    """A fake actor handle: ``<method>.remote(*args)`` returns a reference ``ray.get`` resolves by
    popping the next outcome queued for the method (an exception is raised)."""

    def __init__(self, outcomes):
        self.outcomes, self.submitted = outcomes, []

    def __getattr__(self, method):
        handle = self

        class Method:
            @staticmethod
            def remote(*args):
                handle.submitted.append((method, args))
                return ("ref", len(handle.submitted), method)

        return Method


@pytest.fixture
def fake_get(monkeypatch):
    def install(handle):
        def get(ref, timeout=None):
            out = handle.outcomes[ref[2]].pop(0)
            if isinstance(out, BaseException):
                raise out
            return out

        monkeypatch.setattr(ray, "get", get)

    return install


def test_a_pending_call_is_submitted_again_and_names_its_new_reference(fake_get):
    handle = Handle({"score": [UNAVAILABLE, UNAVAILABLE, "answer"]})
    fake_get(handle)
    clock = Clock()
    calls = ServiceCalls(handle, waiting(30.0, clock))
    pending = calls.submit("score", "req")
    assert isinstance(pending, PendingCall) and pending.ref == ("ref", 1, "score")
    assert pending.result() == "answer"
    assert handle.submitted == [("score", ("req",))] * 3 and pending.ref == ("ref", 3, "score")
    rec = calls.record()
    assert rec == {"oldlogit_restarts": 0, "oldlogit_outages": 1, "oldlogit_retries": 2, "oldlogit_unavailable_s": 1.5}


def test_status_counts_a_new_service_process_as_a_restart(fake_get):
    def st(started):
        return OldLogitServiceStatus(route="snapshot", started_unix=started)

    # 100 -> 100 (same process) -> 250 (restarted) -> unavailable, then 400 (restarted again)
    handle = Handle({"status": [st(100.0), st(100.0), st(250.0), UNAVAILABLE, st(400.0)]})
    fake_get(handle)
    calls = ServiceCalls(handle, waiting(30.0, Clock()))
    assert [calls.status().started_unix for _ in range(4)] == [100.0, 100.0, 250.0, 400.0]
    assert calls.restarts == 2 and calls.record()["oldlogit_outages"] == 1


def test_calls_waiting_at_the_same_time_count_their_unavailable_seconds_once():
    # call A fails at 0 and is retried at 0.5; that retry makes call B, which fails at 0.5 and is
    # answered at 1.0; A is then answered at 1.0: unavailable 0 -> 1.0 (not 1.0 + 0.5)
    clock = Clock()
    w = waiting(30.0, clock)
    b_errors = [UNAVAILABLE]

    def b(timeout):
        if b_errors:
            raise b_errors.pop(0)
        return "b"

    def a(timeout):
        if timeout is None:
            raise UNAVAILABLE
        return w.call(b) + "a"

    assert w.call(a) == "ba" and clock.now == 1.0
    assert (w.outages, w.retries, w.unavailable_s) == (2, 2, 1.0)
