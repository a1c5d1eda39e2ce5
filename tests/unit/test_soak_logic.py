"""The chaos soak's pure logic (benchmarks.soak_logic): the kill schedule, the ledger check over
hand-built events, the memory growth."""

import random
from pathlib import Path

import pytest

from benchmarks.soak_logic import (
    AGENT_KINDS,
    ENV_KINDS,
    dropped_delta,
    kill_schedule,
    ledger_check,
    rss_growth,
    worst_growth,
)


def test_fixed_gaps_give_kills_at_whole_multiples_each_kind_once_before_a_repeat():
    plan = kill_schedule(7, [("env", 250.0, ENV_KINDS)], every=(60, 60), max_kills=10)
    assert [k.at_s for k in plan] == [60.0, 120.0, 180.0]  # 240 is within the 60 s tail of 250
    assert len({k.kind for k in plan}) == 3  # no kind twice from one bag
    plan = kill_schedule(7, [("env", 400.0, ENV_KINDS)], every=(50, 50), max_kills=10)
    kinds = [k.kind for k in plan]
    assert [k.at_s for k in plan] == [50.0, 100.0, 150.0, 200.0, 250.0, 300.0, 350.0]
    assert sorted(kinds[:4]) == sorted(ENV_KINDS) and kinds[4] in ENV_KINDS  # the bag refills after four


def test_the_schedule_is_the_seeds_gaps_and_the_count_is_shared_across_phases():
    plan = kill_schedule(3, [("env", 1e6, ENV_KINDS), ("agent", 1e6, AGENT_KINDS)], every=(40, 70), max_kills=5)
    assert [k.phase for k in plan] == ["env", "env", "env", "agent", "agent"]  # 5 = 3 + 2
    rng = random.Random(3)  # the same draws by hand: gap, shuffle of a fresh bag, gap, gap
    t1 = rng.uniform(40, 70)
    bag = list(ENV_KINDS)
    rng.shuffle(bag)
    t2 = t1 + rng.uniform(40, 70)
    assert plan[0].at_s == round(t1, 3) and plan[0].kind == bag[-1]
    assert plan[1].at_s == round(t2, 3) and plan[1].kind == bag[-2]
    assert all(40 <= b.at_s - a.at_s <= 70 for a, b in zip(plan[:3], plan[1:3], strict=False))
    assert kill_schedule(3, [("env", 1e6, ENV_KINDS)], (40, 70), 4) == kill_schedule(
        3, [("env", 1e6, ENV_KINDS)], (40, 70), 4
    )
    assert kill_schedule(3, [("env", 1e6, ENV_KINDS)], (40, 70), 4) != kill_schedule(
        4, [("env", 1e6, ENV_KINDS)], (40, 70), 4
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every": (70, 40)}, r"kill_every: expected 0 < lo <= hi, finite, got \[70, 40\]"),
        ({"every": (0, 40)}, "kill_every"),
        ({"every": (10,)}, r"kill_every: expected two numbers \(lo hi\), got \[10\]"),
        ({"max_kills": -1}, "max_kills: expected >= 0, got -1"),
        ({"phases": [("env", 100.0, ("learner", "gpu"))]}, r"phases\[0\].kinds: expected some of"),
        ({"phases": [("env", float("nan"), ENV_KINDS)]}, r"phases\[0\].duration_s"),
    ],
)
def test_bad_schedule_input_is_refused_naming_the_field(kwargs, message):
    args = {"seed": 0, "phases": [("env", 100.0, ENV_KINDS)], "every": (10, 20), "max_kills": 3, **kwargs}
    with pytest.raises(ValueError, match=message):
        kill_schedule(**args)


FP = {0: "00000000000000a0", 1: "00000000000000a1", 2: "00000000000000a2"}


def buffered(seg, ids, stamps):
    return {"segment": seg, "version": 0, "event": "buffered", "ids": ids, "stamps": stamps}


def events_over_a_resume():
    """Segment 0: a, b (v0) and c (v1) arrive, a consumed, d dropped stale, checkpoint v1 keeps b, c;
    e arrives (v1) and b is consumed after the checkpoint, then the learner dies. Segment 1 resumes
    from v1 (e is rolled back), republishes v1, trains b and c, f arrives at v2 and stays buffered."""
    return [
        {"segment": 0, "version": 1, "event": "published", "published": 1, "fingerprint": FP[1], "ids": []},
        buffered(0, ["a"], [[0, FP[0]]]),
        buffered(0, ["b"], [[0, FP[0]]]),
        buffered(0, ["c"], [[1, FP[1]]]),
        {"segment": 0, "version": 1, "event": "consumed", "ids": ["a"]},
        {"segment": 0, "version": 1, "event": "dropped", "reason": "stale", "ids": ["d"]},
        {"segment": 0, "version": 1, "event": "checkpoint", "tag": "v1", "ids": ["b", "c"]},
        buffered(0, ["e"], [[1, FP[1]]]),
        {"segment": 0, "version": 1, "event": "consumed", "ids": ["b"]},
        {"segment": 1, "version": 1, "event": "resumed", "tag": "v1", "ids": ["b", "c"], "lost_at_restart": 1},
        {"segment": 1, "version": 1, "event": "published", "published": 1, "fingerprint": FP[1], "ids": []},
        {"segment": 1, "version": 1, "event": "consumed", "ids": ["b", "c"]},
        {"segment": 1, "version": 2, "event": "published", "published": 2, "fingerprint": FP[2], "ids": []},
        buffered(1, ["r1.f"], [[2, FP[2]]]),
        {"segment": 1, "version": 2, "event": "checkpoint", "tag": "v2", "ids": ["r1.f"]},
    ]


def test_a_ledger_over_a_resume_closes_and_every_consumed_version_is_verified():
    summary = {
        "generated": 7,
        "consumed": 3,
        "buffered": 1,
        "in_flight": 0,
        "dropped": {"stale": 1, "lost_at_restart": 2},
    }
    got = ledger_check(events_over_a_resume(), FP[0], summary)
    assert got["closed"] is True
    assert got["ids"] == 5 and got["fates"] == {"consumed": 3, "dropped": 1, "buffered": 1}
    assert got["dropped_by_reason"] == {"stale": 1} and got["rolled_back"] == 1  # e
    assert got["fingerprints"] == {"verified": 3, "mismatch": 0, "unknown_version": 0, "no_fingerprint": 0}
    assert got["summary_checks"] == {
        "consumed": [3, 3],
        "buffered": [1, 1],
        "identity": True,
        "id_drops_within_counts": True,
    }


def test_a_twice_consumed_id_a_lost_id_and_a_wrong_fingerprint_each_open_the_ledger():
    ev = events_over_a_resume()
    ev.append({"segment": 1, "version": 2, "event": "consumed", "ids": ["c"]})
    assert ledger_check(ev, FP[0])["multiple"] == ["c"] and not ledger_check(ev, FP[0])["closed"]
    ev = events_over_a_resume()[:-1]  # the last checkpoint never lists r1.f
    got = ledger_check(ev, FP[0])
    assert got["no_fate"] == ["r1.f"] and not got["closed"]
    ev = events_over_a_resume()
    ev[2] = buffered(0, ["b"], [[0, "00000000000000ff"]])  # b was sampled by weights other than v0's
    got = ledger_check(ev, FP[0])
    assert got["fingerprints"]["mismatch"] == 1 and got["mismatched"] == [["b", 0, "00000000000000ff", FP[0]]]
    assert not got["closed"]
    got = ledger_check(events_over_a_resume(), None)  # version 0 unknown: a and b are not verified
    assert got["fingerprints"]["unknown_version"] == 2 and not got["closed"]
    summary = {
        "generated": 8,
        "consumed": 3,
        "buffered": 1,
        "in_flight": 0,
        "dropped": {"stale": 1, "lost_at_restart": 2},
    }
    assert ledger_check(events_over_a_resume(), FP[0], summary)["summary_checks"]["identity"] is False


def test_one_version_published_with_two_fingerprints_in_one_lineage_is_refused():
    ev = events_over_a_resume()
    ev[10] = {**ev[10], "fingerprint": "00000000000000ee"}
    with pytest.raises(ValueError, match="version 1 published with fingerprints"):
        ledger_check(ev, FP[0])


def test_growth_compares_the_mean_of_the_first_and_last_quarter_of_long_lived_processes():
    mib = 2**20
    samples = {
        "driver": [(0, 100 * mib), (10, 110 * mib), (50, 200 * mib), (90, 104 * mib), (100, 106 * mib)],
        "short": [(0, 50 * mib), (20, 50 * mib)],  # gone before the last quarter: left out
    }
    got = rss_growth(samples, 0.0, 100.0)  # quarters [0, 25] and [75, 100]
    assert set(got) == {"driver"}
    assert got["driver"]["first_mib"] == 105.0 and got["driver"]["last_mib"] == 105.0 and got["driver"]["growth"] == 0.0
    samples["driver"][-1] = (100, 126 * mib)  # last quarter mean 115: 115 / 105 - 1
    assert rss_growth(samples, 0.0, 100.0)["driver"]["growth"] == pytest.approx(10 / 105, abs=1e-15)
    assert worst_growth(rss_growth(samples, 0.0, 100.0)) == ("driver", pytest.approx(10 / 105))
    assert worst_growth({}) == (None, None)
    with pytest.raises(ValueError, match=r"window: expected finite t0 < t1, got \[5.0, 5.0\]"):
        rss_growth(samples, 5.0, 5.0)
    with pytest.raises(ValueError, match=r"samples\['x'\]: a time or RSS that is not finite"):
        rss_growth({"x": [(0.0, float("nan"))]}, 0.0, 1.0)


def test_dropped_delta_keeps_the_reasons_that_grew():
    assert dropped_delta({"stale": 2, "worker_died": 1}, {"stale": 2, "worker_died": 5, "lost_at_restart": 3}) == {
        "lost_at_restart": 3,
        "worker_died": 4,
    }


@pytest.mark.parametrize("phase", ["env", "agent"])
def test_each_phases_job_settings_are_accepted_by_the_config(phase, tmp_path):
    from benchmarks.bench_soak import job_overrides
    from trainer.driver.config.schema import load_config

    cfg = load_config(None, job_overrides(phase, tmp_path / phase, seed=3))
    assert (cfg.rollout.max_num_seqs, cfg.controller.seed, cfg.controller.checkpoint_every) == (16, 3, 1)
    assert cfg.controller.max_learner_restarts == 0  # a killed learner ends the job: the soak restarts it and sees that
    assert cfg.logging.run_dir == str(tmp_path / phase)
    if phase == "agent":  # outside agents (the soak's agent process) only, through the gateway
        assert (cfg.agent.path, cfg.agent.concurrency, cfg.gateway.call_timeout_s) == (None, 8, 60.0)
    else:
        assert cfg.agent is None


def test_the_soaks_set_items_come_last_and_win():
    from benchmarks.bench_soak import job_overrides, parse_args
    from trainer.driver.config.schema import load_config

    a = parse_args(["--set", 'controller.stale_trajectories="mask"', "--set", "controller.max_staleness=3"])
    items = job_overrides("env", Path("runs/x"), seed=0, extra=a.sets)
    assert items[-2:] == ['controller.stale_trajectories="mask"', "controller.max_staleness=3"]
    cfg = load_config(None, items)
    assert (cfg.controller.stale_trajectories, cfg.controller.max_staleness) == ("mask", 3)
