"""avg@k, pass@k and pass^k with hand-worked values, and `vintage eval tau2` end to end on a scripted server."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from rollout.tau2_eval import pass_at_k, pass_hat_k, summarize

# 3 tasks x 4 trials: A solved 4/4, B 2/4, C 0/4.
REWARDS = {"A": [1.0, 1.0, 1.0, 1.0], "B": [1.0, 0.0, 1.0, 0.0], "C": [0.0, 0.0, 0.0, 0.0]}


def test_pass_at_k_and_pass_hat_k_single_task():
    # n = 4, c = 2: pass@2 = 1 - C(2,2)/C(4,2) = 1 - 1/6; pass^2 = C(2,2)/C(4,2) = 1/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    assert pass_hat_k(4, 2, 2) == pytest.approx(1 / 6)
    # k = 1 is the success rate; k = n is "any" / "all"
    assert pass_at_k(4, 2, 1) == pass_hat_k(4, 2, 1) == 0.5
    assert (pass_at_k(4, 1, 4), pass_hat_k(4, 3, 4), pass_hat_k(4, 4, 4)) == (1.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="successes"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="k: need 1 <= k <= n, got k=5"):
        pass_hat_k(4, 1, 5)


def test_summarize_three_tasks_four_trials():
    s = summarize(REWARDS, trials=4)
    assert s["num_tasks"] == 3 and s["tasks_incomplete"] == []
    assert s["avg@k"] == pytest.approx((1 + 0.5 + 0) / 3)  # 0.5
    assert s["pass@k"] == pytest.approx(2 / 3)  # A and B solved at least once
    assert s["pass^k"] == pytest.approx(1 / 3)  # only A solved every time
    # j = 2: A 1, B 5/6 (any) or 1/6 (all), C 0
    assert s["pass@j"][2] == pytest.approx(float(Fraction(11, 18)))
    assert s["pass^j"][2] == pytest.approx(float(Fraction(7, 18)))
    assert s["pass@j"][1] == s["pass^j"][1] == pytest.approx(0.5)


def test_summarize_leaves_out_incomplete_tasks():
    s = summarize({**REWARDS, "D": [1.0, 1.0]}, trials=4)
    assert s["tasks_incomplete"] == ["D"] and s["num_tasks"] == 3
    assert s["avg@k"] == pytest.approx(0.5)
    empty = summarize({"D": [1.0]}, trials=4)
    assert (empty["num_tasks"], empty["avg@k"], empty["pass@k"]) == (0, None, None)
    with pytest.raises(ValueError, match=r"rewards_by_task\['A'\]: 4 rewards for 2 trials"):
        summarize(REWARDS, trials=2)


def test_cli_eval_tau2_on_scripted_server(tmp_path):
    """Two mock tasks x 2 trials, solo, one episode at a time (trial-major order).

    create_task_1 gets the gold call in trial 0 and a wrong title in trial 1 (c = 1);
    update_task_1 gets the gold call both times (c = 2). So avg@2 = (1/2 + 1)/2 = 0.75,
    pass@2 = (1 + 1)/2 = 1.0, pass^2 = (0 + 1)/2 = 0.5.
    """
    from typer.testing import CliRunner

    from tests.scripted_openai import ScriptedServer
    from vintage_cli.main import app

    create = {"tool_calls": [("create_task", {"user_id": "user_1", "title": "Important Meeting"})]}
    wrong = {"tool_calls": [("create_task", {"user_id": "user_1", "title": "Meeting"})]}
    update = {"tool_calls": [("update_task_status", {"task_id": "task_1", "status": "completed"})]}
    done = {"tool_calls": [("done", {})]}
    script = [create, done, update, done, wrong, done, update, done]
    out = tmp_path / "r.json"
    with ScriptedServer({"m": script}) as s:
        args = ["eval", "tau2", "--domain", "mock", "--base-url", s.base_url, "--model", "m", "--solo"]
        args += ["--trials", "2", "--concurrency", "1", "--task-id", "create_task_1", "--task-id", "update_task_1"]
        res = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    t = report["totals"]
    assert (t["avg@k"], t["pass@k"], t["pass^k"]) == (0.75, 1.0, 0.5)
    assert [(p["task_id"], p["rewards"]) for p in report["tasks"]] == [
        ("create_task_1", [1.0, 0.0]),
        ("update_task_1", [1.0, 1.0]),
    ]
    assert report["episodes_failed"] == 0 and len(report["episodes"]) == 4


def test_cli_eval_tau2_needs_a_user_or_solo():
    from typer.testing import CliRunner

    from vintage_cli.main import app

    res = CliRunner().invoke(app, ["eval", "tau2", "--domain", "mock", "--base-url", "http://127.0.0.1:9/v1"])
    assert res.exit_code == 2 and "--solo" in res.output


def test_cli_eval_tau2_checks_tasks_before_serving_a_model(monkeypatch):
    from typer.testing import CliRunner

    import rollout.tau2_eval
    from vintage_cli.main import app

    def must_not_serve(*a, **k):
        raise AssertionError("a model server was started before the arguments were checked")

    monkeypatch.setattr(rollout.tau2_eval, "serve_model", must_not_serve)
    args = ["eval", "tau2", "--domain", "mock", "--model-path", "tiny", "--solo", "--task-id", "nope"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "task_ids: ['nope'] not in domain 'mock'" in res.output
    res = CliRunner().invoke(
        app, ["eval", "tau2", "--domain", "mock", "--model-path", "tiny", "--solo", "--trials", "0"]
    )
    assert (
        res.exit_code == 2 and "--trials" in res.output and "greater than or equal to 1" in " ".join(res.output.split())
    )


def test_cli_eval_tau2_all_episodes_failing_says_so_with_the_first_error(tmp_path):
    """Nothing listens on the agent's URL: the one episode fails over HTTP, no task is scored, the
    metrics are blank (not 0.0) and the exit code is 1."""
    from typer.testing import CliRunner

    from vintage_cli.main import app

    out = tmp_path / "r.json"
    args = ["eval", "tau2", "--domain", "mock", "--base-url", "http://127.0.0.1:9/v1", "--solo", "--trials", "1"]
    res = CliRunner().invoke(app, [*args, "--task-id", "create_task_1", "--out", str(out)])
    assert res.exit_code == 1, res.output
    assert "0 of 1 tasks scored" in res.output
    assert "1 of 1 episodes failed over HTTP and are not scored" in res.output
    assert "First error: http: ModelCallError:" in res.output and "Connection error." in res.output
    report = json.loads(out.read_text())
    assert report["totals"]["avg@k"] is None and report["episodes_failed"] == 1


def test_per_task_results_keep_task_order_and_leave_unscored_episodes_out():
    from rollout.tau2_eval import per_task_results

    tasks = [{"task_id": "b"}, {"task_id": "a"}, {"task_id": "c"}]
    episodes = [
        {"task_id": "a", "trial": 1, "reward": 0.0, "termination_reason": "max_steps"},
        {"task_id": "a", "trial": 0, "reward": 1.0, "termination_reason": "user_stop"},
        {"task_id": "a", "trial": 2, "reward": None},
        {"task_id": "b", "trial": 0, "reward": 1.0, "termination_reason": "agent_stop"},
    ]
    rows = per_task_results(tasks, episodes)
    # a: trials sorted 0, 1 (trial 2 unscored) -> rewards [1.0, 0.0], one success; c: nothing played
    assert rows == [
        {"task_id": "b", "rewards": [1.0], "successes": 1, "termination_reasons": ["agent_stop"]},
        {"task_id": "a", "rewards": [1.0, 0.0], "successes": 1, "termination_reasons": ["user_stop", "max_steps"]},
        {"task_id": "c", "rewards": [], "successes": 0, "termination_reasons": []},
    ]
