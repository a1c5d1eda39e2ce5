"""The gateway's tool text format (both ways) and the session stitching rule, without a model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rollout.gateway.session import Session
from rollout.gateway.tools import (
    TOOLS_FOOTER,
    TOOLS_HEADER,
    normalized,
    parse_tool_calls,
    render_messages,
    render_tool_calls,
    split_error_note,
    tool_error_text,
    with_error_note,
)

TOOL = {"type": "function", "function": {"name": "get_order", "parameters": {"type": "object"}}}


def test_render_then_parse_gives_the_calls_back():
    calls = [
        {"id": "a", "type": "function", "function": {"name": "get_order", "arguments": '{"order_id": "W1"}'}},
        {"id": "b", "type": "function", "function": {"name": "get_order", "arguments": {"order_id": "W2"}}},
    ]
    text = render_tool_calls("Let me look.", calls)
    assert text == (
        "Let me look.\n"
        '<tool_call>\n{"name": "get_order", "arguments": {"order_id": "W1"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_order", "arguments": {"order_id": "W2"}}\n</tool_call>'
    )
    got = parse_tool_calls(text, {"get_order"}, "call_x")
    assert got.content == "Let me look." and got.unparsed == 0
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got.tool_calls] == [
        ("call_x_0", "get_order", {"order_id": "W1"}),
        ("call_x_1", "get_order", {"order_id": "W2"}),
    ]
    # and back again: rendering the parsed reply reproduces the sampled text exactly
    assert render_tool_calls(got.content, got.tool_calls) == text


def test_unparseable_calls_stay_content_and_are_counted():
    text = (
        "<tool_call>\n{not json}\n</tool_call>\n"
        '<tool_call>{"name": "drop_table", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "get_order", "arguments": "[1]"}</tool_call>\n'
        '<tool_call>{"name": "get_order", "arguments": {'
    )
    got = parse_tool_calls(text, {"get_order"})
    assert got.tool_calls == [] and got.content == text
    assert got.unparsed == 4 and got.errors == [
        "tool call 1: not JSON (Expecting property name enclosed in double quotes at position 1)",
        "tool call 2: unknown function 'drop_table' (offered: get_order)",
        "tool call 3: \"arguments\" of 'get_order' must be a JSON object, got an array",
        "tool call 4: <tool_call> is not closed by </tool_call>",
    ]
    # the other shapes a block can break, one line each; k counts parsed blocks too
    more = (
        '<tool_call>{"name": "get_order", "arguments": {}}</tool_call>'
        "<tool_call>[1, 2]</tool_call>"
        '<tool_call>{"name": 7}</tool_call>'
        '<tool_call>{"name": "get_order", "arguments": "{oops"}</tool_call>'
    )
    got = parse_tool_calls(more, {"get_order"})
    assert [c["function"]["name"] for c in got.tool_calls] == ["get_order"]
    assert got.errors == [
        'tool call 2: expected a JSON object with "name" and "arguments", got an array',
        'tool call 3: "name" must be a string, got a number',
        "tool call 4: \"arguments\" of 'get_order': not JSON (Expecting property name enclosed in double quotes at position 1)",
    ]


def test_an_error_note_round_trips_and_renders_as_a_tool_turn():
    note = tool_error_text(["tool call 1: not JSON (Expecting value at position 0)"])
    assert note == (
        "None of the tool calls in this reply was run: tool call 1: not JSON (Expecting value at position 0). "
        'Write each call as <tool_call>{"name": <function name>, "arguments": {<arguments as JSON>}}</tool_call>.'
    )
    content = with_error_note("<tool_call>x</tool_call>", note)
    assert content == f"<tool_call>x</tool_call>\n\n<tool_call_error>\n{note}\n</tool_call_error>"
    assert split_error_note(content) == ("<tool_call>x</tool_call>", note)
    assert split_error_note("plain text") == ("plain text", None)
    asst = {"role": "assistant", "content": content}
    assert render_messages([asst], None) == [
        {"role": "assistant", "content": "<tool_call>x</tool_call>"},
        {"role": "tool", "content": note},
    ]
    # only an assistant reply carries a note; the same text from the user is plain content
    assert render_messages([{"role": "user", "content": content}], None) == [{"role": "user", "content": content}]


def test_render_messages_puts_tools_in_the_system_message_and_calls_in_content():
    msgs = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Where is "}, {"type": "text", "text": "W1?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_order", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c", "content": "pending"},
    ]
    out = render_messages(msgs, [TOOL], "auto")
    assert out[0] == {
        "role": "system",
        "content": "Be brief.\n\n" + TOOLS_HEADER + json.dumps(TOOL, sort_keys=True) + TOOLS_FOOTER,
    }
    assert out[1:] == [
        {"role": "user", "content": "Where is W1?"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "get_order", "arguments": {}}\n</tool_call>'},
        {"role": "tool", "content": "pending"},
    ]
    assert render_messages(msgs[1:2], [TOOL], "none") == [{"role": "user", "content": "Where is W1?"}]
    assert render_messages(msgs[1:2], [TOOL], None)[0]["role"] == "system"  # created when absent


def test_render_messages_names_bad_fields():
    bad_args = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]
    with pytest.raises(ValueError, match=r"^messages\[0\]\.tool_calls\[0\]\.function\.arguments"):
        render_messages(bad_args, None)
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[0\]: only text parts"):
        render_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], None)


def test_normalized_ignores_call_ids_and_key_order():
    a = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": '{"a":1,"b":2}'}}],
    }
    b = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "9", "function": {"name": "f", "arguments": '{"b": 2, "a": 1}'}}],
    }
    assert normalized(a) == normalized(b)
    assert normalized({"role": "developer", "content": "x"}) == normalized({"role": "system", "content": "x"})


def test_session_stitches_extending_calls_and_splits_the_rest():
    s = Session("s", "k", "g")
    s.add_call("c0", [1, 2, 3], [10, 11], [-0.5, -0.25], [0, 0], "stop", 0)
    s.add_call("c1", [1, 2, 3, 10, 11, 4, 5], [12], [-1.0], [1], "length", 1)  # extends: 4, 5 are context
    assert s.splits == 0 and len(s.segments) == 1
    s.add_call("c2", [1, 9], [13, 14], [-0.1, -0.2], [1, 2], "stop", 2)  # drift: a new segment
    assert s.splits == 1
    s.reward, s.call_rewards = 1.0, {"c1": 0.5}
    t0, t1 = s.to_trajectories()
    assert t0.token_ids.tolist() == [1, 2, 3, 10, 11, 4, 5, 12]
    assert t0.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 1]
    assert t0.versions.tolist() == [-1, -1, -1, 0, 0, -1, -1, 1]
    np.testing.assert_allclose(t0.behav_logprobs[t0.loss_mask == 1], [-0.5, -0.25, -1.0])
    assert t0.turn_boundaries == [(3, 5), (7, 8)] and t0.turn_rewards == [0.0, 0.5]
    assert (t0.prompt_len, t0.finish_reason, t0.truncated, t0.policy_version) == (3, "length", True, 1)
    assert t1.token_ids.tolist() == [1, 9, 13, 14] and t1.loss_mask.tolist() == [0, 0, 1, 1]
    assert t1.versions.tolist() == [-1, -1, 1, 2] and t1.policy_version == 2
    assert (t0.reward, t1.reward) == (1.5, 1.5)  # segments share the session's reward
    assert (t0.trajectory_id, t1.trajectory_id, t0.group_id) == ("s/0", "s/1", "g")
    assert (t0.info["segments"], t1.info["segment"], t1.info["splits"]) == (2, 1, 1)
    with pytest.raises(ValueError, match="versions: 0 is older"):
        s.add_call("c3", [1, 9, 13, 14], [15], [-0.1], [0], "stop", 2)
    assert s.segments[1].token_ids == [1, 9, 13, 14] and len(s.calls) == 3  # the refused call left nothing
