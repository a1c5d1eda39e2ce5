"""The gateway load benchmark's schedule, refusal bodies and judgements, on hand-worked values."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from benchmarks.bench_gateway_load import KINDS, _shape, extra_call, named, percentile_ms, refusal_body


def test_every_third_session_makes_one_extra_call_about_ten_percent():
    """64 sessions of 3 calls: sessions 0, 3, ..., 63 (22 of them) make an extra call, k = session // 3
    = 0..21, before good call k mod 3, of kind KINDS[k mod 7]: kind 0 for k = 0, 7, 14, 21 (4), every
    other kind 3 times; 22 of 214 calls = 10.3%."""
    extras = [extra_call(i, 3) for i in range(64)]
    made = [e for e in extras if e is not None]
    assert len(made) == 22 and round(len(made) / (64 * 3 + len(made)), 3) == 0.103
    assert extra_call(9, 3) == (0, KINDS[3]) and extra_call(10, 3) is None and extra_call(63, 3) == (0, KINDS[0])
    assert Counter(kind for _, kind in made) == {KINDS[0]: 4, **{k: 3 for k in KINDS[1:]}}
    assert Counter(before for before, _ in made) == {0: 8, 1: 7, 2: 7}


def test_a_refusal_is_named_by_its_param_and_message():
    ok = {"error": {"message": "max_tokens: Input should be a valid integer", "param": "max_tokens", "code": 400}}
    assert named(400, ok)
    assert named(413, {"error": {"message": "request body: more than 1024 bytes", "param": "body", "code": 413}})
    assert not named(401, ok)  # the code differs from the status
    assert not named(400, {"error": {**ok["error"], "param": None}})
    assert not named(400, {"error": {**ok["error"], "message": "Bad Request"}})
    assert not named(400, {"detail": "Bad Request"})  # FastAPI's own shape


def test_refusal_bodies():
    url, sid, key = "http://127.0.0.1:1", "s-1", "sk-1"
    target, kw = refusal_body("body_too_large", url, sid, key, max_body=1000, context=64)
    assert target == "http://127.0.0.1:1/sessions/s-1/v1/chat/completions" and len(kw["content"]) == 1001
    # the envelope {"messages": [{"role": "user", "content": ""}]} is 47 bytes: 954 of padding
    assert json.loads(kw["content"])["messages"][0]["content"] == "x" * 954
    _, kw = refusal_body("over_context", url, sid, key, max_body=1000, context=64)
    assert kw["json"]["messages"][0]["content"] == "word " * 128
    _, kw = refusal_body("unauthorised", url, sid, key, 1000, 64)
    assert kw["headers"]["Authorization"] != f"Bearer {key}"
    target, _ = refusal_body("unknown_session", url, sid, key, 1000, 64)
    assert target == "http://127.0.0.1:1/sessions/s-0000000000000000/v1/chat/completions"
    with pytest.raises(ValueError, match="kind: 'abandoned'"):
        refusal_body("abandoned", url, sid, key, 1000, 64)


def test_percentiles_and_message_shapes():
    """Linear interpolation over [0.1, 0.2, 0.3, 0.4] s: p50 at index 1.5 = 0.25 s; p99 at index
    2.97 = 0.3 + 0.97 * 0.1 = 0.397 s."""
    assert percentile_ms([0.4, 0.1, 0.3, 0.2], 50) == pytest.approx(250.0)
    assert percentile_ms([0.4, 0.1, 0.3, 0.2], 99) == pytest.approx(397.0)
    assert percentile_ms([], 50) is None
    assert _shape("session_id: 's-12ab' does not exist") == "session_id: '...' does not exist"
    assert _shape("messages: the prompt renders to 2061 tokens") == "messages: the prompt renders to N tokens"
