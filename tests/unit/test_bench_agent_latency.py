"""The latency benchmark's arithmetic (rows, pairing, ratio, goal, table) and the calculator agent's
tool logic, on hand-worked values."""

from __future__ import annotations

import asyncio

import pytest
from openai.types.chat import ChatCompletion

from benchmarks.bench_agent_latency import compare, goal_met, run_row, table
from rollout.agents.calculator import _round, evaluate


def _row(lat: float, mode: str, s_per_step: float, tokens_per_s: float = 1.0) -> dict:
    return {"tool_latency_s": lat, "mode": mode, "s_per_step": s_per_step, "tokens_per_s": tokens_per_s}


def test_run_row_from_a_job_summary():
    summary = {
        "steps": 4,
        "loop_s": 40.0,
        "tokens_total": 320,
        "train_s_per_step": 3.0,
        "consumed": 32,
        "dropped": {},
        "gateway": {"sessions_ended": 24, "calls": 72},
    }
    r = run_row(summary, 2.0, 0)
    # 40 s / 4 steps = 10 s per step; 320 tokens / 40 s = 8 tok/s; 72 calls / 24 sessions = 3 calls each
    assert (r["mode"], r["s_per_step"], r["tokens_per_s"], r["model_calls_per_session"]) == ("sync", 10.0, 8.0, 3.0)
    assert run_row(summary, 2.0, 2)["mode"] == "async"


def test_compare_pairs_rows_per_latency_in_order_and_takes_the_ratio():
    rows = [_row(0.5, "sync", 8.0), _row(0.5, "async", 6.0), _row(2.0, "sync", 12.0), _row(2.0, "async", 5.0)]
    pairs = compare(rows)
    assert [p["tool_latency_s"] for p in pairs] == [0.5, 2.0]
    # 6 / 8 = 0.75; 5 / 12 = 0.41666...
    assert [p["async_over_sync"] for p in pairs] == pytest.approx([0.75, 5 / 12])
    assert goal_met(pairs) is True  # 0.4167 <= 0.5 at 2 s
    assert goal_met(pairs[:1]) is None  # 2 s not run
    assert goal_met(compare([_row(2.0, "sync", 10.0), _row(2.0, "async", 6.0)])) is False  # 0.6 > 0.5


def test_compare_refuses_a_latency_without_its_sync_run():
    with pytest.raises(ValueError, match=r"tool_latency_s=2.0: need one sync and one async row, got \['async'\]"):
        compare([_row(2.0, "async", 5.0)])


def test_table_shows_both_modes_and_the_ratio():
    pairs = compare([_row(2.0, "sync", 12.0, 8.0), _row(2.0, "async", 5.0, 19.2)])
    lines = table(pairs).splitlines()
    assert len(lines) == 2 and lines[0].split("|")[-1].strip() == "async/sync"
    # 5 / 12 = 0.4167 -> 0.417 at three decimals
    assert lines[1].split() == ["2.00", "|", "12.00", "8.0", "|", "5.00", "19.2", "|", "0.417"]


def test_calculator_evaluates_arithmetic_and_nothing_else():
    assert evaluate("12 + 7") == 19
    assert evaluate("(2 + 3) * 4 - 6 / 3") == 18.0  # 20 - 2.0
    assert evaluate("-3 + 1") == -2
    for expr, why in [
        ("2 ** 3", "operator Pow is not allowed"),
        ("__import__('os')", "Call is not allowed"),
        ("1 / 0", "division by zero"),
        ("'a' + 1", "constant 'a' is not a number"),
        ("1 +", "not an arithmetic expression"),
        ("1+" * 101, "longer than 200 characters"),
    ]:
        with pytest.raises(ValueError, match=why):
            evaluate(expr)


def _reply(content: str, calls: list[tuple[str, str]]) -> ChatCompletion:
    """A chat completion as the openai client parses it, with ``calls`` = ``[(id, arguments JSON)]``."""
    tool_calls = [{"id": i, "type": "function", "function": {"name": "calculator", "arguments": a}} for i, a in calls]
    return ChatCompletion.model_validate(
        {
            "id": "c",
            "object": "chat.completion",
            "created": 0,
            "model": "vintage",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls" if calls else "stop",
                    "message": {"role": "assistant", "content": content, "tool_calls": tool_calls or None},
                }
            ],
        }
    )


def test_a_round_runs_the_models_calls_or_else_the_planned_step():
    got = asyncio.run(
        _round(_reply("", [("a", '{"expression": "1 + 2"}'), ("b", '{"expression": "3 * 4"}')]), "9 + 9", 0)
    )
    assert [m["role"] for m in got] == ["assistant", "tool", "tool"]
    assert [c["id"] for c in got[0]["tool_calls"]] == ["a", "b"]
    assert [(m["tool_call_id"], m["content"]) for m in got[1:]] == [("a", "3"), ("b", "12")]  # 1+2, 3*4
    got = asyncio.run(_round(_reply("hmm", []), "5 + 6", 0))
    assert got == [{"role": "assistant", "content": "hmm"}, {"role": "user", "content": "calculator(5 + 6) = 11"}]
    got = asyncio.run(_round(_reply("", [("a", "not json")]), "5 + 6", 0))
    assert got[1]["content"] == "error: not an arithmetic expression (invalid syntax)"  # no expression: "" parsed
