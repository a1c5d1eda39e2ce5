"""Calls to the old-logit service through a restart: the retry rule (a fake clock and a fake call
raising Ray's restart errors) and the handle wrapper (a fake handle; ``ray.get`` resolves its fake
references)."""

from __future__ import annotations

import pytest
import ray

from oldlogit_service.calls import PendingCall, RestartWait, ServiceCalls, ServiceGone, ServiceNotBack
from protocol import OldLogitServiceStatus
from trainer.driver.loop.report import failed_part

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

    def attempt(timeout, again):
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

    def attempt(timeout, again):
        timeouts.append(timeout)
        if errors:
            raise errors.pop(0)
        return "answer"

    w = waiting(30.0, clock)
    assert w.call(attempt) == "answer"
    assert timeouts == [None, 29.5, 28.5] and clock.pauses == [0.5, 1.0]
    assert (w.outages, w.retries, w.unavailable_s) == (1, 2, 1.5)
    assert w.call(lambda timeout, again: "next") == "next" and (w.outages, w.retries) == (
        1,
        2,
    )  # a healthy call: no record


def test_a_retry_that_waits_out_the_bound_gives_up_with_the_timeout():
    clock = Clock()

    def attempt(timeout, again):
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

    def attempt(timeout, again):
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
        w.call(lambda timeout, again: (_ for _ in ()).throw(DIED))
    assert clock.pauses == [] and (w.outages, w.retries) == (1, 0)


TIMEOUT = ray.exceptions.GetTimeoutError("Get timed out: some object(s) not ready.")


def test_a_call_is_waited_for_while_its_actor_is_alive_and_fails_when_it_restarts():
    # slices of 10 s: no answer at 10 (ALIVE), 20 (ALIVE), 30 (RESTARTING): the call failed at 30,
    # is submitted again after 0.5 s and answered
    clock, tries = Clock(), []
    states = iter(["ALIVE", "ALIVE", "RESTARTING"])

    def attempt(timeout, again):
        tries.append((timeout, again))
        if not again:
            clock.now += timeout
            raise TIMEOUT
        return "answer"

    w = waiting(30.0, clock)
    assert w.call(attempt, lambda: next(states)) == "answer"
    assert tries == [(10.0, False), (10.0, False), (10.0, False), (29.5, True)]
    assert clock.now == 30.5 and (w.outages, w.retries, w.unavailable_s) == (1, 1, 0.5)


def test_a_call_whose_actor_state_is_unknown_is_waited_for_without_a_bound():
    clock, tries = Clock(), []

    def attempt(timeout, again):
        tries.append(timeout)
        if len(tries) < 100:
            clock.now += timeout
            raise TIMEOUT
        return "late answer"

    w = waiting(30.0, clock)
    assert w.call(attempt, lambda: None) == "late answer" and clock.now == 990.0 and w.outages == 0


def test_a_dead_actor_is_given_up_at_once():
    clock = Clock()
    w = waiting(600.0, clock)
    with pytest.raises(ServiceGone) as e:
        w.call(lambda timeout, again: (_ for _ in ()).throw(DIED), lambda: "DEAD")
    assert str(e.value).startswith(
        "old-logit service: its actor is dead and Ray will not restart it (restarts used up or killed for good; "
        "ActorDiedError: "
    )
    assert clock.pauses == [] and (w.outages, w.retries) == (1, 0) and failed_part(e.value) == "old-logit service"


def test_an_actor_found_dead_while_retrying_is_given_up_then():
    # unavailable at 0 while restarting; the retry at 0.5 finds it died for good
    clock = Clock()
    states = iter(["RESTARTING", "DEAD"])
    errors = [UNAVAILABLE, DIED]
    w = waiting(600.0, clock)
    with pytest.raises(ServiceGone, match=r"\(restarts used up or killed for good; ActorDiedError"):
        w.call(lambda timeout, again: (_ for _ in ()).throw(errors.pop(0)), lambda: next(states))
    assert clock.pauses == [0.5] and (w.outages, w.retries, w.unavailable_s) == (1, 1, 0.5)


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
    calls = ServiceCalls(handle, waiting(30.0, clock), read_state=None)
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
    calls = ServiceCalls(handle, waiting(30.0, Clock()), read_state=None)
    assert [calls.status().started_unix for _ in range(4)] == [100.0, 100.0, 250.0, 400.0]
    assert calls.restarts == 2 and calls.record()["oldlogit_outages"] == 1


def test_calls_waiting_at_the_same_time_count_their_unavailable_seconds_once():
    # call A fails at 0 and is retried at 0.5; that retry makes call B, which fails at 0.5 and is
    # answered at 1.0; A is then answered at 1.0: unavailable 0 -> 1.0 (not 1.0 + 0.5)
    clock = Clock()
    w = waiting(30.0, clock)
    b_errors = [UNAVAILABLE]

    def b(timeout, again):
        if b_errors:
            raise b_errors.pop(0)
        return "b"

    def a(timeout, again):
        if timeout is None:
            raise UNAVAILABLE
        return w.call(b) + "a"

    assert w.call(a) == "ba" and clock.now == 1.0
    assert (w.outages, w.retries, w.unavailable_s) == (2, 2, 1.0)
