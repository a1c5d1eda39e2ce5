"""The gateway's calls over the real FastAPI app (uvicorn on 127.0.0.1, or in-process ASGI) in
front of the real :class:`WorkerBackend`, with a scripted pool and a one-id-per-character
tokenizer in place of Ray and a model: bounded waits, tool-call error feedback, and the status
counters, with hand-worked ids and times."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import time

import httpx
import openai
import pytest

from rollout.agent import TemplateChatFormat
from rollout.engine import EngineConfig
from rollout.gateway import Gateway, GatewayServer, WorkerBackend
from rollout.gateway.tools import render_messages
from tests.scripted_gateway import CharTokenizer, FakeClock, ScriptedPool, chat_format, reply
from trainer.driver.workers.pool import WorkerPool

CTX = 4096
ADMIN = "admin-token-for-tests"
TOOL = {"type": "function", "function": {"name": "get_order", "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "Where is W1?"}]
TOK = CharTokenizer()


class Served:
    """A gateway over ``submit``/``poll`` on a real uvicorn; ``kw`` go to :class:`WorkerBackend`, ``gw`` to :class:`Gateway`."""

    def __init__(self, submit, poll, gw=None, server=None, **kw):
        self.backend = WorkerBackend(submit, poll, lambda: 0, **kw)
        self.gw = Gateway(self.backend, chat_format(), CTX, admin_token=ADMIN, **(gw or {}))
        self.server = GatewayServer(self.gw, **(server or {})).start()
        self.url = self.server.url

    def post(self, s, body, timeout=10.0) -> tuple[httpx.Response, float]:
        """POST a chat call in session ``s``; returns the answer and the seconds it took."""
        t0 = time.monotonic()
        r = httpx.post(
            f"{self.url}/sessions/{s.session_id}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {s.key}"},
            timeout=timeout,
        )
        return r, time.monotonic() - t0

    def client(self, s) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/sessions/{s.session_id}/v1", api_key=s.key, max_retries=0)

    def close(self):
        self.server.stop()
        self.backend.close()


def all_late_pool() -> WorkerPool:
    """A real :class:`WorkerPool` whose two workers each have a late call: its ``submit`` sends nothing."""
    pool = WorkerPool(EngineConfig(kind="transformers", model_path="unused"), hang_timeout_s=600.0)
    for wid in ("rollout-0", "rollout-1"):
        pool.workers[wid], pool.in_flight[wid], pool._late[wid] = object(), 0, [("poll", None, 0)]
    return pool


def idle_after(count) -> bool:
    """True when the dispatcher stopped polling: ``count()`` moves by at most one (a poll under way) in 0.2 s."""
    n = count()
    time.sleep(0.2)
    return count() - n <= 1


# --- every wait bounded ----------------------------------------------------------------------------


def test_a_call_no_worker_takes_is_answered_503_within_the_bound():
    pool, attempts, polls = all_late_pool(), [], []

    def submit(reqs):
        attempts.append(1)
        return pool.submit(reqs)

    sv = Served(submit, lambda: polls.append(1) or [], submit_timeout_s=0.5)
    try:
        s = sv.gw.open_session()
        r, took = sv.post(s, {"messages": USER, "max_tokens": 8})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"] == {
            "message": "no rollout worker took the call within gateway.submit_timeout_s = 0.5 s "
            "(every worker is late or none is running); retry later",
            "type": "service_unavailable",
            "param": None,
            "code": 503,
        }
        # resubmitted after 0.05, 0.1, 0.2 s, then the 0.15 s left: answered once 0.5 s have passed
        assert 0.5 <= took < 1.5, took
        st = sv.gw.status()
        assert st.resubmissions == len(attempts) - 1 >= 2
        assert (st.errors, st.unavailable, st.calls_pending, st.calls) == ({"503": 1}, {"not_taken": 1}, 0, 0)
        assert pool.in_flight == {"rollout-0": 0, "rollout-1": 0}  # nothing was sent to a late worker
        assert sv.gw.session(s.session_id).calls == []  # a refused call records nothing
        assert idle_after(lambda: len(polls))
    finally:
        sv.close()


def test_a_call_is_resubmitted_until_a_worker_takes_it():
    pool = ScriptedPool([reply("It is W1.")], late_submits=3)  # every worker late for 3 submissions
    sv = Served(pool.submit, pool.poll, submit_timeout_s=5.0)
    try:
        s = sv.gw.open_session()
        r, took = sv.post(s, {"messages": USER, "max_tokens": 32})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "It is W1."
        # taken at the 4th submission, after pauses of 0.05 + 0.1 + 0.2 = 0.35 s
        assert 0.35 <= took < 1.35, took
        st = sv.gw.status()
        assert (pool.submits, st.resubmissions, st.calls, st.errors, st.calls_pending) == (4, 3, 1, {}, 0)
        (t,) = sv.gw.end_session(s.session_id).trajectories
        assert t.token_ids[t.prompt_len :].tolist() == reply("It is W1.")
    finally:
        sv.close()


def test_a_taken_call_without_result_times_out_leaves_the_pending_list_and_its_late_result_is_discarded():
    pool = ScriptedPool([reply("lost"), reply("Here.")], held={0})  # the first call's worker never answers
    sv = Served(pool.submit, pool.poll, call_timeout_s=0.5)
    try:
        s = sv.gw.open_session()
        r, took = sv.post(s, {"messages": USER, "max_tokens": 32})
        assert r.status_code == 503 and 0.5 <= took < 1.5, took
        assert r.json()["error"]["message"] == (
            "no result within gateway.call_timeout_s = 0.5 s (the worker holding the call may have died or hung); retry"
        )
        st = sv.gw.status()
        assert (st.unavailable, st.calls_pending, st.errors) == ({"timeout": 1}, 0, {"503": 1})
        assert idle_after(lambda: pool.polls)
        pool.release(0)  # the lost result turns up while the session's next call is served
        r, _ = sv.post(s, {"messages": USER, "max_tokens": 32})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Here."
        st = sv.gw.status()
        assert (st.late_results_discarded, st.calls, st.calls_pending) == (1, 1, 0)
        assert sv.backend.take_foreign() == []  # never handed to the training loop as someone else's
        (t,) = sv.gw.end_session(s.session_id).trajectories
        assert t.token_ids[t.prompt_len :].tolist() == reply("Here.")
    finally:
        sv.close()


def wait_taken(pool: ScriptedPool, k: int, timeout_s: float = 5.0) -> None:
    """Until the pool has taken its ``k``-th request (0-based)."""
    deadline = time.monotonic() + timeout_s
    while len(pool.taken) <= k:
        assert time.monotonic() < deadline, f"request {k} was never taken"
        time.sleep(0.01)


def test_a_call_whose_worker_is_lost_is_submitted_again_at_once_and_served():
    pool = ScriptedPool([reply("lost"), reply("Here.")], held={0})  # the first worker never answers
    sv = Served(pool.submit, pool.poll, call_timeout_s=60.0, lost=pool.lost)
    try:
        s = sv.gw.open_session()
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            answer = ex.submit(sv.post, s, {"messages": USER, "max_tokens": 32})
            wait_taken(pool, 0)
            pool.lose(0)  # its worker dies: the call is not left to wait the 60 s call timeout
            r, took = answer.result(timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Here."
        assert took < 30, took
        assert [q.request_id for q in pool.taken] == [pool.taken[0].request_id] * 2  # the same call, again
        st = sv.gw.status()
        assert (st.lost_resubmissions, st.calls, st.errors, st.unavailable, st.calls_pending) == (1, 1, {}, {}, 0)
        (t,) = sv.gw.end_session(s.session_id).trajectories
        assert t.token_ids[t.prompt_len :].tolist() == reply("Here.")
    finally:
        sv.close()


def test_a_call_whose_worker_is_lost_every_time_is_answered_503_worker_lost():
    pool = ScriptedPool([reply("lost")] * 4, held={0, 1, 2, 3})
    sv = Served(pool.submit, pool.poll, call_timeout_s=60.0, lost=pool.lost)
    try:
        s = sv.gw.open_session()
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            answer = ex.submit(sv.post, s, {"messages": USER, "max_tokens": 32})
            for k in range(4):  # the first submission and its 3 resubmissions each lose their worker
                wait_taken(pool, k)
                pool.lose(k)
            r, _ = answer.result(timeout=30)
        assert r.status_code == 503
        assert r.json()["error"]["message"] == "the rollout worker holding the call was lost 4 times; retry"
        st = sv.gw.status()
        assert (st.lost_resubmissions, st.unavailable, st.calls_pending) == (3, {"worker_lost": 1}, 0)
    finally:
        sv.close()


def test_a_call_whose_client_left_is_not_recorded_and_the_next_call_extends_the_session():
    """The client gives up on its first call after 0.3 s (its connection closes) while the worker
    still holds it; the reply the worker then samples reaches nobody: counted as abandoned, not
    stitched, not trained on. The agent repeats the call and gets "Here.": one trajectory holding
    that reply only, no split, nothing pending."""
    pool = ScriptedPool([reply("never seen"), reply("Here.")], held={0})
    sv = Served(pool.submit, pool.poll)
    try:
        s = sv.gw.open_session()
        with pytest.raises(httpx.ReadTimeout):
            sv.post(s, {"messages": USER, "max_tokens": 32}, timeout=0.3)
        pool.release(0)
        deadline = time.monotonic() + 10
        while sv.gw.status().abandoned_calls == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        r, _ = sv.post(s, {"messages": USER, "max_tokens": 32})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Here."
        st = sv.gw.status()
        assert (st.abandoned_calls, st.calls, st.splits, st.calls_pending, st.errors) == (1, 1, 0, 0, {})
        (t,) = sv.gw.end_session(s.session_id).trajectories
        assert t.token_ids[t.prompt_len :].tolist() == reply("Here.")
    finally:
        sv.close()


def test_a_failing_poll_answers_every_waiting_call_503():
    def poll():
        raise RuntimeError("late update refused")

    sv = Served(ScriptedPool([reply("x")]).submit, poll)
    try:
        r, took = sv.post(sv.gw.open_session(), {"messages": USER})
        assert r.status_code == 503 and took < 1.0
        assert r.json()["error"]["message"] == "polling the rollout workers failed: RuntimeError('late update refused')"
        st = sv.gw.status()
        assert (st.unavailable, st.calls_pending) == ({"poll_failed": 1}, 0)
    finally:
        sv.close()


def test_a_submission_that_raises_is_answered_503_naming_it():
    """The worker behind the submission died (the error a lone Ray actor raises): the call is a
    named, counted 503, not an unhandled 500, and nothing stays pending."""
    polls = []

    def submit(reqs):
        raise RuntimeError("The actor died unexpectedly before finishing this task.")

    sv = Served(submit, lambda: polls.append(1) or [])
    try:
        r, _ = sv.post(sv.gw.open_session(), {"messages": USER})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"] == {
            "message": "submitting the call to the rollout workers failed: "
            "RuntimeError('The actor died unexpectedly before finishing this task.')",
            "type": "service_unavailable",
            "param": None,
            "code": 503,
        }
        st = sv.gw.status()
        assert (st.unavailable, st.errors, st.calls_pending, st.calls) == ({"submit_failed": 1}, {"503": 1}, 0, 0)
        assert idle_after(lambda: len(polls))
    finally:
        sv.close()


# --- tool-call errors fed back -----------------------------------------------------------------------

BAD = '<tool_call>{"name": "get_order", "arguments": {"order_id": W1}}</tool_call>'  # W1 is not JSON
GOOD = '<tool_call>{"name": "get_order", "arguments": {"order_id": "W1"}}</tool_call>'
NOTE = (
    "None of the tool calls in this reply was run: tool call 1: not JSON (Expecting value at position 48). "
    'Write each call as <tool_call>{"name": <function name>, "arguments": {<arguments as JSON>}}</tool_call>.'
)  # position 48: the W of W1 in the block's JSON, counted by hand


def test_an_unparseable_tool_call_is_answered_with_a_note_the_model_reads_as_a_tool_turn():
    pool = ScriptedPool([reply(BAD), reply(GOOD)])
    sv = Served(pool.submit, pool.poll)
    try:
        s = sv.gw.open_session()
        c = sv.client(s)
        a = c.chat.completions.create(model="m", messages=USER, tools=[TOOL], max_tokens=128)
        msg = a.choices[0].message
        assert msg.content == f"{BAD}\n\n<tool_call_error>\n{NOTE}\n</tool_call_error>"
        assert msg.tool_calls is None and a.choices[0].finish_reason == "stop"
        assert a.vintage["tool_call_errors"] == ["tool call 1: not JSON (Expecting value at position 48)"]
        st = sv.gw.status()
        assert (st.tool_calls_parsed, st.unparsed_tool_calls, st.tool_call_errors) == (0, 1, 1)
        # the agent sends the reply back as returned, and one more message
        msgs = USER + [msg.model_dump(exclude_none=True), {"role": "user", "content": "Try again."}]
        b = c.chat.completions.create(model="m", messages=msgs, tools=[TOOL], max_tokens=128)
        (tc,) = b.choices[0].message.tool_calls
        assert (tc.function.name, json.loads(tc.function.arguments)) == ("get_order", {"order_id": "W1"})
        st = sv.gw.status()
        assert (st.tool_calls_parsed, st.unparsed_tool_calls, st.tool_call_errors, st.splits) == (1, 1, 1, 0)
        (t,) = sv.gw.end_session(s.session_id).trajectories
        p1 = TOK.encode(
            "<|im_start|>system\n" + render_messages(USER, [TOOL])[0]["content"] + "<|im_end|>\n"
            "<|im_start|>user\nWhere is W1?<|im_end|>\n<|im_start|>assistant\n"
        )
        # after the sampled <|im_end|>: the template's newline, the note as a tool turn, the new message
        ctx = TOK.encode(
            f"\n<|im_start|>tool\n{NOTE}<|im_end|>\n<|im_start|>user\nTry again.<|im_end|>\n<|im_start|>assistant\n"
        )
        r1, r2 = reply(BAD), reply(GOOD)
        assert t.token_ids.tolist() == p1 + r1 + ctx + r2
        assert t.loss_mask.tolist() == [0] * len(p1) + [1] * len(r1) + [0] * len(ctx) + [1] * len(r2)
        assert t.versions.tolist() == [-1] * len(p1) + [0] * len(r1) + [-1] * len(ctx) + [0] * len(r2)
        assert t.behav_logprobs[t.loss_mask == 1].tolist() == [-0.5] * (len(r1) + len(r2))  # trained as sampled
        # both ways: rendering the whole conversation gives the same ids
        assert chat_format().prompt_ids(render_messages(msgs, [TOOL])) == p1 + r1 + ctx
    finally:
        sv.close()


@pytest.mark.parametrize("feedback", [True, False])
def test_a_reply_with_a_good_and_a_bad_call(feedback):
    text = f"Checking.\n{GOOD}\n" + '<tool_call>{"name": "drop_table", "arguments": {}}</tool_call>'
    pool = ScriptedPool([reply(text)])
    sv = Served(pool.submit, pool.poll, gw={"tool_call_feedback": feedback})
    try:
        s = sv.gw.open_session()
        a = sv.client(s).chat.completions.create(model="m", messages=USER, tools=[TOOL], max_tokens=256)
        why = "tool call 2: unknown function 'drop_table' (offered: get_order)"
        assert a.vintage["tool_call_errors"] == [why]
        st = sv.gw.status()
        assert (st.tool_calls_parsed, st.unparsed_tool_calls, st.tool_call_errors) == (1, 1, int(feedback))
        msg = a.choices[0].message
        if feedback:  # all or nothing: no call of the reply is returned
            note = (
                f"None of the tool calls in this reply was run: {why}. Write each call as "
                '<tool_call>{"name": <function name>, "arguments": {<arguments as JSON>}}</tool_call>.'
            )
            assert msg.content == f"{text}\n\n<tool_call_error>\n{note}\n</tool_call_error>"
            assert (msg.tool_calls, a.choices[0].finish_reason) == (None, "stop")
        else:  # the parsed call is returned, the unknown one stays text
            assert msg.content == 'Checking.\n\n<tool_call>{"name": "drop_table", "arguments": {}}</tool_call>'
            assert [c.function.name for c in msg.tool_calls] == ["get_order"]
            assert a.choices[0].finish_reason == "tool_calls"
    finally:
        sv.close()


# --- status details ------------------------------------------------------------------------------------


def test_a_refused_session_is_counted_once():
    sv = Served(ScriptedPool([]).submit, ScriptedPool([]).poll, gw={"admission": lambda n: False})
    try:
        r = httpx.post(f"{sv.url}/v1/sessions", json={}, headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        st = sv.gw.status()
        assert (st.sessions_refused, st.errors) == (1, {"429": 1})
    finally:
        sv.close()


def test_body_limits_answer_in_the_openai_shape_and_are_counted():
    pool = ScriptedPool([])
    sv = Served(pool.submit, pool.poll, server={"max_body_bytes": 1024, "read_timeout_s": 0.5})
    try:
        h = {"Authorization": f"Bearer {ADMIN}"}
        big = httpx.post(f"{sv.url}/v1/chat/completions", content=b"x" * 2048, headers=h)
        assert big.status_code == 413 and big.json() == {
            "error": {
                "message": "request body: Content-Length 2048 > limit 1024 bytes",
                "type": "invalid_request_error",
                "param": "body",
                "code": 413,
            }
        }
        chunked = httpx.post(f"{sv.url}/v1/chat/completions", content=iter([b"y" * 600, b"y" * 600]), headers=h)
        assert chunked.status_code == 413
        assert chunked.json()["error"]["message"] == "request body: more than 1024 bytes"
        with socket.create_connection(("127.0.0.1", sv.server.port), timeout=10) as conn:
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            raw = conn.recv(4096).decode()
        assert raw.startswith("HTTP/1.1 408")
        assert json.loads(raw[raw.index("{") : raw.rindex("}") + 1])["error"] == {  # the body is chunked
            "message": "request body: nothing received for 0.5 s",
            "type": "timeout_error",
            "param": "body",
            "code": 408,
        }
        assert sv.gw.status().errors == {"413": 2, "408": 1}
    finally:
        sv.close()


def test_a_body_over_the_limit_is_read_to_its_end_so_the_client_gets_the_413():
    """A client that sends its whole 256 KiB body before it reads (as httpx does) against a 64 KiB
    limit: the refusal is sent once the body is in, so the client's send completes and it reads the
    413 (refused on the declared length at once, the server would close with the body unread and
    the connection would be reset under the client's send). Counted once."""
    pool = ScriptedPool([])
    sv = Served(pool.submit, pool.poll, server={"max_body_bytes": 64 << 10, "read_timeout_s": 5.0})
    n = 256 << 10
    try:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", sv.server.port), timeout=10) as conn:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
                head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {n}\r\n\r\n"
                for k in range(0, n, 8192):  # in chunks, a little at a time, as a slow client sends
                    conn.sendall((head.encode() if k == 0 else b"") + b"x" * 8192)
                    time.sleep(0.001)
                raw = b""
                while b"}}" not in raw:
                    got = conn.recv(4096)
                    assert got, raw
                    raw += got
            text = raw.decode()
            assert text.startswith("HTTP/1.1 413")
            assert json.loads(text[text.index("{") : text.rindex("}") + 1])["error"]["message"] == (
                f"request body: Content-Length {n} > limit {64 << 10} bytes"
            )
        assert sv.gw.status().errors == {"413": 3}
    finally:
        sv.close()


class SlowDecode(TemplateChatFormat):
    """The chat format whose decoding (the gateway's own work) takes 0.125 s on a fake clock."""

    def __init__(self, clock):
        super().__init__(CharTokenizer())
        self.clock = clock

    def decode(self, ids):
        self.clock.t += 0.125
        return super().decode(ids)


def test_overhead_is_the_gateways_own_work_and_the_wait_for_the_turn_is_reported_apart():
    clock = FakeClock()
    pool = ScriptedPool([reply("one"), reply("two")], held={0}, clock=clock, durations={0: 2.0, 1: 0.5})
    backend = WorkerBackend(pool.submit, pool.poll, lambda: 0)
    gw = Gateway(backend, SlowDecode(clock), CTX, admin_token=ADMIN, clock=clock)
    s = gw.open_session()
    body, h = {"prompt": [5, 6, 7], "max_tokens": 8}, {"Authorization": f"Bearer {s.key}"}

    async def two_calls_in_one_session():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gw.app()), base_url="http://gw") as c:
            first = asyncio.create_task(c.post("/v1/completions", json=body, headers=h))
            while not pool.taken:  # the first call holds the session's turn, generating
                await asyncio.sleep(0.01)
            second = asyncio.create_task(c.post("/v1/completions", json=body, headers=h))
            await asyncio.sleep(0.2)  # the second waits for its turn; the fake clock still reads 0
            pool.release(0)
            return await first, await second

    try:
        a, b = asyncio.run(two_calls_in_one_session())
        assert [r.json()["choices"][0]["text"] for r in (a, b)] == ["one", "two"]
        # call 1: turn at 0, generation 0 -> 2.0, decode -> 2.125: overhead 0.125, wait 0
        # call 2: arrived at 0, turn at 2.125 (wait 2.125), generation -> 2.625, decode -> 2.75: overhead 0.125
        st = gw.status()
        assert (st.calls, st.overhead_ms_mean, st.turn_wait_ms_mean) == (2, 125.0, 1062.5)
    finally:
        backend.close()
