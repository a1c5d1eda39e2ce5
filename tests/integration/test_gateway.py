"""The gateway over real HTTP on 127.0.0.1 with the official ``openai`` client, in front of the real
rollout worker (tiny model on the transformers engine). Expected ids are rendered independently
with the same chat template; masks and versions are worked out by hand from the call sizes."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoTokenizer

from modelkit.weights import pack_weights
from rollout.agent import TemplateChatFormat
from rollout.engine import EngineConfig, GenerationEngine, StepDelta, make_engine
from rollout.gateway import Gateway, GatewayServer, WorkerBackend
from rollout.gateway.tools import render_messages, render_tool_calls
from rollout.worker import RolloutWorkerCore
from trainer.driver.sources.buffer import admission_capacity

pytestmark = pytest.mark.integration
CTX = 512
ADMIN = "admin-token-for-tests"


@pytest.fixture(scope="module")
def chat(tiny_model_path):
    return TemplateChatFormat(AutoTokenizer.from_pretrained(tiny_model_path))


class Served:
    """A worker core + gateway + uvicorn server; ``start=False`` leaves stepping to the test."""

    def __init__(self, engine, chat, start=True, **kw):
        self.core = RolloutWorkerCore(engine, chat=chat)
        if start:
            self.core.start()
        self.backend = WorkerBackend.over_core(self.core)
        self.gw = Gateway(self.backend, chat, CTX, admin_token=ADMIN, **kw)
        self.server = GatewayServer(self.gw).start()
        self.url = self.server.url

    def client(self, session=None, **kw) -> openai.OpenAI:
        if session is None:
            return openai.OpenAI(base_url=f"{self.url}/v1", api_key=ADMIN, max_retries=0, **kw)
        return openai.OpenAI(
            base_url=f"{self.url}/sessions/{session.session_id}/v1", api_key=session.key, max_retries=0
        )

    def close(self):
        self.server.stop()
        self.backend.close()
        self.core.stop()


@pytest.fixture(scope="module")
def served(tiny_model_path, chat):
    s = Served(make_engine(EngineConfig(kind="transformers", model_path=str(tiny_model_path), max_model_len=CTX)), chat)
    yield s
    s.close()


def test_one_call_records_prompt_sampled_ids_mu_and_versions(served, chat):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hello"}]
    s = served.gw.open_session(group_id="g1")
    r = served.client(s).chat.completions.create(model="any", messages=msgs, max_tokens=6, logprobs=True, seed=3)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 6
    (t,) = served.gw.end_session(s.session_id, reward=0.5).trajectories
    prompt = chat.prompt_ids(msgs)  # rendered independently with the same template
    n = r.usage.completion_tokens
    assert r.usage.prompt_tokens == len(prompt) and t.prompt_len == len(prompt)
    assert t.token_ids[: len(prompt)].tolist() == prompt
    assert t.loss_mask.tolist() == [0] * len(prompt) + [1] * n
    assert t.versions.tolist() == [-1] * len(prompt) + [0] * n
    assert r.choices[0].message.content == chat.decode(t.token_ids[len(prompt) :].tolist())
    np.testing.assert_allclose(t.behav_logprobs[len(prompt) :], [x.logprob for x in r.choices[0].logprobs.content])
    assert (t.reward, t.group_id, t.turn_boundaries) == (0.5, "g1", [(len(prompt), len(prompt) + n)])
    models = served.client().models.list()
    assert [m.id for m in models.data] == ["vintage"]
    # the admin key outside a session is served and never recorded
    before = served.gw.status()
    c = served.client().completions.create(model="any", prompt="one two", max_tokens=3)
    after = served.gw.status()
    assert c.usage.prompt_tokens == len(chat.text_ids("one two"))
    assert (after.untracked_calls - before.untracked_calls, after.sessions_opened - before.sessions_opened) == (1, 0)


class ScriptedEngine(GenerationEngine):
    """Samples scripted replies (one per request, in order), one token per step, mu = -0.5.

    Stands in for a model that writes tool calls, which a random tiny model never does; the
    worker, the gateway, the HTTP path and the tokenizer around it are the real ones.
    """

    def __init__(self, model_path, replies, eos):
        self.config = EngineConfig(kind="transformers", model_path=str(model_path), max_model_len=CTX)
        self.version, self.failed, self._eos = 0, "", [eos]
        self.replies, self.live = list(replies), {}

    def add(self, request):
        self._check_new(request, self.live)
        self.live[request.request_id] = [list(self.replies.pop(0)), request.max_tokens]

    def step(self):
        out = []
        for rid, st in list(self.live.items()):
            tok = st[0].pop(0)
            st[1] -= 1
            fin = "stop" if tok in self._eos else ("length" if st[1] == 0 or not st[0] else None)
            if fin:
                del self.live[rid]
            out.append(StepDelta(rid, [tok], [-0.5], fin))
        return out

    def abort(self, ids):
        for r in ids:
            self.live.pop(r, None)

    def has_unfinished(self):
        return bool(self.live)

    def _apply(self, named):
        pass


def test_multi_turn_tool_session_is_one_trajectory_with_the_right_masks(tiny_model_path, chat):
    eos = chat.tok.convert_tokens_to_ids("<|im_end|>")
    tool = {"type": "function", "function": {"name": "get_order", "parameters": {"type": "object"}}}
    call_text = render_tool_calls("", [{"function": {"name": "get_order", "arguments": {"order_id": "W1"}}}])
    r1 = chat.text_ids(call_text) + [eos]
    r2 = chat.text_ids("It is pending.") + [eos]
    sv = Served(ScriptedEngine(tiny_model_path, [r1, r2], eos), chat)
    try:
        s = sv.gw.open_session()
        client = sv.client(s)
        msgs = [{"role": "user", "content": "Where is W1?"}]
        a = client.chat.completions.create(model="m", messages=msgs, tools=[tool], max_tokens=64)
        (tc,) = a.choices[0].message.tool_calls
        assert a.choices[0].finish_reason == "tool_calls" and a.choices[0].message.content is None
        assert (tc.function.name, json.loads(tc.function.arguments)) == ("get_order", {"order_id": "W1"})
        msgs += [a.choices[0].message.model_dump(exclude_none=True)]
        msgs += [{"role": "tool", "tool_call_id": tc.id, "content": '{"status": "pending"}'}]
        b = client.chat.completions.create(model="m", messages=msgs, tools=[tool], max_tokens=64)
        assert b.choices[0].message.content == "It is pending." and b.choices[0].finish_reason == "stop"
        (t,) = sv.gw.end_session(s.session_id, reward=1.0).trajectories
        p1 = chat.prompt_ids(render_messages(msgs[:1], [tool]))
        ctx = chat.close_ids(r1, "stop") + chat.observation_ids([{"role": "tool", "content": '{"status": "pending"}'}])
        assert t.token_ids.tolist() == p1 + r1 + ctx + r2
        assert t.loss_mask.tolist() == [0] * len(p1) + [1] * len(r1) + [0] * len(ctx) + [1] * len(r2)
        # the rendering holds both ways: re-rendering the whole conversation gives the same ids
        assert chat.prompt_ids(render_messages(msgs, [tool])) == p1 + r1 + ctx
        st = sv.gw.status()
        assert (st.splits, st.unparsed_tool_calls, st.calls, st.trajectories_emitted) == (0, 0, 2, 1)
    finally:
        sv.close()


def test_call_spanning_a_weight_update_carries_both_versions(tiny_model_path, chat):
    eng = make_engine(EngineConfig(kind="transformers", model_path=str(tiny_model_path), max_model_len=CTX))
    sv = Served(eng, chat, start=False)  # the test steps the worker itself
    try:
        s = sv.gw.open_session()
        box = {}
        th = threading.Thread(
            target=lambda: box.setdefault(
                "r",
                sv.client(s).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=7, seed=1
                ),
            )
        )
        th.start()
        deadline = time.monotonic() + 30
        while sv.core.status().in_flight == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for _ in range(3):
            assert sv.core.step() == 1
        g = torch.Generator().manual_seed(0)
        w1 = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in eng.model.state_dict().items()}
        w1["lm_head.weight"] = w1["model.embed_tokens.weight"]
        sv.core.update_weights(*pack_weights(w1.items(), version=1))
        while sv.core.step() >= 0:
            pass
        th.join(30)
        r = box["r"]
        assert r.usage.completion_tokens == 7 and r.vintage["versions"] == [0, 0, 0, 1, 1, 1, 1]
        (t,) = sv.gw.end_session(s.session_id).trajectories
        assert t.versions[t.prompt_len :].tolist() == [0, 0, 0, 1, 1, 1, 1] and t.policy_version == 1
    finally:
        sv.close()


def test_template_drift_splits_the_session_and_is_counted(served):
    s = served.gw.open_session(group_id="drift")
    c = served.client(s)
    first = [{"role": "system", "content": "A"}, {"role": "user", "content": "u1"}]
    a = c.chat.completions.create(model="m", messages=first, max_tokens=3)
    before = served.gw.status().splits
    # the agent rewrote its system prompt: the rendered prompt no longer extends the previous ids
    edited = [{"role": "system", "content": "B"}, first[1], a.choices[0].message.model_dump(exclude_none=True)]
    c.chat.completions.create(model="m", messages=edited + [{"role": "user", "content": "u2"}], max_tokens=3)
    assert served.gw.status().splits - before == 1
    h = {"Authorization": f"Bearer {s.key}"}
    r = httpx.post(f"{served.url}/v1/sessions/{s.session_id}/reward", json={"rewards": [0.25, 0.5]}, headers=h)
    assert r.json() == {"id": s.session_id, "reward": 0.75}
    r = httpx.post(f"{served.url}/v1/sessions/{s.session_id}/end", json={"reward": 2.0}, headers=h)
    assert r.json() == {"id": s.session_id, "reward": 2.75, "trajectories": 2, "dropped": None, "splits": 1}
    (e,) = [x for x in served.gw.take_ended() if x.session_id == s.session_id]
    t0, t1 = e.trajectories
    assert (t0.trajectory_id, t1.trajectory_id) == (f"{s.session_id}/0", f"{s.session_id}/1")
    assert (t0.reward, t1.reward, t0.group_id, t1.group_id) == (2.75, 2.75, "drift", "drift")
    assert (t0.turn_rewards, t1.turn_rewards) == ([0.25], [0.5])  # per-call rewards stay with their call
    assert (t0.num_generated, t1.num_generated, t1.info["splits"]) == (3, 3, 1)


def test_admission_refuses_new_sessions_with_429(tiny_model_path, chat):
    admitted = {"n": 0}

    def admit(n):  # the staleness rule at version 0, max_staleness 0, batch of 2 sessions
        if admission_capacity(0, 0, 2, admitted["n"]) >= n:
            admitted["n"] += n
            return True
        return False

    eng = make_engine(EngineConfig(kind="transformers", model_path=str(tiny_model_path), max_model_len=CTX))
    sv = Served(eng, chat, admission=admit)
    try:
        h = {"Authorization": f"Bearer {ADMIN}"}
        codes = [httpx.post(f"{sv.url}/v1/sessions", headers=h, json={}) for _ in range(3)]
        assert [r.status_code for r in codes] == [200, 200, 429]
        assert codes[2].headers["Retry-After"] == "1"
        assert codes[2].json()["error"]["type"] == "rate_limit_error"
        assert httpx.post(f"{sv.url}/v1/sessions", json={}).status_code == 401  # no admin token
        body = codes[0].json()
        assert body["base_url"] == f"{sv.url}/sessions/{body['id']}/v1"
        st = sv.gw.status()
        assert (st.sessions_opened, st.sessions_refused, admitted["n"]) == (2, 1, 2)
    finally:
        sv.close()


def test_malformed_requests_name_the_field_and_record_nothing(served):
    gw = served.gw
    s, gone = gw.open_session(), gw.open_session()
    gw.end_session(gone.session_id)
    before = gw.status()
    ok = [{"role": "user", "content": "hi"}]
    c = served.client(s)
    cases = [
        (lambda: c.chat.completions.create(model="m", messages=ok, top_p=0.5), 400, "top_p"),
        (lambda: c.chat.completions.create(model="m", messages=ok, extra_body={"top_k": 5}), 400, "top_k"),
        (lambda: c.chat.completions.create(model="m", messages=ok, temperature=0), 400, "temperature"),
        (lambda: c.chat.completions.create(model="m", messages=ok, temperature=0.7), 400, "temperature"),
        (lambda: c.chat.completions.create(model="m", messages=ok, n=2), 400, "n"),
        (lambda: c.chat.completions.create(model="m", messages=[]), 400, "messages"),
        (
            lambda: c.chat.completions.create(model="m", messages=[{"role": "robot", "content": "x"}]),
            400,
            "messages[0].role",
        ),
        (
            lambda: c.chat.completions.create(
                model="m",
                messages=[
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    }
                ],
            ),
            400,
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            lambda: c.chat.completions.create(model="m", messages=[{"role": "user", "content": "word " * 600}]),
            400,
            "messages",
        ),
        (lambda: c.chat.completions.create(model="m", messages=ok, max_tokens=0), 400, "max_tokens"),
        (
            lambda: c.completions.create(model="m", prompt="x", logprobs=3, extra_body={"top_logprobs": 2}),
            400,
            "top_logprobs",
        ),
        (
            lambda: openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0).chat.completions.create(
                model="m", messages=ok
            ),
            401,
            "api_key",
        ),
        (
            lambda: openai.OpenAI(
                base_url=f"{served.url}/sessions/s-nope/v1", api_key="x", max_retries=0
            ).chat.completions.create(model="m", messages=ok),
            404,
            "session_id",
        ),
        (lambda: served.client(gone).chat.completions.create(model="m", messages=ok), 409, "session_id"),
    ]
    for call, code, param in cases:
        with pytest.raises(openai.APIStatusError) as e:
            call()
        assert (e.value.status_code, e.value.body["param"]) == (code, param), e.value.body
        assert param.split("[")[0].split(".")[0] in e.value.body["message"]
    raw = httpx.post(
        f"{served.url}/v1/chat/completions", content=b"{nope", headers={"Authorization": f"Bearer {s.key}"}
    )
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "body"
    bad_reward = httpx.post(
        f"{served.url}/v1/sessions/{s.session_id}/reward",
        json={"reward": "NaN"},
        headers={"Authorization": f"Bearer {s.key}"},
    )
    assert bad_reward.status_code == 400 and bad_reward.json()["error"]["param"] == "reward"
    after = gw.status()
    assert (after.calls, after.tokens_sampled, after.untracked_calls) == (
        before.calls,
        before.tokens_sampled,
        before.untracked_calls,
    )
    assert gw.session(s.session_id).calls == [] and gw.session(s.session_id).reward == 0.0
    assert sum(after.errors.values()) - sum(before.errors.values()) == len(cases) + 2


def test_concurrent_sessions_keep_the_accounting_identity(served):
    gw = served.gw
    gw.take_ended()
    before = gw.status()
    sessions = [gw.open_session(group_id=f"c{i // 4}") for i in range(16)]

    async def agent(i, s):
        if i in (13, 14):  # ends without calling: dropped with a reason
            return 0
        client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=s.key, max_retries=0)
        msgs = [{"role": "user", "content": f"task {i}"}]
        n = 0
        for _ in range(2):
            r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=4)
            n += r.usage.completion_tokens
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
        await client.close()
        return n

    async def main():
        return await asyncio.gather(*(agent(i, s) for i, s in enumerate(sessions)))

    sampled = asyncio.run(main())
    for i, s in enumerate(sessions[:15]):
        gw.end_session(s.session_id, reward=float(i))
    ended = gw.take_ended()
    st = gw.status()
    opened = st.sessions_opened - before.sessions_opened
    assert (opened, st.sessions_open - before.sessions_open, st.sessions_ended - before.sessions_ended) == (16, 1, 15)
    assert st.sessions_emitted - before.sessions_emitted == 13
    assert st.sessions_dropped.get("no_calls", 0) - before.sessions_dropped.get("no_calls", 0) == 2
    assert st.sessions_opened == st.sessions_open + st.sessions_ended
    assert st.sessions_ended == st.sessions_emitted + sum(st.sessions_dropped.values())
    assert len(ended) == 15 and sorted(e.dropped or "" for e in ended).count("no_calls") == 2
    by_id = {e.session_id: e for e in ended}
    for i, s in enumerate(sessions[:15]):
        e = by_id[s.session_id]
        if i in (13, 14):
            assert e.trajectories == []
            continue
        (t,) = e.trajectories
        assert (t.num_generated, len(t.turn_boundaries), t.reward, t.group_id) == (
            sampled[i],
            2,
            float(i),
            f"c{i // 4}",
        )
    assert st.calls - before.calls == 2 * 14 and st.splits == before.splits  # 14 agents called twice


def test_streaming_and_max_session_tokens(tiny_model_path, chat):
    eng = make_engine(EngineConfig(kind="transformers", model_path=str(tiny_model_path), max_model_len=CTX))
    msgs = [{"role": "user", "content": "hi"}]
    room = len(chat.prompt_ids(msgs)) + 3  # the first call may sample 3 tokens, then the session is full
    sv = Served(eng, chat, max_session_tokens=room)
    try:
        s = sv.gw.open_session()
        chunks = list(sv.client(s).chat.completions.create(model="m", messages=msgs, max_tokens=10, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 3
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
        r = sv.client(s).chat.completions.create(model="m", messages=msgs, max_tokens=10)
        assert (r.choices[0].finish_reason, r.usage.completion_tokens, r.choices[0].message.content) == (
            "length",
            0,
            "",
        )
        st = sv.gw.status()
        assert (st.truncated_sessions, st.calls, st.tokens_sampled) == (1, 2, 3)
        (t,) = sv.gw.end_session(s.session_id).trajectories
        assert (t.num_generated, len(t.token_ids), t.truncated) == (3, room, True)
        assert chat.decode(t.token_ids[room - 3 :].tolist()) == text
    finally:
        sv.close()


def test_litellm_openai_provider_works_unchanged(served, chat):
    import os

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # offline: no price-list download
    import litellm

    s = served.gw.open_session()
    msgs = [{"role": "user", "content": "hi from litellm"}]
    r = litellm.completion(
        model="openai/vintage",
        api_base=f"{served.url}/sessions/{s.session_id}/v1",
        api_key=s.key,
        messages=msgs,
        max_tokens=4,
    )
    (t,) = served.gw.end_session(s.session_id).trajectories
    assert t.token_ids[: t.prompt_len].tolist() == chat.prompt_ids(msgs)
    assert t.num_generated == r.usage.completion_tokens and r.choices[0].message.content == chat.decode(
        t.token_ids[t.prompt_len :].tolist()
    )
