"""Taking the next batch while the learner trains (``Job.take_ahead``): the driver collects until a
whole batch for version V+1 is in the buffer or the step ends; the batch is held, not consumed, and
returned to the buffer unconsumed when the loop stops. A scripted pool and step stand in for the
Ray workers and the learner."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
from rich.console import Console

from protocol import Trajectory
from trainer.driver.config.schema import load_config
from trainer.driver.loop.parts import Job
from trainer.driver.publication.fingerprint_check import FingerprintCheck
from trainer.driver.publication.routes import Route
from trainer.driver.sources.buffer import TrajectoryBuffer
from trainer.driver.sources.source import EnvSource


def traj(tid, group, versions):
    return Trajectory(
        trajectory_id=tid,
        group_id=group,
        token_ids=np.arange(1 + len(versions)),
        loss_mask=[0] + [1] * len(versions),
        behav_logprobs=[0.0] + [-0.5] * len(versions),
        versions=[-1, *versions],
        policy_version=max(versions),
        prompt_len=1,
        finish_reason="stop",
        reward=1.0,
    )


class Pool:
    """Answers each poll with the next scripted list (then nothing); ``workers`` rollout workers
    take every request submitted (recorded); ``submit`` returns the samples taken, as the pool's does."""

    def __init__(self, polls, workers=0):
        self.polls, self.workers, self.submitted = list(polls), workers, []

    def __len__(self):
        return self.workers

    def submit(self, reqs):
        self.submitted += reqs
        return sum(r.sampling.n for r in reqs)

    def poll(self):
        return self.polls.pop(0) if self.polls else []


class Step:
    """A learner step that reports done on its ``finish_after``-th check."""

    def __init__(self, finish_after):
        self.checks, self.finish_after = 0, finish_after

    def done(self, timeout_s):
        self.checks += 1
        return self.checks >= self.finish_after


class RecordingRoute(Route):
    """Records the consuming version each batch's answer is asked for."""

    def __init__(self):
        super().__init__()
        self.asked = []

    def async_old_logits(self, batch, version, temperature):
        self.asked.append((len(batch), version))
        return None


def job(polls, *overrides, version=3, workers=0):
    j = Job.__new__(Job)  # only the buffer, pool and route parts are needed
    j.cfg = load_config(None, ["controller.max_staleness=1", "controller.total_steps=10", *overrides])
    j.pool, j.route, j.version, j.times, j._held_back = Pool(polls, workers), RecordingRoute(), version, Counter(), []
    j.publisher = SimpleNamespace(served_version=version)
    j.buffer = TrajectoryBuffer(capacity=16, max_staleness=j.cfg.controller.max_staleness)
    j.source = EnvSource(j.cfg, j.pool, j.buffer, lambda: j.version, 0, lambda: j.admission_version)
    j.batch_size, j.group_size, j.vocab_size, j.taken_ahead, j.retaken = 4, 2, 1000, 0, 0
    j.fingerprints = FingerprintCheck(j.cfg, Console(quiet=True), j.pool, j.route)
    j.buffer.note_submitted(6)
    return j


def test_collects_until_a_whole_batch_for_the_next_version_is_buffered():
    # learner at 3, bound 1: for version 4 a group is consumable when its oldest token is >= 3
    polls = [
        [traj("a0", "a", [2, 3]), traj("a1", "a", [3])],  # group a: a0 is stale at 4 -> a incomplete
        [traj("b0", "b", [3]), traj("b1", "b", [3])],
        [traj("c0", "c", [3]), traj("c1", "c", [3])],
    ]
    j = job(polls)
    step = Step(finish_after=10)
    taken = j.take_ahead(step)
    assert [t.trajectory_id for t in taken.trajectories] == ["b0", "b1", "c0", "c1"] and taken.ahead
    assert j.route.asked == [(4, 4)]  # asked for at consuming version 4 = learner's 3 + 1
    assert step.checks == 3  # one check of the step before each of the three collects
    # held until its step starts, nothing consumed or dropped; a0, a1 stay buffered
    b = j.buffer
    assert (b.held, b.consumed, sum(b.dropped.values()), len(b)) == (4, 0, 0, 2) and b.accounting_ok()
    j.return_taken(taken)  # the loop stopped before training on it
    assert (b.held, b.consumed, len(b)) == (0, 0, 6) and b.accounting_ok()
    assert [*b._items][:4] == ["b0", "b1", "c0", "c1"]


def test_the_step_finishing_first_leaves_the_batch_to_the_new_version():
    j = job([[traj("b0", "b", [3]), traj("b1", "b", [3])]])
    assert j.take_ahead(Step(finish_after=1)) is None  # one group of two < batch of 4 when the step ended
    assert j.route.asked == [] and j.taken_ahead == 0
    assert (len(j.buffer), j.buffer.held) == (0, 0)  # nothing was collected: the step ended at the first check


def test_no_batch_ahead_when_synchronous_or_at_the_last_version():
    full = [[traj(f"{g}{i}", g, [3]) for g in "bc" for i in range(2)]]
    for overrides, version in ((["controller.max_staleness=0"], 3), ([], 9)):
        j = job(list(full), *overrides, version=version)
        assert j.take_ahead(Step(finish_after=99)) is None
        assert j.pool.polls == full  # returned at once: nothing polled


def test_admission_counts_from_the_version_the_workers_serve_and_catches_up_while_the_learner_trains():
    # batch 4 (2 groups of 2), bound 1, 6 scheduled; the learner is at 3, the workers still serve 2
    j = job([], "controller.batch_groups=2", "rollout.sampling.n=2", workers=1)
    j.publisher.served_version = 2
    assert j.admission_version == 2
    j.top_up()  # (2 + 1 + 1) * 4 - 6 = 10 places: 5 groups of 2
    assert (len(j.pool.submitted), j.buffer.scheduled) == (5, 16)
    j.publisher.served_version = 3  # the publication of 3 is applied while the learner trains on it
    assert j.take_ahead(Step(finish_after=2)) is None  # nothing finished; the step ends at the 2nd check
    assert (len(j.pool.submitted), j.buffer.scheduled) == (7, 20)  # (3 + 1 + 1) * 4 - 16 = 4 more: 2 groups
    assert {r.admitted_version for r in j.pool.submitted} == {3}  # requests carry the learner's version


def test_waiting_for_the_step_admits_the_room_the_applied_publication_opens(monkeypatch):
    """Batch 4, bound 1, 6 scheduled, learner at 3, workers at 2: the first wait admits 10 places
    (5 groups); the publication of 3 is applied at the second check: 4 more (2 groups); the step
    ends at the third check and its metrics move the version to 4."""
    import ray

    j = job([], "controller.batch_groups=2", "rollout.sampling.n=2", workers=1)
    j.publisher.served_version, j.train_steps = 2, 0

    class Applying(Step):
        def done(self, timeout_s):
            if self.checks == 1:
                j.publisher.served_version = 3
            return super().done(timeout_s)

    step = Applying(finish_after=3)
    step.refs, step.started, step.old_logits_s = [{"applied": 1, "version": 4}], 0.0, 0.0
    step.batch = type("Taken", (), {"ahead": False})()
    monkeypatch.setattr(ray, "get", lambda refs: refs)
    m = j.finish_train(step)
    assert (len(j.pool.submitted), j.buffer.scheduled, j.version, m["taken_ahead"]) == (7, 20, 4, False)


def test_loop_per_step_and_ratio_to_the_learner():
    from trainer.driver.loop.report import loop_per_step

    assert loop_per_step(90.0, 75.0, 3) == {"loop_s_per_step": 30.0, "train_s_per_step": 25.0, "loop_over_learner": 1.2}
    assert loop_per_step(0.0, 0.0, 0) == {"loop_s_per_step": None, "train_s_per_step": None, "loop_over_learner": None}


def test_a_batch_taken_ahead_gives_way_to_a_group_on_its_last_chance():
    """Bound 1, learner at 3, batch of 2 groups of 2. Ahead for version 4: a (tokens at 3) has one
    member, so b (tokens at 3) and c (at 4) are taken. The step ends and the version is 4; a1 has
    finished meanwhile: a is whole at 4 and stale at 5, c can wait, so the batch goes back and the
    take at 4 trains b (returned to the front) and a, the oldest; c waits for 5, nothing is dropped."""
    polls = [
        [traj("a0", "a", [3]), traj("b0", "b", [3]), traj("b1", "b", [3])],
        [traj("c0", "c", [4]), traj("c1", "c", [4])],
        [traj("a1", "a", [3])],  # finished after the batch was taken ahead
    ]
    j = job(polls)  # 6 submitted: a0, a1, b0, b1, c0, c1
    taken = j.take_ahead(Step(finish_after=10))
    assert [t.trajectory_id for t in taken.trajectories] == ["b0", "b1", "c0", "c1"]
    j.version = 4
    assert j.confirm_ahead(taken) is None and j.retaken == 1
    batch = j.take()
    assert [t.trajectory_id for t in batch.trajectories] == ["b0", "b1", "a0", "a1"]
    assert j.route.asked == [(4, 4), (4, 4)]  # its old logits are asked for again
    b = j.buffer
    assert ([*b._items], b.held, sum(b.dropped.values())) == (["c0", "c1"], 4, 0) and b.accounting_ok()
