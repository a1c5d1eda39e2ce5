"""Agent loop and worker logic on a scripted fake engine (no model): masks, versions, resume."""

from __future__ import annotations

import threading
import time

import numpy as np
import pydantic
import pytest
import torch

from modelkit.weights import pack_weights
from protocol import EnvRef, RolloutRequest, SamplingParams
from rollout.engine import EngineConfig, EngineError, EngineRequest, GenerationEngine, StepDelta
from rollout.worker import RolloutWorkerCore

EOS = 2
SCRIPTED = "rollout.envs.scripted:ScriptedEnv"


class FakeEngine(GenerationEngine):
    """Emits scripted turns, one token per step; ``turns[i]`` is ``(tokens, reason)``.

    The script is per trajectory (engine request ids are ``<trajectory>@<n>``), and a resumed
    request continues the turn where the aborted one stopped, as a real engine continues a prefix.
    """

    def __init__(self, turns, max_model_len=64, delay=0.0):
        self.delay = delay
        self.config = EngineConfig(kind="transformers", model_path="fake", max_model_len=max_model_len)
        self.version, self.failed = 0, ""
        self.turns = turns
        self.live: dict[str, dict] = {}
        self.cursor: dict[str, tuple[int, int]] = {}
        self.prompts: list[list[int]] = []
        self.applied: list[dict] = []

    @property
    def eos_token_ids(self):
        return [EOS]

    def expected_weights(self):
        return {"w": ([2], "F32")}

    def add(self, request):
        request.validate(self.config.max_model_len)
        tid = request.request_id.split("@")[0]
        self.prompts.append(list(request.prompt_ids))
        self.live[request.request_id] = {"tid": tid, "left": request.max_tokens}
        self.cursor.setdefault(tid, (0, 0))

    def step(self):
        time.sleep(self.delay)  # a real engine takes time per step
        out = []
        for rid, st in list(self.live.items()):
            turn, pos = self.cursor[st["tid"]]
            toks, reason = self.turns[turn]
            tok = toks[pos]
            pos += 1
            st["left"] -= 1
            fin = reason if pos == len(toks) else ("length" if st["left"] == 0 else None)
            self.cursor[st["tid"]] = (turn + 1, 0) if fin else (turn, pos)
            if fin:
                del self.live[rid]
            out.append(StepDelta(rid, [tok], [-0.25 - 0.01 * self.version], fin))
        return out

    def abort(self, ids):
        for r in ids:
            self.live.pop(r, None)

    def has_unfinished(self):
        return bool(self.live)

    def _apply(self, named):
        self.applied.append(named)


class FakeChat:
    """3-token prompts, 3-token observations; appends EOS after a turn that did not sample it."""

    def prompt_ids(self, messages):
        return [100, 101, 102]

    def close_ids(self, turn_ids, finish_reason):
        return [] if turn_ids and turn_ids[-1] == EOS else [EOS]

    def observation_ids(self, messages):
        return [200, 201, 202]

    def text_ids(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return " ".join(map(str, ids))


def _req(rid="r", env=True, n=1, max_tokens=16, **kw):
    src = {"env": EnvRef(path=SCRIPTED, kwargs=kw)} if env else {"prompt_ids": [5, 6, 7]}
    return RolloutRequest(
        request_id=rid, group_id="g", sampling=SamplingParams(temperature=0.7, max_tokens=max_tokens, n=n), **src
    )


def _weights(version):
    return pack_weights([("w", torch.tensor([1.0, float(version)]))], version)


def test_multiturn_mask_and_generated_length_case7():
    """Mask [0,0,0,1,1,1,1,0,0,0,1,1,1,1,1]; generated length 9 (not the span 12)."""
    eng = FakeEngine([([10, 11, 12, EOS], "stop"), ([20, 21, 22, 23, EOS], "stop")])
    core = RolloutWorkerCore(eng, chat=FakeChat())
    core.submit(_req(turns=2))
    (t,) = core.run_until_idle()
    assert t.loss_mask.tolist() == [0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1]
    assert t.num_generated == 9
    span = t.turn_boundaries[-1][1] - t.turn_boundaries[0][0]
    assert span == 12 and t.turn_boundaries == [(3, 7), (10, 15)]
    assert t.versions.tolist() == [-1] * 3 + [0] * 4 + [-1] * 3 + [0] * 5
    assert t.reward == 1.0 and t.turn_rewards == [0.0, 1.0]
    assert t.finish_reason == "stop" and not t.truncated
    # the second turn was generated from exactly the ids of the first (token-in/token-out)
    assert eng.prompts[1] == [100, 101, 102, 10, 11, 12, EOS, 200, 201, 202]


def test_truncated_turn_gets_appended_eos_with_mask_zero():
    """Multi-turn: a length-cut turn is closed by an EOS the worker appends (mask 0)."""
    eng = FakeEngine([([10, 11, 12, 13, 14, 15], "stop"), ([20, EOS], "stop")])
    core = RolloutWorkerCore(eng, chat=FakeChat())
    core.submit(_req(turns=2, max_tokens=4))
    (t,) = core.run_until_idle()
    ids, mask = t.token_ids.tolist(), t.loss_mask.tolist()
    assert ids[3:8] == [10, 11, 12, 13, EOS] and mask[3:8] == [1, 1, 1, 1, 0]
    assert t.versions[7] == -1
    assert t.truncated and t.finish_reason == "stop"  # last turn stopped, an earlier one was cut


def test_finish_reason_passed_through_not_guessed_case9():
    """(a) stop with a non-EOS last token stays stop; (c) length with EOS last stays length."""
    eng = FakeEngine([([10, 77], "stop")])
    core = RolloutWorkerCore(eng, chat=FakeChat())
    core.submit(_req(env=False))
    (a,) = core.run_until_idle()
    assert a.finish_reason == "stop" and not a.truncated and a.token_ids[-1] == 77
    eng = FakeEngine([([10, 11, EOS, 12], "stop")])
    core = RolloutWorkerCore(eng, chat=FakeChat())
    core.submit(_req(env=False, max_tokens=3))
    (c,) = core.run_until_idle()
    assert c.token_ids[-1] == EOS and c.finish_reason == "length" and c.truncated


def test_context_budget_exhausted_counts_as_truncation():
    eng = FakeEngine([([10, 11, EOS], "stop")] * 5, max_model_len=16)
    core = RolloutWorkerCore(eng, chat=FakeChat())
    core.submit(_req(turns=5))
    (t,) = core.run_until_idle()
    assert t.truncated and t.finish_reason == "length" and t.info["context_exhausted"]
    assert len(t.token_ids) == 16 and t.info["turns"] == 3  # 3 | 3+3 | 3+3 | 3+1: the last turn cut by the budget


def _case5(keep: bool = False):
    """Case 5's run: a request sampled 3 tokens at version 3, then version 4 is applied (requests
    kept in the engine with ``keep``) and it runs to the end; the interrupt_sync scorer records
    ``(items, outgoing version, temperature, known)`` and answers -0.25. Returns ``(engine, core,
    trajectory, seen)``."""
    eng = FakeEngine([(list(range(10, 16)) + [EOS], "stop")])
    eng.config = eng.config.model_copy(update={"keep_requests_on_update": keep})
    seen = []

    def scorer(items, temperature, known):  # the interrupt_sync route's scorer, still at the outgoing version
        seen.append((items, eng.version, temperature, known))
        return [np.full(len(i.token_ids), -0.25) for i in items]

    core = RolloutWorkerCore(eng, chat=FakeChat(), score_prefixes=scorer)
    for v in (1, 2, 3):
        core.update_weights(*_weights(v))
    core.submit(_req(env=False, max_tokens=7))
    for _ in range(3):
        assert core.step() == 1
    assert core.update_weights(*_weights(4)) == 4
    (t,) = core.run_until_idle()
    return eng, core, t, seen


def _check_case5_trajectory(t, seen):
    """What both settings give: the boundary at output offset 3, each version's mu, one scorer call
    for the prefix of version 3 (the updates to 1, 2, 3 came before any sequence held tokens), whose
    pi_old covers the prompt and the 3 version-3 tokens (NaN after)."""
    assert t.versions[t.prompt_len :].tolist() == [3, 3, 3, 4, 4, 4, 4]
    assert t.segments() == [(3, 3), (4, 6)]  # (version, start_offset) in the full sequence
    assert t.token_ids[t.prompt_len :].tolist() == list(range(10, 16)) + [EOS]  # continued, not restarted
    np.testing.assert_allclose(t.behav_logprobs[t.prompt_len :], [-0.28] * 3 + [-0.29] * 4, atol=1e-6)
    ((items, outgoing, temperature, known),) = seen
    assert (outgoing, temperature, known, len(items)) == (3, 0.7, [None], 1)
    assert items[0].loss_mask.tolist() == [0, 0, 0, 1, 1, 1] and items[0].versions.tolist() == [-1] * 3 + [3] * 3
    np.testing.assert_array_equal(t.old_logprobs, [-0.25] * 6 + [np.nan] * 4)


def test_resume_boundary_at_exact_token_case5():
    """Abort after 3 tokens at version 3, update, resume: boundary at output offset 3; the resumed
    request is prefilled again with the prompt and the 3 tokens."""
    eng, core, t, seen = _case5()
    _check_case5_trajectory(t, seen)
    assert eng.prompts[-1] == [5, 6, 7, 10, 11, 12] and t.info["resumes"] == 1
    assert core.status().resumed_prefill_tokens == 6  # the 3 prompt tokens and the 3 sampled, again


def test_kept_requests_go_on_across_an_update_and_nothing_is_prefilled_again():
    """keep_requests_on_update: the request of case 5 goes on in the engine from its 4th token
    under version 4 (one engine request, no resume); the interrupt_sync scorer still gets the
    prefix of the outgoing version. Without it, an engine with a running request refuses weights."""
    eng = FakeEngine([(list(range(10, 16)) + [EOS], "stop")])
    eng.add(EngineRequest("x@0", [5, 6, 7], 4, 1.0))
    with pytest.raises(EngineError, match="weight update with requests running: abort them first"):
        eng.update_weights({"w": torch.zeros(2)}, 1)
    assert (eng.version, eng.failed, eng.applied) == (0, "", [])  # refused before anything was applied
    eng, core, t, seen = _case5(keep=True)
    _check_case5_trajectory(t, seen)
    assert eng.prompts == [[5, 6, 7]] and t.info["resumes"] == 0 and core.status().resumed_prefill_tokens == 0


def test_request_waiting_across_update_gets_first_token_version():
    eng = FakeEngine([([10, 11, 12, EOS], "stop")])
    core = RolloutWorkerCore(eng, chat=FakeChat(), max_num_seqs=1)
    core.submit([_req("a", env=False), _req("b", env=False)])
    core.step()
    core.update_weights(*_weights(1))
    trajs = {t.trajectory_id: t for t in core.run_until_idle()}
    assert trajs["a"].versions[3:].tolist() == [0, 1, 1, 1]
    assert trajs["b"].versions[3:].tolist() == [1, 1, 1, 1]
    assert trajs["b"].info["admitted_version"] == 0


def test_group_samples_and_unique_ids():
    eng = FakeEngine([([10, EOS], "stop")])
    core = RolloutWorkerCore(eng, chat=FakeChat())
    assert core.submit(_req("q", env=False, n=3)) == 3
    with pytest.raises(ValueError, match="already queued"):
        core.submit(_req("q", env=False, n=3))
    ids = sorted(t.trajectory_id for t in core.run_until_idle())
    assert ids == ["q/0", "q/1", "q/2"]


def test_failed_update_keeps_old_version_and_resumes():
    eng = FakeEngine([([10, 11, 12, 13, EOS], "stop")])
    core = RolloutWorkerCore(eng, chat=FakeChat())
    core.submit(_req(env=False))
    core.step()
    bad_manifest, payload = _weights(1)
    payload = {"w": torch.tensor([9.0, 9.0])}  # checksum no longer matches
    with pytest.raises(Exception, match="checksum"):
        core.update_weights(bad_manifest, payload)
    with pytest.raises(ValueError, match="not newer"):
        core.update_weights(*_weights(0))
    (t,) = core.run_until_idle()
    assert core.version == 0 and set(t.versions[3:].tolist()) == {0} and not eng.applied


def test_bad_env_path_names_request_and_path():
    eng = FakeEngine([([10, EOS], "stop")])
    core = RolloutWorkerCore(eng, chat=FakeChat())
    bad = RolloutRequest(request_id="x", group_id="g", env=EnvRef(path="rollout.envs.nope:Env"))
    with pytest.raises(ValueError, match=r"request 'x'.*rollout\.envs\.nope"):
        core.submit(bad)


def test_a_request_mapping_is_decoded_strictly_and_a_bad_one_queues_nothing():
    core = RolloutWorkerCore(FakeEngine([([10, EOS], "stop")] * 2), chat=FakeChat())
    good = _req("a", env=False).model_dump()
    with pytest.raises(pydantic.ValidationError, match=r"admitted_version\n  Input should be a valid integer.*'3'"):
        core.submit([good, dict(_req("b", env=False).model_dump(), admitted_version="3")])
    with pytest.raises(pydantic.ValidationError, match=r"sampling\.n\n  Input should be a valid integer.*True"):
        core.submit([dict(good, sampling=dict(good["sampling"], n=True))])
    with pytest.raises(TypeError, match=r"requests\[1\]: expected RolloutRequest or a mapping, got str"):
        core.submit([good, "b"])
    assert core.status().in_flight == 0  # nothing of a refused call was queued
    assert core.submit([good]) == 1


class BrokenEngine(FakeEngine):
    """An engine whose step fails and leaves it unable to serve (e.g. half-applied weights)."""

    def step(self):
        self.failed = "weights half-applied"
        raise RuntimeError("engine core died")


def test_a_worker_whose_engine_fails_reports_failed_not_running():
    core = RolloutWorkerCore(BrokenEngine([([10, EOS], "stop")]), chat=FakeChat())
    core.submit(_req(env=False))
    assert core.status().state == "running"
    core.start()
    try:
        deadline = time.monotonic() + 30
        while core.status().state != "failed":
            assert time.monotonic() < deadline, core.status()
            time.sleep(0.01)
        st = core.status()
        assert (st.state, st.errors) == ("failed", 1)  # the loop stopped at the first failure
        assert core.last_error.startswith("step failed: RuntimeError('engine core died')\nTraceback")
        assert st.last_error == core.last_error[-500:]  # the status keeps the end: the exception line
        assert st.last_error.endswith("RuntimeError: engine core died\n")
    finally:
        core.stop()


def test_background_thread_and_update_mid_generation():
    eng = FakeEngine([(list(range(10, 40)) + [EOS], "stop")], delay=0.005)
    core = RolloutWorkerCore(eng, chat=FakeChat())
    core.start()
    try:
        core.submit(_req(env=False, max_tokens=40))
        while core.status().generated_tokens < 5:
            time.sleep(0.001)
        core.update_weights(*_weights(1))
        got = []
        deadline = time.time() + 10
        while not got and time.time() < deadline:
            got = core.poll()
            time.sleep(0.01)
    finally:
        core.stop()
    (t,) = got
    v = t.versions[3:]
    assert (np.diff(v) >= 0).all() and v[0] == 0 and v[-1] == 1
    st = core.status()
    assert st.policy_version == 1 and st.in_flight == 0 and st.generated_trajectories == 1 and st.tokens_per_s > 0


def test_env_error_aborts_episode_not_worker():
    eng = FakeEngine([([10, EOS], "stop")])
    core = RolloutWorkerCore(eng, chat=FakeChat())

    class Boom:
        max_turns = 2

        def reset(self, seed):
            return [{"role": "user", "content": "x"}], {}

        def step(self, action):
            raise RuntimeError("boom")

    import rollout.envs.scripted as mod

    mod.Boom = Boom
    try:
        core.submit(RolloutRequest(request_id="b", group_id="g", env=EnvRef(path="rollout.envs.scripted:Boom")))
        (t,) = core.run_until_idle()
    finally:
        del mod.Boom
    assert t.finish_reason == "abort" and "boom" in t.info["error"] and core.status().errors == 1


def test_status_is_threadsafe_snapshot():
    eng = FakeEngine([([10, EOS], "stop")])
    core = RolloutWorkerCore(eng, chat=FakeChat())
    core.submit([_req(f"r{i}", env=False) for i in range(4)])
    th = threading.Thread(target=lambda: [None for _ in iter(core.step, -1)])
    th.start()
    core.status()
    th.join()
    assert core.status().generated_trajectories == 4 and len(core.poll()) == 4


def test_eval_samples_go_ahead_of_waiting_training_ones():
    """One sequence at a time (max_num_seqs 1): training t0 runs, t1 and t2 wait; two eval requests
    submitted after them finish right after t0, in their own order, before t1 and t2."""
    eng = FakeEngine([([10, EOS], "stop")])
    core = RolloutWorkerCore(eng, chat=FakeChat(), max_num_seqs=1)
    core.submit(_req("t0", env=False))
    core.step()  # t0 is running, one token in
    core.submit([_req("t1", env=False), _req("t2", env=False)])
    evals = [_req(f"e{i}", env=False).model_copy(update={"purpose": "eval"}) for i in range(2)]
    core.submit(evals)
    assert [t.trajectory_id for t in core.run_until_idle()] == ["t0", "e0", "e1", "t1", "t2"]
