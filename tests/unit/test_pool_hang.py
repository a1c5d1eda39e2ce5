"""A hung rollout worker (samples in flight, no finished trajectory for longer than
``rollout.hang_timeout_s``): the detection rule on hand-set clocks, and the driver's accounting and
status note when the pool reports hung and dead workers (a scripted pool stands in for Ray)."""

from __future__ import annotations

from rich.console import Console

from trainer.driver.cluster.server import StatusBoard
from trainer.driver.config.schema import load_config
from trainer.driver.loop.supervision import WorkerSupervisor
from trainer.driver.publication.fingerprint_check import FingerprintCheck
from trainer.driver.sources.buffer import TrajectoryBuffer
from trainer.driver.sources.source import EnvSource
from trainer.driver.workers.pool import WORKER_DIED, WORKER_HUNG, hung_workers


def test_hung_rule_on_a_fake_clock():
    in_flight = {"a": 3, "b": 3, "c": 0, "d": 1}
    last = {"a": 85.0, "b": 95.0, "c": 0.0, "d": 90.0}
    # at 100 with 10 s: a waited 15 s (hung), b 5 s, c is idle, d exactly 10 s (not more than the limit)
    assert hung_workers(in_flight, last, now=100.0, timeout_s=10.0) == ["a"]
    assert hung_workers(in_flight, last, now=100.5, timeout_s=10.0) == ["a", "d"]
    assert hung_workers(in_flight, last, now=1e6, timeout_s=None) == []  # disabled
    assert hung_workers(in_flight, last, now=1e6, timeout_s=0) == []  # disabled
    assert hung_workers({"e": 2}, {}, now=50.0, timeout_s=1.0) == []  # no progress time yet: not hung


class Pool:
    """Reports one hung and one dead worker once; scaling up always succeeds."""

    hang_timeout_s = 30.0

    def __init__(self):
        self.n, self.killed, self.starting = 1, 0, {}
        self.deaths = {"rollout-0": (8, WORKER_HUNG), "rollout-2": (3, WORKER_DIED)}

    def __len__(self):
        return self.n

    def kill_hung(self):
        self.killed += 1
        return ["rollout-0"]

    def take_deaths(self):
        d, self.deaths = self.deaths, {}
        return d

    def request(self, n):  # new workers start in the background
        self.starting = {f"rollout-{3 + i}": None for i in range(n - self.n)}
        return {}

    def admit_started(self):  # the first started; the second could not be placed in time
        joined, gave_up = sorted(self.starting)[:1], sorted(self.starting)[1:]
        self.n, self.starting = self.n + len(joined), {}
        return joined, gave_up

    def take_unverified(self):  # the joiner took no publication (none made yet): nothing to check
        return {}

    def statuses(self):
        return []


def test_hung_and_dead_workers_are_dropped_with_their_reason_and_replaced():
    cfg = load_config(None, ["rollout.num_workers=3", "rollout.max_restarts=3", "rollout.hang_timeout_s=30"])
    pool, console = Pool(), Console(quiet=True)
    buffer = TrajectoryBuffer(capacity=64, max_staleness=1)
    source = EnvSource(cfg, pool, buffer, lambda: 0)
    w = WorkerSupervisor(cfg, console, pool, source, FingerprintCheck(cfg, console, pool, None))
    buffer.note_submitted(16)
    board = StatusBoard()
    w.replace_dead(board)
    assert pool.killed == 1
    assert dict(buffer.dropped) == {"worker_hung": 8, "worker_died": 3}
    assert buffer.in_flight == 5 and buffer.accounting_ok()
    assert (w.restarts, len(pool), sorted(pool.starting)) == (2, 1, ["rollout-3", "rollout-4"])
    assert board.status().scale_note == (
        "rollout worker(s) rollout-0 hung (no finished trajectory in 30 s), rollout-2 died (11 samples lost); "
        "1 of 3 running, 2 starting, 2 of 3 restarts used"
    )
    w.admit_started(board)  # the loop's next turn: one replacement is ready, one was not placed
    assert board.status().scale_note == (
        "rollout worker(s) rollout-3 started; rollout-4 not placed and started within "
        "rollout.start_timeout_s = 300 s, given up; 2 of 3 running"
    )
    w.admit_started(board)  # nothing new: the note stays
    assert board.status().scale_note.endswith("; 2 of 3 running")
