"""OldLogitService on the tiny model, without Ray: exactness per version, mixed batches, eviction,
partial rollouts, the single-replica routes, malformed input, accounting."""

from __future__ import annotations

import numpy as np
import pydantic
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modelkit.modelhub import load_causal_lm
from modelkit.scoring import sequence_logprobs
from modelkit.weights import pack_weights
from oldlogit_service import OldLogitService, status_from_old_logprobs
from oldlogit_service.actor import restart_kwargs
from oldlogit_service.scoring import row_chunks
from oldlogit_service.service import missing_reason
from protocol import OldLogitRequest, ProtocolError, TokenStatus, Trajectory

T = 0.7
VOCAB = 49152


class Learner:
    """A stand-in learner: version v has weights base + small random steps; publishes packed weights."""

    def __init__(self, folder):
        self.model = load_causal_lm(folder)
        self.states = {0: {k: v.clone() for k, v in self.model.state_dict().items()}}

    def step_to(self, version: int) -> None:
        while max(self.states) < version:
            v = max(self.states) + 1
            g = torch.Generator().manual_seed(1000 + v)
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.02)
            self.states[v] = {k: t.clone() for k, t in self.model.state_dict().items()}

    def publish(self, svc: OldLogitService, version: int) -> None:
        self.step_to(version)
        self.model.load_state_dict(self.states[version])
        svc.update_weights(*pack_weights(self.model.state_dict().items(), version))
        self.model.load_state_dict(self.states[max(self.states)])

    @torch.no_grad()
    def logprobs(self, version: int, ids: torch.Tensor, mask: torch.Tensor, temperature: float = T) -> torch.Tensor:
        """Learner forward at ``version`` of a [batch, seq] batch (the reference)."""
        self.model.load_state_dict(self.states[version])
        out = sequence_logprobs(self.model, ids, mask, temperature)
        self.model.load_state_dict(self.states[max(self.states)])
        return out


@pytest.fixture(scope="module")
def learner(tiny_model_path):
    return Learner(tiny_model_path)


def make_item(tid: str, versions: list[int], n_prompt: int = 3, seed: int = 0) -> dict:
    rng = np.random.RandomState(seed)
    n = n_prompt + len(versions)
    return dict(
        trajectory_id=tid,
        token_ids=rng.randint(0, VOCAB, n),
        loss_mask=[0] * n_prompt + [1] * len(versions),
        versions=[-1] * n_prompt + versions,
    )


def request(*items: dict, temperature: float = T) -> OldLogitRequest:
    return OldLogitRequest(request_id="r", temperature=temperature, items=list(items))


def padded(items: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    seq = max(len(it["token_ids"]) for it in items)
    ids = torch.zeros(len(items), seq, dtype=torch.long)
    mask = torch.zeros(len(items), seq, dtype=torch.long)
    for r, it in enumerate(items):
        ids[r, : len(it["token_ids"])] = torch.as_tensor(it["token_ids"], dtype=torch.long)
        mask[r, : len(it["token_ids"])] = 1
    return ids, mask


def count_forwards(svc: OldLogitService) -> list[int]:
    calls: list[int] = []
    svc.model.register_forward_hook(lambda *a: calls.append(1))
    return calls


def svc_at(tiny_model_path, learner, versions, **kw) -> OldLogitService:
    svc = OldLogitService(tiny_model_path, **kw)
    for v in versions:
        learner.publish(svc, v)
    return svc


# ----------------------------------------------------------------------------------------------


def test_snapshot_equals_learner_forward_exactly(tiny_model_path, learner):
    svc = svc_at(tiny_model_path, learner, [1, 2, 3], route="snapshot", max_staleness=3)
    # each token's value is, bit for bit, the learner's forward at the token's version of the rows
    # that contain that version, cut after its last token (the service's documented layout); any
    # other layout differs by fp32 round-off only
    items = [
        make_item("a", [1, 1, 2, 3], seed=1),
        make_item("b", [2, 2, 2, 3], seed=2),
        make_item("c", [0, 1, 3, 3], seed=3),
    ]
    ans = svc.score(request(*items, temperature=0.5))
    ids, mask = padded(items)
    for r, it in enumerate(items):
        v = np.asarray(it["versions"])
        assert (ans.status[r] == np.where(v >= 0, TokenStatus.EXACT, TokenStatus.CONTEXT)).all()
        assert np.isnan(ans.old_logprobs[r][v < 0]).all()
        for ver in set(v[v >= 0].tolist()):
            rows = [q for q, other in enumerate(items) if ver in other["versions"]]
            end = max(int(np.flatnonzero(np.asarray(items[q]["versions"]) == ver).max()) for q in rows) + 1
            ref = learner.logprobs(ver, ids[rows, :end], mask[rows, :end], 0.5)[rows.index(r)].numpy()
            sel = v == ver
            assert np.array_equal(ans.old_logprobs[r][sel], ref[sel[:end]]), (r, ver)
            whole = learner.logprobs(ver, ids, mask, 0.5)[r].numpy()
            assert np.allclose(ans.old_logprobs[r][sel], whole[sel], atol=1e-5, rtol=0)
    # temperature is applied exactly as the learner does: T=0.5 and T=1 answers differ
    ans1 = svc.score(request(*items, temperature=1.0))
    assert not np.allclose(ans1.old_logprobs[0][3:], ans.old_logprobs[0][3:])
    # different lengths: a single unpadded item is bit-exact; padded rows agree to fp32 round-off
    short = make_item("s", [3, 3], seed=4)
    ans = svc.score(request(short))
    i, m = padded([short])
    assert np.array_equal(ans.old_logprobs[0][3:], learner.logprobs(3, i, m)[0].numpy()[3:])
    ans = svc.score(request(short, items[0]))
    assert np.allclose(ans.old_logprobs[0][3:], learner.logprobs(3, i, m)[0].numpy()[3:], atol=1e-5, rtol=0)


def test_packed_service_scores_as_the_padded_one(tiny_model_path, learner):
    """``packed=True``: items of 5, 7 and 9 tokens at versions 1-2 get the padded service's old
    logits to fp32 round-off, with the same status per token."""
    items = [make_item("a", [1, 2], seed=1), make_item("b", [1, 1, 2, 2], seed=2), make_item("c", [2] * 6, seed=3)]
    answers = [
        svc_at(tiny_model_path, learner, [1, 2], route="snapshot", packed=packed).score(request(*items))
        for packed in (False, True)
    ]
    for r in range(len(items)):
        assert np.array_equal(answers[0].status[r], answers[1].status[r])
        np.testing.assert_allclose(answers[1].old_logprobs[r], answers[0].old_logprobs[r], rtol=0, atol=2e-5)


def test_rows_split_into_runs_under_a_token_bound():
    assert row_chunks([4, 6, 3, 5], 12) == [[0, 1], [2, 3]]
    assert row_chunks([4, 6, 3, 5], None) == [[0, 1, 2, 3]] and row_chunks([], 8) == []
    assert row_chunks([9, 2, 2], 8) == [[0], [1, 2]]  # a row over the bound goes alone


def test_micro_batched_scoring_forwards_each_run_and_agrees_with_one_forward(tiny_model_path, learner):
    """Three items of 5, 7 and 9 tokens, 12 positions per forward: version 1's rows a and b (cut at 4
    and 5 positions) take one forward (2 x 5 = 10), version 2's rows (5, 7, 9 positions) three
    (2 x 7 > 12); the values agree with one forward per version to fp32 round-off, the statuses
    exactly."""
    items = [make_item("a", [1, 2], seed=1), make_item("b", [1, 1, 2, 2], seed=2), make_item("c", [2] * 6, seed=3)]
    whole = svc_at(tiny_model_path, learner, [1, 2], route="snapshot")
    split = svc_at(tiny_model_path, learner, [1, 2], route="snapshot", micro_batch_tokens=12)
    calls = count_forwards(split)
    a, b = whole.score(request(*items)), split.score(request(*items))
    assert len(calls) == 4
    for r in range(len(items)):
        assert np.array_equal(a.status[r], b.status[r])
        np.testing.assert_allclose(b.old_logprobs[r], a.old_logprobs[r], rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match=r"micro_batch_tokens: must be >= 1 or None, got 0"):
        OldLogitService(tiny_model_path, micro_batch_tokens=0)


def test_case13_three_forwards_then_evicted(tiny_model_path, learner):
    svc = svc_at(tiny_model_path, learner, [3, 4, 5], route="snapshot", max_staleness=2)
    assert svc.versions_held == [3, 4, 5]
    calls = count_forwards(svc)
    item = make_item("t", [3, 3, 4, 4, 5], n_prompt=2, seed=13)
    ans = svc.score(request(item))
    assert len(calls) == 3 and svc.forwards == 3  # one forward per distinct version
    st = ans.status[0][2:]
    assert (st == TokenStatus.EXACT).all() and ans.exact_token_fraction() == 1.0
    first = ans.old_logprobs[0].copy()
    assert np.isfinite(first[2:]).all()

    learner.publish(svc, 6)  # V=6, W=2: version 3 can no longer be consumed -> evicted
    assert svc.versions_held == [4, 5, 6] and svc.evicted[3] == "staleness"
    calls.clear()
    ans = svc.score(request(item))
    assert len(calls) == 2
    assert ans.status[0][2:].tolist() == [TokenStatus.MISSING_EVICTED] * 2 + [TokenStatus.EXACT] * 3
    assert np.isnan(ans.old_logprobs[0][2:4]).all()
    assert np.array_equal(ans.old_logprobs[0][4:], first[4:])
    assert ans.exact_token_fraction() == pytest.approx(0.6)
    s = svc.status()
    assert s.tokens_exact == 8 and s.tokens_missing == {"MISSING_EVICTED": 2} and s.requests == 2


def test_eviction_by_staleness_bound_and_missing_reasons(tiny_model_path, learner):
    svc = svc_at(tiny_model_path, learner, [1, 2, 3, 5], route="snapshot", max_staleness=2)
    # V=5, W=2: keep [3, 5]; 4 was never published; 0, 1, 2 evicted by the staleness bound
    assert svc.versions_held == [3, 5]
    assert svc.evicted == {0: "staleness", 1: "staleness", 2: "staleness"}
    ans = svc.score(request(make_item("x", [2, 3, 4, 5, 7], seed=5)))
    assert ans.status[0][3:].tolist() == [
        TokenStatus.MISSING_EVICTED,
        TokenStatus.EXACT,
        TokenStatus.MISSING_NEVER_STORED,
        TokenStatus.EXACT,
        TokenStatus.MISSING_FUTURE,
    ]
    one = svc.stats()
    assert one["tokens_missing"] == {"MISSING_EVICTED": 1, "MISSING_NEVER_STORED": 1, "MISSING_FUTURE": 1}
    assert one["bytes_held"] == 2 * svc.store.held_bytes[5] > 0
    assert one["evictions"] == {"staleness": 3}


def test_eviction_by_memory_budget(tiny_model_path, learner):
    probe = OldLogitService(tiny_model_path, route="snapshot")
    copy = probe.bytes_held  # one fp32 copy of the tiny model, tied embedding counted once
    assert copy == sum(p.numel() for p in learner.model.parameters()) * 4
    svc = svc_at(
        tiny_model_path, learner, [1, 2, 3, 4], route="snapshot", max_staleness=4, memory_budget_bytes=int(2.5 * copy)
    )
    assert svc.versions_held == [3, 4] and svc.bytes_held <= 2.5 * copy
    assert svc.evicted == {0: "memory_budget", 1: "memory_budget", 2: "memory_budget"}
    ans = svc.score(request(make_item("x", [2, 3, 4], seed=6)))
    assert ans.status[0][3:].tolist() == [TokenStatus.MISSING_EVICTED, TokenStatus.EXACT, TokenStatus.EXACT]
    # a budget below one copy holds nothing; the version is recorded as evicted, not silently lost
    tiny = svc_at(tiny_model_path, learner, [1], route="snapshot", memory_budget_bytes=copy - 1, initial_version=None)
    assert tiny.versions_held == [] and tiny.bytes_held == 0 and tiny.evicted == {1: "memory_budget"}
    assert tiny.score(request(make_item("y", [1], seed=7))).status[0][3] == TokenStatus.MISSING_EVICTED


def test_partial_rollouts_span_versions(tiny_model_path, learner):
    svc = svc_at(tiny_model_path, learner, [1, 2, 3, 4], route="snapshot", max_staleness=3)
    items = [
        make_item("a", [1, 1, 1, 2, 2, 3], n_prompt=4, seed=8),
        make_item("b", [2, 3, 3, 3, 4, 4], n_prompt=4, seed=9),
        make_item("c", [4, 4, 4, 4, 4, 4], n_prompt=4, seed=10),
        make_item("d", [3, 4], n_prompt=2, seed=11),  # shorter: padded
    ]
    calls = count_forwards(svc)
    ans = svc.score(request(*items))
    assert len(calls) == 4  # distinct versions {1, 2, 3, 4} over the whole batch, not per item
    ids, mask = padded(items)
    for r, it in enumerate(items):
        v = np.asarray(it["versions"])
        assert (ans.status[r][v >= 0] == TokenStatus.EXACT).all()
        want = np.full(len(v), np.nan, np.float32)
        for ver in set(v[v >= 0].tolist()):
            want[v == ver] = learner.logprobs(ver, ids, mask)[r].numpy()[: len(v)][v == ver]
        assert np.allclose(ans.old_logprobs[r], want, atol=1e-5, rtol=0, equal_nan=True)
        # a version-0 value for the same tokens is different: the version really matters
    assert not np.allclose(ans.old_logprobs[2][4:], learner.logprobs(0, ids, mask)[2].numpy()[4:10])


def test_old_logit_model_stays_in_step_with_broadcasts(tiny_model_path, learner):
    svc = OldLogitService(tiny_model_path, route="old_logit_model")
    one_copy = svc.bytes_held
    traj = None
    for v in (1, 2, 3):
        learner.publish(svc, v)
        assert svc.versions_held == [v] and svc.bytes_held == one_copy and svc.latest_version == v
        # a trajectory whose segment of version v finishes now: scored before v is superseded
        base = make_item("t", [1, 1, 2, 2, 3, 3], seed=12)
        n = len(base["token_ids"])
        upto = 3 + 2 * v  # tokens generated so far
        traj_v = Trajectory(
            trajectory_id="t",
            group_id="g",
            token_ids=base["token_ids"][:upto],
            loss_mask=base["loss_mask"][:upto],
            behav_logprobs=np.full(upto, -1.0, np.float32),
            versions=base["versions"][:upto],
            policy_version=v,
            prompt_len=3,
            finish_reason="abort" if upto < n else "stop",
            old_logprobs=None if traj is None else np.concatenate([traj.old_logprobs, np.full(2, np.nan, np.float32)]),
        )
        (traj,) = svc.attach_old_logprobs([traj_v], T)
        assert np.isfinite(traj.old_logprobs[3:]).all()
    ids, mask = padded([base])
    want = np.concatenate(
        [np.full(3, np.nan)] + [learner.logprobs(v, ids, mask)[0].numpy()[1 + 2 * v : 3 + 2 * v] for v in (1, 2, 3)]
    )
    assert np.allclose(traj.old_logprobs, want, atol=1e-5, rtol=0, equal_nan=True)
    assert (status_from_old_logprobs(traj.old_logprobs, traj.loss_mask)[3:] == TokenStatus.EXACT).all()
    # the last segment was scored on the full sequence: bit-exact with the learner's forward
    assert np.array_equal(traj.old_logprobs[7:], want[7:])
    # a segment that arrives after its version was superseded is honest about it
    late = svc.score_prefixes([make_item("late", [2, 2], seed=13)], T)[0]
    assert np.isnan(late).all() and svc.stats()["tokens_missing"] == {"MISSING_EVICTED": 2}
    assert svc.score(request(make_item("q", [2, 3], seed=14))).status[0][3:].tolist() == [
        TokenStatus.MISSING_EVICTED,
        TokenStatus.EXACT,
    ]


def test_interrupt_sync_scores_prefixes_at_outgoing_version(tiny_model_path, learner):
    svc = OldLogitService(tiny_model_path, route="interrupt_sync", initial_version=None)
    learner.publish(svc, 1)
    full = [make_item("a", [1, 1, 1, 2, 2, 3], seed=15), make_item("b", [1, 2, 2, 2, 3, 3], seed=16)]
    acc = [None, None]
    # generation proceeds at version 1; interrupt at 1 -> 2 after k1 tokens, at 2 -> 3 after k2; finish at 3
    for outgoing, nxt in ((1, 2), (2, 3), (3, None)):
        prefixes = []
        for it in full:
            v = np.asarray(it["versions"])
            k = int(np.flatnonzero(v <= outgoing).max()) + 1  # generated so far
            prefixes.append({key: np.asarray(it[key])[:k] if key != "trajectory_id" else it[key] for key in it})
        lps = svc.score_prefixes(prefixes, T, old_logprobs=acc)  # while the outgoing version is still loaded
        for r, lp in enumerate(lps):
            v = np.asarray(prefixes[r]["versions"])
            assert len(lp) == len(v) and np.isfinite(lp[v >= 0]).all() and np.isnan(lp[v < 0]).all()
            if acc[r] is not None:  # earlier interruptions' values are kept bit for bit
                assert np.array_equal(lp[: len(acc[r])], acc[r], equal_nan=True)
        acc = lps
        if nxt is not None:
            learner.publish(svc, nxt)
            assert svc.versions_held == [nxt]
    ids, mask = padded(full)
    for r, it in enumerate(full):
        v = np.asarray(it["versions"])
        assert (np.isfinite(acc[r]) == (v >= 0)).all()
        for ver in (1, 2, 3):
            assert np.allclose(
                acc[r][v == ver], learner.logprobs(ver, ids, mask)[r].numpy()[v == ver], atol=1e-5, rtol=0
            )
    st = svc.stats()
    assert st["seconds"]["prefixes"] > 0 and st["requests"] == 3 and st["forwards"] == 3
    assert st["tokens_exact"] == 12 and st["tokens_missing"] == {}  # each token scored once, at its version


def test_route_none_answers_never_stored_without_a_model(learner):
    svc = OldLogitService(None, route="none")
    assert svc.model is None and svc.bytes_held == 0
    svc.update_weights(*pack_weights(learner.model.state_dict().items(), 1))
    ans = svc.score(request(make_item("n", [0, 1], seed=17)))
    assert ans.route == "none" and ans.status[0].tolist() == [1, 1, 1, 3, 3] and ans.exact_token_fraction() == 0.0
    assert svc.status().tokens_missing == {"MISSING_NEVER_STORED": 2}


def test_malformed_requests_and_publications_name_the_field(tiny_model_path, learner):
    svc = OldLogitService(tiny_model_path, route="snapshot", max_staleness=1)
    good = make_item("m", [0, 0], seed=18)
    with pytest.raises(pydantic.ValidationError, match="temperature"):
        svc.score({"request_id": "r", "items": [good]})
    with pytest.raises(pydantic.ValidationError, match="temperature"):
        svc.score({"request_id": "r", "temperature": 0.0, "items": [good]})
    with pytest.raises(pydantic.ValidationError, match="items"):
        svc.score({"request_id": "r", "temperature": 1.0, "items": []})
    with pytest.raises(pydantic.ValidationError, match="versions"):
        svc.score({"request_id": "r", "temperature": 1.0, "items": [dict(good, versions=[-1, -1])]})
    with pytest.raises(ValueError, match=r"items\[1\]\.token_ids: id 49152 outside"):
        svc.score(request(good, dict(good, token_ids=[1, 2, 3, 4, VOCAB])))
    with pytest.raises(ValueError, match=r"items\[0\]\.loss_mask: offset 0"):
        svc.score(request(dict(trajectory_id="z", token_ids=[5, 6], loss_mask=[1, 1], versions=[0, 0])))
    with pytest.raises(TypeError, match="request"):
        svc.score(["not", "a", "request"])
    # a mapping is decoded strictly: no string, bool or float for a number or an integer
    with pytest.raises(pydantic.ValidationError, match=r"temperature\n  Input should be a valid number"):
        svc.score({"request_id": "r", "temperature": "1.0", "items": [good]})
    with pytest.raises(pydantic.ValidationError, match=r"items\.0\.schema_version\n  Input should be a valid integer"):
        svc.score({"request_id": "r", "temperature": 1.0, "items": [dict(good, schema_version=True)]})
    with pytest.raises(TypeError, match=r"items\[0\]"):
        svc.score_prefixes([42], T)
    with pytest.raises(ValueError, match="temperature"):
        svc.score_prefixes([good], 0.0)
    # publications
    learner.step_to(2)
    man, pay = pack_weights(learner.model.state_dict().items(), 2)
    bad = dict(pay)
    name = next(iter(bad))
    bad[name] = bad[name] + 1.0
    with pytest.raises(ProtocolError, match="checksum"):
        svc.update_weights(man, bad)
    assert svc.versions_held == [0]  # a bad payload changes nothing
    wrong = {k: v for k, v in learner.model.state_dict().items() if "layers.1" not in k}
    with pytest.raises(ProtocolError, match="missing"):
        svc.update_weights(*pack_weights(wrong.items(), 2))
    svc.update_weights(man, pay)
    assert svc.update_weights(man, pay) == 2  # idempotent republish
    with pytest.raises(ValueError, match="manifest.version"):
        svc.update_weights(*pack_weights(learner.model.state_dict().items(), 1))
    learner.model.load_state_dict(learner.states[1])
    with pytest.raises(ValueError, match="different checksum"):
        svc.update_weights(*pack_weights(learner.model.state_dict().items(), 2))
    learner.model.load_state_dict(learner.states[max(learner.states)])
    with pytest.raises(pydantic.ValidationError, match="version"):
        svc.update_weights(dict(man.model_dump(), version=-1), pay)
    with pytest.raises(pydantic.ValidationError, match=r"version\n  Input should be a valid integer.*input_value=3\.0"):
        svc.update_weights(dict(man.model_dump(), version=3.0), pay)
    assert svc.versions_held == [2]  # refused publications change nothing (max_staleness 1 evicted 0)
    assert svc.update_weights(man.model_dump(), pay) == 2  # a well-formed mapping is taken
    for kw, field in (
        (dict(route="snapshots"), "route"),
        (dict(max_staleness=-1), "max_staleness"),
        (dict(memory_budget_bytes=-5), "memory_budget_bytes"),
        (dict(dtype="int4"), "dtype"),
    ):
        with pytest.raises(ValueError, match=field):
            OldLogitService(tiny_model_path, **kw)


def test_publisher_may_reuse_published_tensors(tiny_model_path):
    """The service copies payload tensors: a publisher that reuses or steps them in place (a
    zero-copy publish) cannot change a held snapshot."""
    model = load_causal_lm(tiny_model_path)
    svc = OldLogitService(tiny_model_path, route="snapshot", max_staleness=2, initial_version=None)
    man, pay = pack_weights(model.state_dict().items(), 1)
    svc.update_weights(man, pay)
    item = make_item("c", [1, 1, 1], seed=19)
    before = svc.score(request(item)).old_logprobs[0]
    with torch.no_grad():
        for t in pay.values():
            t.mul_(1.5)
    assert np.array_equal(svc.score(request(item)).old_logprobs[0], before, equal_nan=True)
    assert svc.bytes_held == sum(p.numel() for p in model.parameters()) * 4


def test_object_store_payload_is_held_without_a_copy(tiny_model_path):
    """A payload read from the object store is immutable shared memory: the snapshot holds those
    views as they are and scores exactly as with a private copy of the same weights."""
    import pickle

    model = load_causal_lm(tiny_model_path)
    man, pay = pack_weights(model.state_dict().items(), 1)
    bufs = []
    data = pickle.dumps(pay, protocol=5, buffer_callback=bufs.append)
    shared = pickle.loads(data, buffers=[b.raw().toreadonly() for b in bufs])  # what a Ray reader gets
    copied = OldLogitService(tiny_model_path, route="snapshot", initial_version=None)
    held = OldLogitService(tiny_model_path, route="snapshot", initial_version=None)
    copied.update_weights(man, pay)
    held.update_weights(man, shared)
    assert all(held.store.held[1][n].data_ptr() == shared[n].data_ptr() for n in shared)
    assert all(copied.store.held[1][n].data_ptr() != pay[n].data_ptr() for n in pay)
    item = make_item("z", [1, 1, 1], seed=23)
    assert np.array_equal(
        held.score(request(item)).old_logprobs[0], copied.score(request(item)).old_logprobs[0], equal_nan=True
    )
    assert held.bytes_held == copied.bytes_held == sum(p.numel() for p in model.parameters()) * 4


@pytest.fixture(scope="module")
def held_456(tiny_model_path, learner):
    # published 1, 2, 3, 5, 6 with W = 3: held [3, 5, 6]; 4 never published; 0, 1, 2 evicted
    svc = svc_at(tiny_model_path, learner, [1, 2, 3, 5, 6], route="snapshot", max_staleness=3)
    assert svc.versions_held == [3, 5, 6] and set(svc.evicted) == {0, 1, 2}
    return svc


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 1), st.integers(0, 8)), min_size=1, max_size=10),
        min_size=1,
        max_size=3,
    )
)
def test_status_is_a_function_of_the_store(held_456, seqs):
    svc = held_456
    items = []
    for q, toks in enumerate(seqs):
        mask = [0] + [m for m, _ in toks]
        vers = [-1] + [v if m else -1 for m, v in toks]
        items.append(
            dict(trajectory_id=f"h{q}", token_ids=list(range(5, 6 + len(toks))), loss_mask=mask, versions=vers)
        )
    f0 = svc.forwards
    ans = svc.score(request(*items))
    present = {v for it in items for m, v in zip(it["loss_mask"], it["versions"], strict=True) if m}
    assert svc.forwards - f0 == len(present & {3, 5, 6})  # one forward per distinct held version
    for it, lp, stt in zip(items, ans.old_logprobs, ans.status, strict=True):
        for m, v, x, s in zip(it["loss_mask"], it["versions"], lp, stt, strict=True):
            want = (
                TokenStatus.CONTEXT
                if not m
                else TokenStatus.EXACT
                if v in (3, 5, 6)
                else TokenStatus.MISSING_EVICTED
                if v in (0, 1, 2)
                else TokenStatus.MISSING_FUTURE
                if v > 6
                else TokenStatus.MISSING_NEVER_STORED
            )
            assert s == want and (np.isfinite(x) == (want == TokenStatus.EXACT))
            if want == TokenStatus.EXACT:
                assert x <= 0


def test_count_statuses_counts_exact_and_missing_by_reason_and_skips_context():
    from oldlogit_service.scoring import count_statuses
    from protocol import TokenStatus as S

    sts = [np.array([S.CONTEXT, S.EXACT, S.MISSING_EVICTED, S.EXACT], np.int8), np.array([S.MISSING_FUTURE], np.int8)]
    exact, missing = count_statuses(sts)
    assert exact == 2 and dict(missing) == {"MISSING_EVICTED": 1, "MISSING_FUTURE": 1}


def test_each_route_holds_versions_as_its_holding_says():
    from oldlogit_service.store import Holding

    assert Holding.of("snapshot", 3) == Holding(weights=True, window=3, on_host=True)
    assert Holding.of("old_logit_model", 3) == Holding(weights=True, window=None, on_host=False)
    assert Holding.of("interrupt_sync", 0) == Holding(weights=True, window=None, on_host=False)
    assert Holding.of("none", 3) == Holding(weights=False, window=None, on_host=False)
    with pytest.raises(ValueError, match="'bogus'"):
        Holding.of("bogus", 2)


def test_a_pinned_reference_outlives_the_window_and_is_scored_beside_the_old_logits(tiny_model_path, learner):
    """Snapshot route, W = 1, version 0 pinned: after versions 1-3 the service holds [0, 2, 3]
    (0 stays, 1 left by the bound); a request asking for the reference gets version 0's log-probs
    of the tokens its masks mark (the learner's version-0 forward, to fp32 round-off), NaN elsewhere,
    and the old logits of the same request are unchanged by it. A budget counts the pinned copy
    and never evicts it."""
    svc = svc_at(tiny_model_path, learner, [1, 2, 3], route="snapshot", max_staleness=1, pin_initial=True)
    assert svc.versions_held == [0, 2, 3] and svc.evicted == {1: "staleness"}
    items = [make_item("a", [2, 3, 3], seed=11), make_item("b", [3, 3], seed=12)]
    masks = [np.array([0, 0, 0, 1, 1, 1], np.int8), np.array([0, 0, 0, 0, 1], np.int8)]
    plain = svc.score(request(*items))
    ans = svc.score(
        OldLogitRequest(request_id="r", temperature=T, items=items, reference_version=0, reference_masks=masks)
    )
    for i, it in enumerate(items):
        np.testing.assert_array_equal(ans.old_logprobs[i], plain.old_logprobs[i])
        ids, mask = padded([it])
        want = learner.logprobs(0, ids, mask)[0].numpy()
        got = ans.ref_logprobs[i]
        assert np.isnan(got[masks[i] == 0]).all()
        np.testing.assert_allclose(got[masks[i] == 1], want[masks[i] == 1], atol=2e-6, rtol=0)
    assert svc.tokens_reference == 4
    copy = svc.store.held_bytes[0]
    tight = svc_at(
        tiny_model_path, learner, [1, 2], route="snapshot", max_staleness=4, memory_budget_bytes=int(2.5 * copy),
        pin_initial=True,
    )  # fmt: skip
    assert tight.versions_held == [0, 2] and tight.evicted == {1: "memory_budget"}
    with pytest.raises(ValueError, match="pin_initial: needs the snapshot route and an initial_version"):
        OldLogitService(tiny_model_path, route="old_logit_model", pin_initial=True)
    # a budget below the pinned copy plus one version would evict every publication: refused at start
    with pytest.raises(ValueError, match=rf"oldlogit.memory_budget_bytes: {2 * copy - 1} bytes cannot hold"):
        OldLogitService(tiny_model_path, route="snapshot", pin_initial=True, memory_budget_bytes=2 * copy - 1)
    assert OldLogitService(
        tiny_model_path, route="snapshot", pin_initial=True, memory_budget_bytes=2 * copy
    ).versions_held == [0]


def test_the_pinned_reference_is_the_one_version_a_restarted_server_loads_again():
    kwargs = {"route": "snapshot", "initial_version": 0}
    assert restart_kwargs(kwargs, reconstructed=False) == kwargs
    assert restart_kwargs(kwargs, reconstructed=True) == {"route": "snapshot", "initial_version": None}
    pinned = {**kwargs, "pin_initial": True}
    assert restart_kwargs(pinned, reconstructed=True) == pinned  # the folder's weights are version 0 again


def test_a_reference_request_names_what_does_not_match():
    item = make_item("a", [0, 0])
    with pytest.raises(pydantic.ValidationError, match="reference_masks: given without reference_version"):
        OldLogitRequest(request_id="r", temperature=T, items=[item], reference_masks=[np.zeros(5, np.int8)])
    with pytest.raises(pydantic.ValidationError, match=r"reference_masks\[0\]: length 4 != token_ids length 5"):
        OldLogitRequest(
            request_id="r", temperature=T, items=[item], reference_version=0, reference_masks=[np.zeros(4, np.int8)]
        )


def test_the_reason_a_token_has_no_old_logprob():
    """Newest publication 5, version 2 evicted: version 7 is in the future, 2 evicted, 4 never held;
    before any publication every version is never stored."""
    evicted = {2: "staleness"}
    assert missing_reason(7, 5, evicted) is TokenStatus.MISSING_FUTURE
    assert missing_reason(2, 5, evicted) is TokenStatus.MISSING_EVICTED
    assert missing_reason(4, 5, evicted) is TokenStatus.MISSING_NEVER_STORED
    assert missing_reason(0, None, {}) is TokenStatus.MISSING_NEVER_STORED
