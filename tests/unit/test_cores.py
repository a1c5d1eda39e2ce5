"""Cores per part: the thread split from the core count and the settings (hand values), the config's
one-line refusals, the per-thread torch count, and the idle CPU priority of a yielding process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from modelkit.cores import ThreadPlan, available_cores, check_threads, plan_threads, torch_threads
from trainer.driver.config.schema import load_config, one_line

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "cores, kw, want",
    [
        # 2-core box, learner + worker + service = 3 processes > 2 cores: the learner takes both, the others yield
        (2, {}, ThreadPlan(2, 2, 1, 1, True)),
        # the same box without the service (route "none"): 2 processes on 2 cores, each keeps one
        (2, {"oldlogit_service": False}, ThreadPlan(2, 1, 1, 1, False)),
        # 16 cores, 1 rank, 1 worker, a service: 16 - 1 - 1 = 14 for the learner
        (16, {}, ThreadPlan(16, 14, 1, 1, False)),
        # 16 cores, 2 ranks, 4 workers, a service: (16 - 4 - 1) // 2 = 5 per rank
        (16, {"learner_ranks": 2, "rollout_workers": 4}, ThreadPlan(16, 5, 1, 1, False)),
        # 16 cores, 2 workers of 3 threads, a service of 2: (16 - 6 - 2) = 8
        (16, {"rollout": 3, "oldlogit": 2, "rollout_workers": 2}, ThreadPlan(16, 8, 3, 2, False)),
        # 2 cores, 2 ranks: yield (4 processes), 2 // 2 = 1 per rank
        (2, {"learner_ranks": 2}, ThreadPlan(2, 1, 1, 1, True)),
        # 1 core: yield, the learner gets the one core
        (1, {}, ThreadPlan(1, 1, 1, 1, True)),
        # the old policy on the small box, set explicitly: one thread each, nobody yields
        (2, {"learner": 1, "yield_to_learner": False}, ThreadPlan(2, 1, 1, 1, False)),
        # threads without yielding, on the small box: learner 2 - 1 - 1 = 0 -> at least 1
        (2, {"yield_to_learner": False}, ThreadPlan(2, 1, 1, 1, False)),
        # yielding asked for on a large box: the learner takes every core
        (8, {"yield_to_learner": True}, ThreadPlan(8, 8, 1, 1, True)),
        # no rollout workers (agents only through a gateway with none started): 1 + 0 + 1 = 2 on 2 cores
        (2, {"rollout_workers": 0}, ThreadPlan(2, 1, 1, 1, False)),
    ],
)
def test_plan_threads_hand_values(cores, kw, want):
    assert plan_threads(cores, **kw) == want


@pytest.mark.parametrize(
    "cores, kw, message",
    [
        (2, {"learner": 3}, "learner.threads: 3 threads > machine.cores = 2"),
        (4, {"rollout": 5}, "rollout.threads: 5 threads > machine.cores = 4"),
        (2, {"oldlogit": 0}, 'oldlogit.threads: must be "auto" or a whole number >= 1, got 0'),
        (0, {}, "machine.cores: must be >= 1, got 0"),
    ],
)
def test_plan_threads_refusals_name_the_setting(cores, kw, message):
    with pytest.raises(ValueError) as e:
        plan_threads(cores, **kw)
    assert str(e.value) == message


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "two", None])
def test_check_threads_refuses_in_one_line(value):
    with pytest.raises(ValueError) as e:
        check_threads("rollout.threads", value)
    assert str(e.value) == f'rollout.threads: must be "auto" or a whole number >= 1, got {value!r}'
    assert check_threads("rollout.threads", "auto") == "auto" and check_threads("rollout.threads", 3) == 3


def test_config_plan_on_the_demo_box_and_explicit_settings():
    plan = ['learner.threads="auto"', 'machine.yield_to_learner="auto"']
    cfg = load_config(REPO / "deploy/configs/demo.toml", ["machine.cores=2", *plan])
    assert cfg.thread_plan() == ThreadPlan(2, 2, 1, 1, True)
    default = load_config(REPO / "deploy/configs/demo.toml", ["machine.cores=2"])
    assert default.thread_plan() == ThreadPlan(2, 1, 1, 1, False)  # one thread each, nobody yields
    cfg = load_config(None, ["machine.cores=16", "rollout.num_workers=3", "learner.world_size=2", *plan])
    assert cfg.thread_plan() == ThreadPlan(16, 6, 1, 1, False)  # (16 - 3 - 1) // 2
    auto = load_config(None)
    assert auto.thread_plan().cores == available_cores()


@pytest.mark.parametrize(
    "override, line",
    [
        ("learner.threads=0", 'learner.threads: must be "auto" or a whole number >= 1 (got 0)'),
        ('rollout.threads="many"', "rollout.threads: must be \"auto\" or a whole number >= 1 (got 'many')"),
        ("oldlogit.threads=1.5", 'oldlogit.threads: must be "auto" or a whole number >= 1 (got 1.5)'),
        ("machine.cores=0", 'machine.cores: must be "auto" or a whole number >= 1 (got 0)'),
        ('machine.yield_to_learner="yes"', "machine.yield_to_learner: must be \"auto\", true or false (got 'yes')"),
        ("machine.bogus=1", "machine.bogus: Extra inputs are not permitted (got 1)"),
    ],
)
def test_config_refusals_are_one_line_naming_field_and_value(override, line):
    with pytest.raises(Exception) as e:
        load_config(None, [override])
    assert one_line(e.value) == line


def test_config_refuses_threads_above_the_cores():
    with pytest.raises(Exception) as e:
        load_config(None, ["machine.cores=2", "learner.threads=4"])
    assert one_line(e.value) == "learner.threads: 4 threads > machine.cores = 2"


def test_torch_threads_sets_and_restores_on_the_calling_thread():
    before = torch.get_num_threads()
    with torch_threads(2):
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads: must be >= 1, got 0"):
        with torch_threads(0):
            pass
    assert torch.get_num_threads() == before


def test_rollout_generation_thread_runs_on_its_thread_count():
    from rollout.worker import RolloutWorkerCore
    from tests.unit.test_rollout_worker import EOS, FakeChat, FakeEngine, _req

    seen: list[int] = []

    class CountingEngine(FakeEngine):
        def step(self):
            seen.append(torch.get_num_threads())
            return super().step()

    core = RolloutWorkerCore(CountingEngine([([10, 11, EOS], "stop")]), chat=FakeChat(), torch_threads=2)
    core.start()
    try:
        core.submit(_req(env=False, max_tokens=8))
        deadline = time.time() + 10
        got = []
        while not got and time.time() < deadline:
            got = core.poll()
            time.sleep(0.01)
    finally:
        core.stop()
    assert len(got) == 1 and seen == [2, 2, 2]  # three tokens, each step on 2 threads


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policy")
def test_yield_cpu_puts_every_thread_of_the_process_at_idle_priority():
    code = (
        "import os, threading\n"
        "from modelkit.cores import yield_cpu\n"
        "done = threading.Event()\n"
        "t = threading.Thread(target=done.wait); t.start()  # alive until every task is read\n"
        "n = yield_cpu()\n"
        "late = []\n"
        "u = threading.Thread(target=lambda: late.append(os.sched_getscheduler(0))); u.start(); u.join()\n"
        "tasks = []\n"
        "for x in os.listdir('/proc/self/task'):\n"
        "    try: tasks.append(os.sched_getscheduler(int(x)))\n"
        "    except ProcessLookupError: pass  # a short-lived helper thread exited after the listing\n"
        "print(n, all(p == os.SCHED_IDLE for p in tasks), late[0] == os.SCHED_IDLE)\n"
        "done.set(); t.join()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    n, every, late = out.stdout.split()
    assert int(n) >= 2 and every == "True" and late == "True"  # main + the waiting thread, and a later one
    assert threading.current_thread() is threading.main_thread()
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the test process itself is untouched


def test_learner_train_step_runs_on_its_thread_count_and_restores_it():
    from tests.unit.test_batch import traj
    from trainer.learner.core import LearnerCore
    from trainer.learner.settings import LearnerSettings

    core = LearnerCore.__new__(LearnerCore)  # the step's thread handling only: no model, no DeepSpeed
    core.settings = LearnerSettings(model_path="unused", torch_threads=2)
    core.version, core.pad_token_id = 0, 0
    seen: list[int] = []
    core.train_batch = lambda batch: seen.append(torch.get_num_threads()) or {"rows": float(batch.token_ids.shape[0])}
    before = torch.get_num_threads()
    out = core.train_step([traj("a", reward=1.0), traj("b", reward=0.0)])
    assert seen == [2] and out == {"rows": 2.0} and torch.get_num_threads() == before


def test_shared_box_warning_only_when_busy_and_the_plan_assumes_the_cores():
    from modelkit.cores import shared_box_warning

    plan = ThreadPlan(2, 2, 1, 1, True)
    assert shared_box_warning(plan, 0.3) is None and shared_box_warning(plan, 0.99) is None
    assert shared_box_warning(plan, 14.0) == (
        "machine: load average 14.0 on 2 cores before the job starts: other work shares them, and the thread "
        "plan (learner 2 threads, yield_to_learner true) assumes the cores are the job's; on a shared box set "
        "learner.threads=1 and machine.yield_to_learner=false"
    )
    assert shared_box_warning(ThreadPlan(2, 1, 1, 1, False), 14.0) is None  # one thread each: nothing assumed
    assert "yield_to_learner false" in shared_box_warning(ThreadPlan(16, 14, 1, 1, False), 3.0)
