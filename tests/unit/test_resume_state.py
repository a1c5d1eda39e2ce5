"""A checkpoint's finished trajectories and cursors: the buffer, the file and the env source round trip."""

import json
from collections import Counter

import numpy as np
import pytest

from protocol import Trajectory
from trainer.driver.records.ledger import Ledger, fates, lineage, read_ledger
from trainer.driver.sources.buffer import TrajectoryBuffer
from trainer.driver.sources.resume import TRAJECTORIES_FILE, read_trajectories, write_trajectories
from trainer.driver.sources.source import EnvSource


def traj(tid, versions, group="g", prompt=2):
    n = prompt + len(versions)
    return Trajectory(
        trajectory_id=tid,
        group_id=group,
        token_ids=np.arange(n),
        loss_mask=[0] * prompt + [1] * len(versions),
        behav_logprobs=[0.0] * prompt + [-0.5] * len(versions),
        versions=[-1] * prompt + list(versions),
        policy_version=max(versions),
        prompt_len=prompt,
        finish_reason="stop",
        reward=0.25,
        turn_boundaries=[(prompt, n)],
        old_logprobs=[np.nan] * prompt + [-0.25] * len(versions),
    )


def _mid_run_buffer() -> TrajectoryBuffer:
    """10 submitted: 2 consumed, 1 dropped stale, groups a (2, held: taken ahead), b and c (2 each)
    buffered, 1 in flight."""
    b = TrajectoryBuffer(capacity=8, max_staleness=1)
    b.note_submitted(10)
    for tid, v, g in [("z0", [0], "z"), ("z1", [0], "z"), ("s", [0], "s")]:
        b.offer(traj(tid, v, g))
    assert b.take(2, 1, group_size=2) is not None  # z consumed at version 1
    for tid, v, g in [("a0", [1], "a"), ("a1", [1, 2], "a"), ("b0", [2], "b"), ("b1", [2], "b")]:
        b.offer(traj(tid, v, g))
    b.drop_stale(2)  # "s" (version 0) is stale at 2
    assert [t.trajectory_id for t in b.take_ahead(2, 2, group_size=2)] == ["a0", "a1"]
    for tid in ("c0", "c1"):
        b.offer(traj(tid, [2], "c"))
    assert (b.consumed, b.held, len(b), b.in_flight, b.dropped["stale"]) == (2, 2, 4, 1, 1)
    assert b.accounting_ok()
    return b


def test_buffer_round_trip_keeps_ids_order_and_staleness_and_counts_only_in_flight_as_lost(tmp_path):
    b = _mid_run_buffer()
    state, saved = b.state_dict(), b.saved()
    write_trajectories(tmp_path, saved, [])
    state = json.loads(json.dumps(state))  # plain values, as the checkpoint's state keeps them
    back = read_trajectories(tmp_path, state["buffered_ids"], [])
    b2 = TrajectoryBuffer(capacity=8, max_staleness=1)
    b2.load_state_dict(state, back.buffered)
    # the batch taken ahead comes back first, unheld, then the FIFO
    assert [t.trajectory_id for t in back.buffered] == ["a0", "a1", "b0", "b1", "c0", "c1"]
    assert b2.held == 0 and len(b2) == 6 and b2.in_flight == 0
    b.put_back([t for t in saved if t.trajectory_id.startswith("a")])
    assert b2.staleness_histogram(3) == b.staleness_histogram(3) == {1: 4, 2: 2}
    assert b2.dropped == Counter({"stale": 1, "lost_at_restart": 1}) and b2.consumed == 2
    assert b2.submitted == 10 and b2.accounting_ok() and b2.scheduled == 8
    for t, u in zip(back.buffered, b.saved(), strict=True):  # bit for bit, NaN included
        assert t.model_dump_json() == u.model_dump_json()
    assert [t.trajectory_id for t in b2.take(2, 2, group_size=2)] == ["a0", "a1"]


def test_a_ledger_closes_by_id_over_a_resume(tmp_path):
    version = [0]
    b = TrajectoryBuffer(capacity=8, max_staleness=1)
    b.ledger = Ledger(tmp_path, 0, lambda: version[0])
    b.note_submitted(6)
    for tid in ("a", "b", "c"):
        b.offer(traj(tid, [0], tid))
    b.reject("aborted", "d")
    b.take(1, 0)  # a consumed
    b.ledger("checkpoint", b.state_dict()["buffered_ids"], tag="v0")
    state, saved = b.state_dict(), b.saved()
    b.take(1, 0)  # b consumed after the checkpoint: trained again after the resume
    b.ledger.close()
    b2 = TrajectoryBuffer(capacity=8, max_staleness=1)
    b2.ledger = Ledger(tmp_path, 1, lambda: version[0])
    b2.load_state_dict(state, saved)
    b2.ledger("resumed", [t.trajectory_id for t in saved], tag="v0", lost_at_restart=2)
    b2.note_submitted(1)
    b2.offer(traj("r1.e", [0], "e"))
    b2.take(3, 0)
    b2.ledger("checkpoint", b2.state_dict()["buffered_ids"], tag="v1")
    b2.ledger.close()
    events = read_ledger(tmp_path)
    stamps = {e["ids"][0]: e["stamps"] for e in events if e["event"] == "buffered"}
    assert stamps == {i: [[0, None]] for i in ("a", "b", "c", "r1.e")}  # [policy_version, served_fingerprint]
    assert fates(events)["b"] == ["consumed", "consumed"]  # the raw ledger holds the discarded step
    got = fates(lineage(events))
    assert got == {
        "a": ["consumed"],
        "b": ["consumed"],
        "c": ["consumed"],
        "d": ["dropped:aborted"],
        "r1.e": ["consumed"],
    }
    assert b2.accounting_ok() and b2.dropped["lost_at_restart"] == 2


def test_a_run_started_afresh_in_a_used_folder_replaces_the_earlier_runs_ledger(tmp_path):
    """A learner killed before the first checkpoint: the next start is fresh (segment 0 again) and
    samples the same ids; the lineage holds only the second run's events."""
    for consumed in (["a", "b"], ["a"]):
        b = TrajectoryBuffer(capacity=8, max_staleness=1)
        version: list[int] = []  # empty while the ledger opens (the job does not exist yet): not read then
        b.ledger = Ledger(tmp_path, 0, lambda v=version: v[0])
        version.append(0)
        b.note_submitted(2)
        b.offer(traj("a", [0], "ga"))
        b.offer(traj("b", [0], "gb"))
        b.take(len(consumed), 0, group_size=1)  # one group of one per consumed id
        b.ledger.close()
    events = read_ledger(tmp_path)
    assert [e["event"] for e in events].count("started") == 2
    assert fates(events)["a"] == ["consumed", "consumed"]  # the raw file holds both runs
    assert fates(lineage(events)) == {"a": ["consumed"], "b": []}  # b buffered, never checkpointed


def test_a_malformed_trajectories_file_is_refused_naming_the_file_and_line(tmp_path):
    saved = [traj("x", [1]), traj("y", [1])]
    path = write_trajectories(tmp_path, saved, [])
    assert path == tmp_path / TRAJECTORIES_FILE and not (tmp_path / (TRAJECTORIES_FILE + ".tmp")).exists()
    lines = path.read_text().splitlines()
    bad = json.loads(lines[2])
    bad["policy_version"] = "1"  # strict: no coercion
    cases = {
        "line 3: policy_version: Input should be a valid integer": [lines[0], lines[1], json.dumps(bad)],
        "line 3: trajectory: Invalid JSON": [lines[0], lines[1], lines[2][:40]],
        "trajectory lines": lines[:2],
        "header": ["{]", *lines[1:]],
        "the checkpoint lists 'y'": [lines[0], lines[1], lines[1]],
    }
    for needle, content in cases.items():
        path.write_text("\n".join(content) + "\n")
        with pytest.raises(ValueError) as e:
            read_trajectories(tmp_path, ["x", "y"], [])
        msg = str(e.value)
        assert "\n" not in msg and str(path) in msg, msg
        assert needle in msg, msg
    path.unlink()
    with pytest.raises(FileNotFoundError, match=TRAJECTORIES_FILE):
        read_trajectories(tmp_path, ["x", "y"], [])
    assert read_trajectories(tmp_path, [], []).buffered == []  # nothing listed: no file needed


def test_buffer_refuses_trajectories_other_than_the_checkpoint_lists():
    b = _mid_run_buffer()
    state = b.state_dict()
    with pytest.raises(ValueError, match="buffered_ids: the checkpoint lists 6 ids, 5 trajectories"):
        TrajectoryBuffer(capacity=8, max_staleness=1).load_state_dict(state, b.saved()[:5])


class _Pool:
    """Takes at most ``room`` requests per submission (the rest: every worker late)."""

    def __init__(self, room: int):
        self.room, self.requests = room, []

    def __len__(self):
        return 1

    def submit(self, reqs):
        took = reqs[: self.room]
        self.requests += took
        return sum(r.sampling.n for r in took)

    def poll(self):
        out, self.finished = getattr(self, "finished", []), []
        return out


def _source(buffer, pool, segment=0):
    from trainer.driver.config.schema import load_config

    overrides = ["env.train_seeds=5", "rollout.sampling.n=2", "controller.batch_groups=1", "controller.max_staleness=4"]
    cfg = load_config(None, ['model.path="tiny"', *overrides])
    return EnvSource(cfg, pool, buffer, lambda: 0, segment)


def test_env_source_cursor_continues_across_a_resume_and_regenerates_the_groups_in_flight():
    """Seeds 0 and 1 were taken and none of their samples came back by the checkpoint: the resumed
    source submits them again first, then goes on at seed 2. A group whose two samples were polled
    (here after the resume) is closed; one sample of two keeps it open."""
    b = TrajectoryBuffer(capacity=64, max_staleness=3)
    pool = _Pool(room=1)
    src = _source(b, pool)
    src.top_up()  # room for 5 groups, the pool takes 1: the other seeds stay for later
    src.top_up()
    assert [r.env.seed for r in pool.requests] == [0, 1]
    assert src.state().cursor == {"next_seed": 2, "in_flight_seeds": [0, 1]}
    held = [traj("h", [0], "h")]
    src._held_back = list(held)
    assert src.state().pending == held and src.state().units == len(held)
    b2 = TrajectoryBuffer(capacity=64, max_staleness=3)
    b2.load_state_dict(b.state_dict(), pending=1)
    pool2 = _Pool(room=10)
    src2 = _source(b2, pool2, segment=1)
    src2.restore(src.state().cursor, src.state().pending)
    assert b2.in_flight == 1 and b2.dropped["lost_at_restart"] == 3 and b2.accounting_ok()
    src2.top_up()
    assert [r.env.seed for r in pool2.requests] == [0, 1, 2, 3]  # the lost two again, then on
    assert all(r.request_id.startswith("r1.v0-") for r in pool2.requests)
    assert src2.state().cursor == {"next_seed": 4, "in_flight_seeds": [0, 1, 2, 3]}
    first, second = (r.group_id for r in pool2.requests[:2])
    pool2.finished = [traj("a0", [0], first), traj("a1", [0], first), traj("b0", [0], second)]
    assert [t.trajectory_id for t in src2.poll()] == ["h", "a0", "a1", "b0"]
    assert src2.state().cursor == {"next_seed": 4, "in_flight_seeds": [1, 2, 3]}
