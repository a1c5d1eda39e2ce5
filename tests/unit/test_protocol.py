"""Protocol: every message round-trips through JSON (HTTP) and pickle (Ray's object store), token
arrays travel as base64 numpy buffers, per-token versions survive, malformed messages are refused
with the field named, and weight payloads are checked against their manifest.
"""

from __future__ import annotations

import base64
import copy
import json
import math
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pydantic
import pytest

import protocol
from protocol import (
    NO_VERSION,
    SCHEMA_VERSION,
    AdapterSpec,
    EnvRef,
    EwmaStatus,
    GatewayStatus,
    JobStatus,
    Message,
    OldLogitAnswer,
    OldLogitItem,
    OldLogitRequest,
    OldLogitServiceStatus,
    ProtocolError,
    RolloutRequest,
    SamplingParams,
    ScaleRequest,
    ScaleResponse,
    TensorSpec,
    TokenStatus,
    Trajectory,
    WeightManifest,
    WorkerStatus,
    adapter_key,
    payload_checksum,
    verify_weight_payload,
)

REPO = Path(__file__).resolve().parents[2]
K = 4  # prompt length of the case-5 trajectory
CASE5_VERSIONS = [3, 3, 3, 4, 4, 5]


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def traj_dict(**over) -> dict:
    """A K-token prompt (no version) and 6 sampled tokens with versions [3,3,3,4,4,5]."""
    n = K + len(CASE5_VERSIONS)
    d = dict(
        trajectory_id="t-0",
        group_id="g-0",
        worker_id="w-1",
        token_ids=list(range(100, 100 + n)),
        loss_mask=[0] * K + [1] * len(CASE5_VERSIONS),
        # NaN placeholders on context tokens: never read, must be accepted
        behav_logprobs=[math.nan] * K + [-0.5, -1.25, -0.125, -2.0, -0.75, -3.5],
        versions=[NO_VERSION] * K + CASE5_VERSIONS,
        policy_version=5,
        prompt_len=K,
        finish_reason="length",
        reward=1.0,
        turn_rewards=[1.0],
        turn_boundaries=[(K, n)],
        truncated=True,
        old_logprobs=[math.nan] * K + [-0.5, -1.0, math.nan, -2.0, -0.7, -3.0],
        info={"env": "gsm8k", "seed": 7},
    )
    d.update(over)
    return d


def make_traj(**over) -> Trajectory:
    return Trajectory(**traj_dict(**over))


def item_dict(**over) -> dict:
    d = dict(trajectory_id="t-0", token_ids=[5, 6, 7, 8], loss_mask=[0, 0, 1, 1], versions=[-1, -1, 2, 3])
    d.update(over)
    return d


def answer_dict(**over) -> dict:
    d = dict(
        request_id="r-0",
        route="snapshot",
        old_logprobs=[[math.nan, math.nan, -0.3, math.nan]],
        status=[[TokenStatus.CONTEXT, TokenStatus.CONTEXT, TokenStatus.EXACT, TokenStatus.MISSING_EVICTED]],
        seconds=0.25,
    )
    d.update(over)
    return d


def manifest_dict(**over) -> dict:
    d = dict(
        version=3,
        tensors=[
            {"name": "model.embed_tokens.weight", "shape": [10, 4], "dtype": "float32"},
            {"name": "model.norm.weight", "shape": [4], "dtype": "bfloat16"},
        ],
        checksum="0123456789abcdef0123456789abcdef",
        tied={"lm_head.weight": "model.embed_tokens.weight"},
    )
    d.update(over)
    return d


def assert_same(a, b, path="msg"):
    """Deep equality that understands numpy arrays (dtype and values, NaN == NaN)."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), f"{path}: {type(b)} is not an ndarray"
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), f"{path}: {a} != {b}"
    elif isinstance(a, pydantic.BaseModel):
        assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
        for name in type(a).model_fields:
            assert_same(getattr(a, name), getattr(b, name), f"{path}.{name}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys {a.keys()} != {b.keys()}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), f"{path}: {b!r} is not NaN"
    else:
        assert a == b and type(a) is type(b), f"{path}: {a!r} ({type(a)}) != {b!r} ({type(b)})"


def _all_message_types() -> set[type]:
    out, todo = set(), [Message]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("protocol."):
                out.add(sub)
                todo.append(sub)
    return out


def _samples() -> dict[str, Message]:
    gateway = GatewayStatus(
        policy_version=3,
        sessions_opened=5,
        sessions_open=1,
        sessions_ended=4,
        sessions_emitted=3,
        sessions_dropped={"no_calls": 1},
        trajectories_emitted=4,
        calls=9,
        splits=1,
        errors={"400": 2},
    )
    worker = WorkerStatus(
        worker_id="w-1",
        policy_version=4,
        in_flight=2,
        generated_trajectories=9,
        generated_tokens=900,
        tokens_per_s=12.5,
        errors=1,
        state="paused",
        last_error="boom",
    )
    service = OldLogitServiceStatus(
        route="snapshot",
        versions_held=[2, 3, 4],
        bytes_held=1 << 20,
        tokens_exact=90,
        tokens_missing={"MISSING_EVICTED": 10},
        seconds_total=1.5,
        requests=3,
    )
    ewma = EwmaStatus(beta=0.5, total_weight=1.75, resets=2, bytes_held=4096)
    return {
        "SamplingParams": SamplingParams(temperature=0.7, max_tokens=32, n=1, seed=11, stop_token_ids=[2, 7]),
        "EnvRef": EnvRef(path="rollout.envs.math:Arithmetic", kwargs={"digits": 2, "ops": ["+", "-"]}, seed=5),
        "RolloutRequest[prompt]": RolloutRequest(request_id="r-1", group_id="g-1", prompt="1+1=", admitted_version=2),
        "RolloutRequest[messages]": RolloutRequest(
            request_id="r-2",
            group_id="g-1",
            messages=[{"role": "user", "content": "hi"}],
            sampling=SamplingParams(n=8, temperature=1.0),
        ),
        "RolloutRequest[prompt_ids]": RolloutRequest(
            request_id="r-3", group_id="g-2", prompt_ids=np.array([1, 2, 3], np.int64)
        ),
        "RolloutRequest[env]": RolloutRequest(request_id="r-4", group_id="g-3", env=EnvRef(path="a.b:C")),
        "Trajectory": make_traj(),
        "Trajectory[no old_logprobs]": make_traj(old_logprobs=None, turn_boundaries=[], turn_rewards=[], info={}),
        "TensorSpec": TensorSpec(name="model.norm.weight", shape=[4], dtype="bfloat16"),
        "WeightManifest": WeightManifest(**manifest_dict()),
        "AdapterSpec": AdapterSpec(rank=2, alpha=4.0, target_modules=["q_proj"]),
        "WeightManifest[adapter]": WeightManifest(
            version=3,
            tensors=[
                TensorSpec(name=adapter_key("model.layers.0.self_attn.q_proj", "A"), shape=[2, 8], dtype="float32"),
                TensorSpec(name=adapter_key("model.layers.0.self_attn.q_proj", "B"), shape=[8, 2], dtype="float32"),
            ],
            checksum="0" * 32,
            adapter=AdapterSpec(rank=2, alpha=4.0, target_modules=["q_proj"]),
        ),
        "OldLogitItem": OldLogitItem(**item_dict()),
        "OldLogitRequest": OldLogitRequest(
            request_id="r-0",
            temperature=0.9,
            items=[OldLogitItem(**item_dict()), OldLogitItem(**item_dict(trajectory_id="t-1"))],
        ),
        "OldLogitAnswer": OldLogitAnswer(**answer_dict()),
        "WorkerStatus": worker,
        "OldLogitServiceStatus": service,
        "EwmaStatus": ewma,
        "GatewayStatus": gateway,
        "JobStatus": JobStatus(
            learner_version=5,
            workers=[worker],
            buffer_size=3,
            buffer_staleness_hist={0: 1, 2: 2},
            last_batch_staleness_hist={1: 4},
            oldlogit_route="snapshot",
            exact_token_fraction=0.9,
            proxy_fraction=0.1,
            ewma=ewma,
            mask_kept_fraction=0.97,
            tokens_per_s=33.0,
            last_publish_s=0.4,
            last_publish_unix=1.7e9,
            generated=10,
            consumed=7,
            in_flight=2,
            dropped={"stale": 1},
            skipped_steps=1,
            oldlogit=service,
            gateway=gateway,
        ),
        "ScaleRequest": ScaleRequest(num_workers=3),
        "ScaleResponse": ScaleResponse(num_workers=3, added=["w-3"], removed=[]),
    }


SAMPLES = _samples()


# ------------------------------------------------------------------------------------------------
# round trips
# ------------------------------------------------------------------------------------------------


def test_samples_cover_every_message_type():
    covered = {type(m) for m in SAMPLES.values()}
    missing = {t.__name__ for t in _all_message_types()} - {t.__name__ for t in covered}
    assert not missing, f"message types without a round-trip sample: {missing}"


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_json_round_trip(name):
    msg = SAMPLES[name]
    text = msg.model_dump_json()
    back = type(msg).model_validate_json(text)
    assert_same(msg, back)
    assert back.model_dump_json() == text  # stable: a second trip gives the same bytes
    assert json.loads(text)["schema_version"] == SCHEMA_VERSION


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_pickle_round_trip(name):
    msg = SAMPLES[name]
    back = pickle.loads(pickle.dumps(msg, protocol=5))
    assert_same(msg, back)
    assert back.model_dump_json() == msg.model_dump_json()


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_python_dict_round_trip(name):
    """model_dump() keeps ndarrays (no lists); model_validate of that dict rebuilds the message."""
    msg = SAMPLES[name]
    assert_same(msg, type(msg).model_validate(msg.model_dump()))


ARRAY_DTYPES = {
    "token_ids": "int32",
    "loss_mask": "int8",
    "behav_logprobs": "float32",
    "versions": "int32",
    "old_logprobs": "float32",
}


@pytest.mark.parametrize("trip", ["json", "pickle"])
def test_trajectory_arrays_keep_dtype_and_values(trip):
    t = make_traj()
    back = Trajectory.model_validate_json(t.model_dump_json()) if trip == "json" else pickle.loads(pickle.dumps(t))
    for field, dt in ARRAY_DTYPES.items():
        arr = getattr(back, field)
        assert isinstance(arr, np.ndarray) and arr.dtype == np.dtype(dt) and arr.ndim == 1, field
    src = traj_dict()
    np.testing.assert_array_equal(back.token_ids, src["token_ids"])
    np.testing.assert_array_equal(back.loss_mask, src["loss_mask"])
    np.testing.assert_array_equal(back.versions, src["versions"])
    # float32 values bit-exact, NaN placeholders on context tokens preserved
    np.testing.assert_array_equal(back.behav_logprobs, np.array(src["behav_logprobs"], np.float32))
    np.testing.assert_array_equal(back.old_logprobs, np.array(src["old_logprobs"], np.float32))
    assert np.isnan(back.behav_logprobs[:K]).all() and np.isnan(back.old_logprobs[K + 2])
    assert back.turn_boundaries == [(K, K + 6)]


def test_arrays_serialize_as_base64_not_float_lists():
    t = make_traj()
    doc = json.loads(t.model_dump_json())
    for field, dt in ARRAY_DTYPES.items():
        enc = doc[field]
        assert isinstance(enc, dict) and set(enc) == {"dtype", "b64"}, f"{field} serialized as {type(enc).__name__}"
        assert enc["dtype"] == dt
        raw = base64.b64decode(enc["b64"], validate=True)
        assert raw == getattr(t, field).astype(np.dtype(dt).newbyteorder("<")).tobytes(), field
        assert len(raw) == len(t.token_ids) * np.dtype(dt).itemsize
    # no float lists anywhere in the trajectory's JSON: the mu values do not appear as text
    text = t.model_dump_json()
    for v in ("-1.25", "-0.125", "-3.5"):
        assert v not in text
    # the answer of the old-logit service is array-encoded too
    ans = json.loads(SAMPLES["OldLogitAnswer"].model_dump_json())
    assert ans["old_logprobs"][0]["dtype"] == "float32" and ans["status"][0]["dtype"] == "int8"


def test_arrays_are_numpy_in_python_mode_and_read_only():
    t = make_traj()
    dumped = t.model_dump()
    assert isinstance(dumped["behav_logprobs"], np.ndarray)
    for field in ARRAY_DTYPES:
        with pytest.raises(ValueError):
            getattr(t, field)[-1] = 0  # a frozen message cannot be changed through its arrays
    with pytest.raises(pydantic.ValidationError):
        t.reward = 2.0


def test_array_inputs_are_normalised():
    """Big-endian, wider, list and base64 inputs all land as little-endian arrays of the field dtype."""
    be = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], dtype=">i8")
    t = make_traj(token_ids=be, behav_logprobs=np.array(traj_dict()["behav_logprobs"], dtype=">f8"))
    assert t.token_ids.dtype == np.dtype("<i4") and t.token_ids.tolist() == be.tolist()
    assert t.behav_logprobs.dtype == np.dtype("<f4")
    # the JSON form of another dtype (what a non-Python client may send) is converted
    enc = {"dtype": "int64", "b64": base64.b64encode(np.arange(10, dtype="<i8").tobytes()).decode()}
    t2 = Trajectory.model_validate({**traj_dict(), "token_ids": enc})
    assert t2.token_ids.dtype == np.int32 and t2.token_ids.tolist() == list(range(10))
    # integral floats are fine for integer arrays
    assert make_traj(loss_mask=[0.0] * K + [1.0] * 6).loss_mask.dtype == np.int8


def test_hand_written_http_json_is_accepted():
    body = '{"request_id": "r", "group_id": "g", "prompt_ids": [1, 2, 3], "sampling": {"temperature": 0.5, "n": 4}}'
    req = RolloutRequest.model_validate_json(body)
    assert req.prompt_ids.dtype == np.int32 and req.prompt_ids.tolist() == [1, 2, 3]
    assert req.sampling.n == 4 and req.schema_version == SCHEMA_VERSION


# ------------------------------------------------------------------------------------------------
# per-token versions and segments survive the trip
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("trip", ["none", "json", "pickle", "json+pickle"])
def test_case5_versions_and_segments_round_trip(trip):
    t = make_traj()
    if "json" in trip:
        t = Trajectory.model_validate_json(t.model_dump_json())
    if "pickle" in trip:
        t = pickle.loads(pickle.dumps(t))
    assert t.versions.tolist() == [-1] * K + [3, 3, 3, 4, 4, 5]
    assert t.segments() == [(3, K), (4, K + 3), (5, K + 5)]
    assert t.min_version() == 3
    assert t.num_generated == 6
    # each token keeps its own version: a single stamp would say 5 everywhere (failure signature)
    assert (t.versions[t.loss_mask.astype(bool)] != 5).sum() == 5


def test_segments_multi_turn_and_no_sampled_tokens():
    # prompt(2) turn1(3, v=1,1,2) tool(2) turn2(2, v=2,3)
    mask = [0, 0, 1, 1, 1, 0, 0, 1, 1]
    versions = [-1, -1, 1, 1, 2, -1, -1, 2, 3]
    t = Trajectory(
        trajectory_id="t",
        group_id="g",
        token_ids=list(range(9)),
        loss_mask=mask,
        behav_logprobs=[0.0] * 2 + [-1.0] * 7,
        versions=versions,
        policy_version=3,
        prompt_len=2,
        finish_reason="stop",
        turn_boundaries=[(2, 5), (7, 9)],
    )
    back = Trajectory.model_validate_json(t.model_dump_json())
    assert back.segments() == [(1, 2), (2, 4), (3, 8)]
    assert back.num_generated == 5  # tool tokens do not count
    assert back.turn_boundaries == [(2, 5), (7, 9)]
    # a trajectory of context only (e.g. aborted before its first token) has no segments
    ctx = Trajectory(
        trajectory_id="t",
        group_id="g",
        token_ids=[1, 2],
        loss_mask=[0, 0],
        behav_logprobs=[0, 0],
        versions=[-1, -1],
        policy_version=0,
        prompt_len=2,
        finish_reason="abort",
    )
    assert ctx.segments() == [] and ctx.min_version() == NO_VERSION and ctx.num_generated == 0


# ------------------------------------------------------------------------------------------------
# schema version
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SAMPLES))
@pytest.mark.parametrize("bad", [SCHEMA_VERSION + 1, 0, 99])
def test_unknown_schema_version_refused(name, bad):
    msg = SAMPLES[name]
    doc = json.loads(msg.model_dump_json())
    doc["schema_version"] = bad
    with pytest.raises(pydantic.ValidationError) as ei:
        type(msg).model_validate_json(json.dumps(doc))
    assert "schema_version" in str(ei.value) and str(bad) in str(ei.value)


def test_unknown_schema_version_of_a_nested_message_refused():
    doc = json.loads(SAMPLES["JobStatus"].model_dump_json())
    doc["workers"][0]["schema_version"] = 7
    with pytest.raises(pydantic.ValidationError) as ei:
        JobStatus.model_validate_json(json.dumps(doc))
    assert "workers.0.schema_version" in str(ei.value)


# ------------------------------------------------------------------------------------------------
# malformed messages: table-driven, each rejected with the field (and value) named
# ------------------------------------------------------------------------------------------------

N = K + 6
_b64_odd = {"dtype": "float32", "b64": base64.b64encode(b"\0" * (4 * N + 2)).decode()}

MALFORMED = [
    # id, message class, payload, text that must appear in the error (field name [, value])
    ("traj-loss_mask-length", Trajectory, traj_dict(loss_mask=[0] * K + [1] * 5), ["loss_mask", "9"]),
    ("traj-behav_logprobs-length", Trajectory, traj_dict(behav_logprobs=[-1.0] * (N + 1)), ["behav_logprobs", "11"]),
    ("traj-versions-length", Trajectory, traj_dict(versions=[-1] * K + [3, 3]), ["versions", "6"]),
    ("traj-old_logprobs-length", Trajectory, traj_dict(old_logprobs=[-1.0] * 3), ["old_logprobs", "3"]),
    ("traj-token_ids-shorter", Trajectory, traj_dict(token_ids=list(range(N - 1))), ["loss_mask", "token_ids"]),
    (
        "traj-versions-decrease",
        Trajectory,
        traj_dict(versions=[-1] * K + [3, 3, 4, 3, 4, 5]),
        ["versions", "decrease", "4 -> 3"],
    ),
    ("traj-versions-exceed-sender", Trajectory, traj_dict(policy_version=4), ["versions", "5", "policy_version"]),
    (
        "traj-versions-negative",
        Trajectory,
        traj_dict(versions=[-2] + [-1] * (K - 1) + CASE5_VERSIONS),
        ["versions", "-2"],
    ),
    (
        "traj-sampled-without-version",
        Trajectory,
        traj_dict(versions=[-1] * K + [-1, 3, 3, 4, 4, 5]),
        ["versions", f"offset {K}"],
    ),
    (
        "traj-behav-nan-on-sampled",
        Trajectory,
        traj_dict(behav_logprobs=[0.0] * K + [-0.5, math.nan, -1, -1, -1, -1]),
        ["behav_logprobs", "nan", f"offset {K + 1}"],
    ),
    (
        "traj-behav-neg-inf-on-sampled",
        Trajectory,
        traj_dict(behav_logprobs=[0.0] * K + [-1, -1, -1, -1, -1, -math.inf]),
        ["behav_logprobs", "-inf"],
    ),
    (
        "traj-behav-pos-inf-on-sampled",
        Trajectory,
        traj_dict(behav_logprobs=[0.0] * K + [math.inf, -1, -1, -1, -1, -1]),
        ["behav_logprobs", "inf"],
    ),
    (
        "traj-behav-positive",
        Trajectory,
        traj_dict(behav_logprobs=[0.0] * K + [-1, -1, 0.5, -1, -1, -1]),
        ["behav_logprobs", "0.5"],
    ),
    ("traj-behav-b64-ragged", Trajectory, traj_dict(behav_logprobs=_b64_odd), ["behav_logprobs", "multiple"]),
    ("traj-unknown-schema", Trajectory, traj_dict(schema_version=2), ["schema_version", "2"]),
    (
        "traj-empty",
        Trajectory,
        traj_dict(
            token_ids=[],
            loss_mask=[],
            behav_logprobs=[],
            versions=[],
            old_logprobs=None,
            prompt_len=0,
            turn_boundaries=[],
        ),
        ["token_ids", "empty"],
    ),
    ("traj-loss_mask-not-binary", Trajectory, traj_dict(loss_mask=[0] * K + [1, 1, 2, 1, 1, 1]), ["loss_mask", "2"]),
    (
        "traj-loss_mask-int8-overflow",
        Trajectory,
        traj_dict(loss_mask=[0] * K + [1, 1, 256, 1, 1, 1]),
        ["loss_mask", "256"],
    ),
    (
        "traj-versions-int32-overflow",
        Trajectory,
        traj_dict(versions=[-1] * K + [3, 3, 3, 4, 4, 2**32 + 5]),
        ["versions", "4294967301"],
    ),
    ("traj-token_ids-non-integer", Trajectory, traj_dict(token_ids=[1.5] * N), ["token_ids", "non-integer"]),
    ("traj-token_ids-2d", Trajectory, traj_dict(token_ids=[[1] * N]), ["token_ids", "1-D"]),
    ("traj-token_ids-strings", Trajectory, traj_dict(token_ids=["a"] * N), ["token_ids", "numeric"]),
    ("traj-loss-on-prompt", Trajectory, traj_dict(prompt_len=K + 1), ["loss_mask", "prompt_len"]),
    (
        "traj-prompt_len-too-long",
        Trajectory,
        traj_dict(prompt_len=N + 1, loss_mask=[0] * N),
        ["prompt_len", str(N + 1)],
    ),
    ("traj-reward-nan", Trajectory, traj_dict(reward=math.nan), ["reward", "nan"]),
    (
        "traj-turn-boundary-outside",
        Trajectory,
        traj_dict(turn_boundaries=[(K, N + 1)]),
        ["turn_boundaries", str(N + 1)],
    ),
    ("traj-finish-reason", Trajectory, traj_dict(finish_reason="eos"), ["finish_reason", "eos"]),
    ("traj-policy_version-negative", Trajectory, traj_dict(policy_version=-1), ["policy_version", "-1"]),
    ("traj-extra-field", Trajectory, traj_dict(logprobs=[0.0] * N), ["logprobs", "Extra inputs"]),
    (
        "traj-missing-field",
        Trajectory,
        {k: v for k, v in traj_dict().items() if k != "versions"},
        ["versions", "Field required"],
    ),
    ("sampling-temperature-0", SamplingParams, {"temperature": 0.0}, ["temperature", "0"]),
    ("sampling-top_p-lt-1", SamplingParams, {"top_p": 0.9}, ["top_p", "0.9"]),
    ("sampling-top_k", SamplingParams, {"top_k": 50}, ["top_k", "50"]),
    ("sampling-seed-with-n", SamplingParams, {"seed": 3, "n": 4}, ["seed", "n=4"]),
    ("sampling-max_tokens-0", SamplingParams, {"max_tokens": 0}, ["max_tokens"]),
    (
        "request-two-sources",
        RolloutRequest,
        {"request_id": "r", "group_id": "g", "prompt": "x", "prompt_ids": [1]},
        ["prompt", "prompt_ids", "exactly one"],
    ),
    ("request-no-source", RolloutRequest, {"request_id": "r", "group_id": "g"}, ["prompt", "messages", "env", "none"]),
    (
        "request-empty-prompt_ids",
        RolloutRequest,
        {"request_id": "r", "group_id": "g", "prompt_ids": []},
        ["prompt_ids", "empty"],
    ),
    ("request-empty-group", RolloutRequest, {"request_id": "r", "group_id": "", "prompt": "x"}, ["group_id"]),
    (
        "request-nested-sampling",
        RolloutRequest,
        {"request_id": "r", "group_id": "g", "prompt": "x", "sampling": {"temperature": 0}},
        ["sampling.temperature"],
    ),
    ("env-bad-path", EnvRef, {"path": "not a path"}, ["path", "not a path"]),
    ("item-loss_mask-length", OldLogitItem, item_dict(loss_mask=[0, 1]), ["loss_mask", "2", "4"]),
    ("item-versions-length", OldLogitItem, item_dict(versions=[-1, -1, 2]), ["versions", "3", "4"]),
    ("item-scored-without-version", OldLogitItem, item_dict(versions=[-1, -1, -1, 3]), ["versions", "-1"]),
    ("item-empty", OldLogitItem, item_dict(token_ids=[], loss_mask=[], versions=[]), ["token_ids", "empty"]),
    ("oldlogit-request-no-items", OldLogitRequest, {"request_id": "r", "temperature": 1.0, "items": []}, ["items"]),
    (
        "oldlogit-request-temperature-0",
        OldLogitRequest,
        {"request_id": "r", "temperature": 0.0, "items": [item_dict()]},
        ["temperature"],
    ),
    ("answer-item-count", OldLogitAnswer, answer_dict(status=[]), ["status", "0 items", "1 items"]),
    ("answer-item-length", OldLogitAnswer, answer_dict(status=[[0, 1, 2]]), ["status[0]", "3", "4"]),
    ("answer-route", OldLogitAnswer, answer_dict(route="ewma"), ["route", "ewma"]),
    (
        "manifest-duplicate-names",
        WeightManifest,
        manifest_dict(
            tensors=[{"name": "w", "shape": [2], "dtype": "float32"}, {"name": "w", "shape": [3], "dtype": "float32"}],
            tied={},
        ),
        ["tensors", "duplicate", "'w'"],
    ),
    ("manifest-checksum-short", WeightManifest, manifest_dict(checksum="abc123"), ["checksum", "abc123"]),
    (
        "manifest-checksum-uppercase",
        WeightManifest,
        manifest_dict(checksum="0123456789ABCDEF0123456789ABCDEF"),
        ["checksum"],
    ),
    ("manifest-checksum-sha256", WeightManifest, manifest_dict(checksum="0" * 64), ["checksum"]),
    ("manifest-tied-to-unknown", WeightManifest, manifest_dict(tied={"lm_head.weight": "nope"}), ["tied", "nope"]),
    ("manifest-no-tensors", WeightManifest, manifest_dict(tensors=[], tied={}), ["tensors"]),
    ("manifest-negative-version", WeightManifest, manifest_dict(version=-1), ["version", "-1"]),
    ("tensorspec-negative-shape", TensorSpec, {"name": "w", "shape": [2, -1], "dtype": "float32"}, ["shape", "-1"]),
    ("tensorspec-dtype", TensorSpec, {"name": "w", "shape": [2], "dtype": "float8"}, ["dtype", "float8"]),
    ("scale-negative", ScaleRequest, {"num_workers": -1}, ["num_workers", "-1"]),
    (
        "worker-in_flight-negative",
        WorkerStatus,
        {"worker_id": "w", "policy_version": 0, "in_flight": -3},
        ["in_flight", "-3"],
    ),
    ("job-proxy_fraction", JobStatus, {"learner_version": 0, "proxy_fraction": 1.5}, ["proxy_fraction", "1.5"]),
    ("ewma-beta-1", EwmaStatus, {"beta": 1.0, "total_weight": 1.0}, ["beta"]),
    ("traj-nan-turn-reward", Trajectory, traj_dict(turn_rewards=[math.nan]), ["turn_rewards", "finite"]),
    (
        "traj-inf-old-logprob",
        Trajectory,
        traj_dict(old_logprobs=[math.nan] * K + [-0.5, math.inf, -1.0, -2.0, -0.7, -3.0]),
        ["old_logprobs", "inf"],
    ),
    (
        "traj-positive-old-logprob",
        Trajectory,
        traj_dict(old_logprobs=[math.nan] * K + [-0.5, 0.25, -1.0, -2.0, -0.7, -3.0]),
        ["old_logprobs", "0.25"],
    ),
    (
        "traj-negative-token-id",
        Trajectory,
        traj_dict(token_ids=[-7] + list(range(101, 100 + K + 6))),
        ["token_ids", "-7"],
    ),
    ("sampling-negative-stop-id", SamplingParams, {"stop_token_ids": [2, -1]}, ["stop_token_ids", "-1"]),
    ("sampling-nan-temperature", SamplingParams, {"temperature": math.nan}, ["temperature", "finite"]),
    ("answer-status-not-enum", OldLogitAnswer, answer_dict(status=[[1, 1, 0, 9]]), ["status[0]", "[9]"]),
    ("answer-empty-request-id", OldLogitAnswer, answer_dict(request_id=""), ["request_id"]),
    ("item-negative-context-version", OldLogitItem, item_dict(versions=[-5, -1, 2, 3]), ["versions", "-5"]),
    (
        "request-inf-temperature",
        OldLogitRequest,
        {"request_id": "r", "temperature": math.inf, "items": [item_dict()]},
        ["temperature"],
    ),
    (
        "tensorspec-absurd-shape",
        TensorSpec,
        {"name": "w", "shape": [1 << 20, 1 << 20], "dtype": "float32"},
        ["shape", "more than"],
    ),
    (
        "tensorspec-too-many-dims",
        TensorSpec,
        {"name": "w", "shape": [1] * 9, "dtype": "float32"},
        ["shape", "at most 8"],
    ),
    ("array-unknown-dtype", OldLogitItem, item_dict(token_ids={"dtype": "nope", "b64": ""}), ["token_ids", "nope"]),
    (
        "array-non-string-b64",
        OldLogitItem,
        item_dict(token_ids={"dtype": "int32", "b64": 12}),
        ["token_ids", "strings"],
    ),
    ("job-mask-kept-7", JobStatus, {"learner_version": 0, "mask_kept_fraction": 7.0}, ["mask_kept_fraction", "7"]),
    ("job-mask-kept-nan", JobStatus, {"learner_version": 0, "mask_kept_fraction": math.nan}, ["mask_kept_fraction"]),
    ("job-negative-dropped", JobStatus, {"learner_version": 0, "dropped": {"stale": -2}}, ["dropped.stale", "-2"]),
]


def test_big_endian_array_is_read_in_its_byte_order():
    import base64

    import numpy as np

    be = np.array([5, 6, 7, 8], dtype=">i4")
    item = OldLogitItem.model_validate(
        item_dict(token_ids={"dtype": ">i4", "b64": base64.b64encode(be.tobytes()).decode()})
    )
    assert item.token_ids.tolist() == [5, 6, 7, 8] and item.token_ids.dtype == np.dtype("<i4")


def test_malformed_table_is_big_enough():
    assert len(MALFORMED) >= 12
    assert len({case[0] for case in MALFORMED}) == len(MALFORMED)


@pytest.mark.parametrize("cls,payload,must_contain", [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_message_rejected(cls, payload, must_contain):
    with pytest.raises(pydantic.ValidationError) as ei:
        cls.model_validate(copy.deepcopy(payload))
    text = str(ei.value)
    for needle in must_contain:
        assert needle in text, f"{needle!r} not in error text:\n{text}"


def test_malformed_json_trajectory_rejected():
    """The HTTP path: a base64-encoded array that breaks an invariant is refused just the same."""
    doc = json.loads(make_traj().model_dump_json())
    bad = np.array([-1] * K + [3, 4, 4, 2, 5, 5], dtype="<i4")
    doc["versions"] = {"dtype": "int32", "b64": base64.b64encode(bad.tobytes()).decode()}
    with pytest.raises(pydantic.ValidationError, match=r"versions: decrease within the sequence \(4 -> 2\)"):
        Trajectory.model_validate_json(json.dumps(doc))
    doc["versions"] = {"dtype": "int32", "b64": "not base64!!"}
    with pytest.raises(pydantic.ValidationError, match="versions"):
        Trajectory.model_validate_json(json.dumps(doc))
    doc["versions"] = {"dtype": "int32", "data": ""}
    with pytest.raises(pydantic.ValidationError, match="versions"):
        Trajectory.model_validate_json(json.dumps(doc))


def test_edge_inputs_that_are_accepted():
    # NaN / inf behaviour log-probs on context tokens are placeholders, never read
    t = make_traj(behav_logprobs=[math.nan, math.inf, -math.inf, 5.0] + [-1.0] * 6)
    assert t.num_generated == 6
    # a log-prob of exactly 0 (certain token) and a tiny positive rounding error are fine
    make_traj(behav_logprobs=[0.0] * K + [0.0, 5e-5, -1, -1, -1, -1])
    # a version equal to the sender's policy version is fine; context tokens may sit between segments
    make_traj(policy_version=5)
    # temperature may be anything > 0; top_p exactly 1.0
    SamplingParams(temperature=1e-3, top_p=1.0, seed=0, n=1)
    # old_logprobs NaN where missing
    assert np.isnan(make_traj().old_logprobs[K + 2])


def test_old_logit_answer_exact_fraction_survives_round_trip():
    ans = OldLogitAnswer.model_validate_json(SAMPLES["OldLogitAnswer"].model_dump_json())
    assert ans.exact_token_fraction() == 0.5  # one exact, one evicted; context tokens excluded
    assert ans.status[0].dtype == np.int8 and ans.status[0].tolist() == [1, 1, 0, 2]


# ------------------------------------------------------------------------------------------------
# weight payloads
# ------------------------------------------------------------------------------------------------


def _tied_model():
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(12, 6)
            self.proj = torch.nn.Linear(6, 6)
            self.lm_head = torch.nn.Linear(6, 12, bias=False)
            self.lm_head.weight = self.embed.weight  # tied

    torch.manual_seed(0)
    return Tiny()


def _wire(payload):
    from modelkit.weights import raw_bytes

    return {n: (list(t.shape), raw_bytes(t)) for n, t in payload.items()}


@pytest.fixture()
def packed():
    from modelkit.weights import pack_weights

    model = _tied_model()
    manifest, payload = pack_weights(model.state_dict().items(), version=7)
    return model, manifest, payload


def test_pack_weights_good_payload_verifies_and_unpacks_tied(packed):
    import torch

    from modelkit.weights import unpack_weights

    model, manifest, payload = packed
    assert manifest.version == 7
    assert manifest.tied == {"lm_head.weight": "embed.weight"}
    assert "lm_head.weight" not in payload and [t.name for t in manifest.tensors] == list(payload)
    assert manifest.total_bytes == sum(t.numel() * 4 for t in payload.values())
    verify_weight_payload(manifest, _wire(payload))  # no raise
    # the manifest travels as JSON, the payload through the object store
    manifest2 = WeightManifest.model_validate_json(manifest.model_dump_json())
    payload2 = pickle.loads(pickle.dumps(payload))
    out = unpack_weights(manifest2, payload2)
    assert out["lm_head.weight"] is out["embed.weight"]  # tied alias restored as the same tensor
    fresh = _tied_model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(out)
    assert fresh.lm_head.weight is fresh.embed.weight
    for name, t in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name


def test_pack_weights_bfloat16_checksum_covers_sent_bytes():
    from modelkit.weights import pack_weights, raw_bytes

    manifest, payload = pack_weights(_tied_model().state_dict().items(), version=1, dtype="bfloat16")
    assert {t.dtype for t in manifest.tensors} == {"bfloat16"}
    assert manifest.total_bytes == sum(t.numel() * 2 for t in payload.values())
    assert manifest.checksum == payload_checksum([(n, raw_bytes(t)) for n, t in payload.items()])
    verify_weight_payload(manifest, _wire(payload))


def test_verify_rejects_wrong_shape(packed):
    _, manifest, payload = packed
    wire = _wire(payload)
    shape, buf = wire["proj.weight"]
    wire["proj.weight"] = ([1, 36], buf)  # same byte count, wrong shape
    with pytest.raises(ProtocolError, match=r"payload\['proj.weight'\]\.shape: \[1, 36\] != manifest \[6, 6\]"):
        verify_weight_payload(manifest, wire)


def test_verify_rejects_wrong_byte_count(packed):
    _, manifest, payload = packed
    wire = _wire(payload)
    shape, buf = wire["proj.bias"]
    wire["proj.bias"] = (shape, bytes(buf)[:-4])
    with pytest.raises(ProtocolError, match=r"payload\['proj.bias'\]: 20 bytes != manifest 24"):
        verify_weight_payload(manifest, wire)


def test_verify_rejects_missing_and_extra_tensor(packed):
    _, manifest, payload = packed
    wire = _wire(payload)
    del wire["proj.bias"]
    with pytest.raises(ProtocolError, match=r"missing tensors \['proj.bias'\]"):
        verify_weight_payload(manifest, wire)
    wire = _wire(payload)
    wire["rogue.weight"] = ([1], b"\0\0\0\0")
    with pytest.raises(ProtocolError, match=r"unexpected tensors \['rogue.weight'\]"):
        verify_weight_payload(manifest, wire)


def test_verify_rejects_bad_checksum(packed):
    _, manifest, payload = packed
    wire = _wire(payload)
    shape, buf = wire["embed.weight"]
    flipped = bytearray(buf)
    flipped[17] ^= 0x01  # one bit of one weight
    wire["embed.weight"] = (shape, bytes(flipped))
    with pytest.raises(ProtocolError, match="checksum") as ei:
        verify_weight_payload(manifest, wire)
    assert manifest.checksum in str(ei.value)
    # a manifest whose checksum is well-formed but wrong is caught the same way
    forged = manifest.model_copy(update={"checksum": "f" * 32})
    with pytest.raises(ProtocolError, match="checksum"):
        verify_weight_payload(forged, _wire(payload))
    # order is part of the digest: the same tensors named in another order do not verify
    reordered = manifest.model_copy(update={"tensors": list(reversed(manifest.tensors))})
    with pytest.raises(ProtocolError, match="checksum"):
        verify_weight_payload(reordered, _wire(payload))


def test_unpack_refuses_tampered_payload(packed):
    import torch

    from modelkit.weights import unpack_weights

    _, manifest, payload = packed
    bad = dict(payload)
    bad["proj.weight"] = payload["proj.weight"].clone()
    bad["proj.weight"][0, 0] += 1.0
    with pytest.raises(ProtocolError, match="checksum"):
        unpack_weights(manifest, bad)
    bad["proj.weight"] = torch.zeros(3, 12)
    with pytest.raises(ProtocolError, match="proj.weight"):
        unpack_weights(manifest, bad)


def test_pack_weights_views_of_one_buffer_are_not_tied():
    import torch

    from modelkit.weights import pack_weights, unpack_weights

    flat = torch.arange(24, dtype=torch.float32)
    a, b = flat[:12].view(3, 4), flat[12:].view(3, 4)
    manifest, payload = pack_weights([("layers.0.weight", a), ("layers.1.weight", b)], version=1)
    out = unpack_weights(manifest, payload)
    assert manifest.tied == {}
    assert torch.equal(out["layers.1.weight"], b)


# ------------------------------------------------------------------------------------------------
# import weight
# ------------------------------------------------------------------------------------------------


def test_importing_protocol_pulls_in_no_torch_ray_or_vllm():
    code = (
        "import sys, json, protocol, protocol.arrays, protocol.messages\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray', 'vllm', 'transformers', 'deepspeed'))\n"
        "print(json.dumps(heavy))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []


def test_public_surface():
    for name in (
        "Trajectory",
        "RolloutRequest",
        "WeightManifest",
        "OldLogitAnswer",
        "JobStatus",
        "verify_weight_payload",
        "ProtocolError",
        "SCHEMA_VERSION",
        "NO_VERSION",
        "Float32Array",
    ):
        assert name in protocol.__all__
    assert issubclass(ProtocolError, ValueError)
    assert NO_VERSION == -1 and isinstance(SCHEMA_VERSION, int)


def test_from_wire_takes_a_message_as_is_and_decodes_a_mapping_strictly():
    m = WeightManifest(**manifest_dict())
    assert WeightManifest.from_wire(m) is m
    assert WeightManifest.from_wire(manifest_dict()) == m
    item = OldLogitItem.from_wire(item_dict(versions=np.array([-1, -1, 2, 3], np.int64)))  # arrays as numpy
    assert item.versions.tolist() == [-1, -1, 2, 3] and item.versions.dtype == np.int32
    for bad, field, got in (
        (manifest_dict(version="3"), "version", "'3'"),
        (manifest_dict(version=True), "version", "True"),
        (manifest_dict(version=4.0), "version", "4.0"),
        (manifest_dict(version=np.int64(3)), "version", "np.int64(3)"),
        (manifest_dict(tensors=(manifest_dict()["tensors"][0],)), "tensors", "input_type=tuple"),
    ):
        with pytest.raises(
            pydantic.ValidationError, match=rf"(?s){field}\n  Input should be a valid .*{re.escape(got)}"
        ):
            WeightManifest.from_wire(bad)
    with pytest.raises(TypeError, match=r"^manifest: expected WeightManifest or a mapping, got list$"):
        WeightManifest.from_wire([1, 2], "manifest")


def test_with_old_logprobs_checks_what_it_attaches():
    t = make_traj(old_logprobs=None)
    n = len(t.token_ids)
    got = t.with_old_logprobs(np.array([np.nan] * (n - 1) + [-0.5]))
    assert got.old_logprobs.dtype == np.float32 and float(got.old_logprobs[-1]) == -0.5
    assert np.isnan(got.old_logprobs[:-1]).all() and t.old_logprobs is None  # the original is untouched
    with pytest.raises(pydantic.ValidationError, match=f"old_logprobs: length {n - 1} != token_ids length {n}"):
        t.with_old_logprobs(np.full(n - 1, -0.5))
    with pytest.raises(pydantic.ValidationError, match=r"old_logprobs: 0.5 is not a log-probability"):
        t.with_old_logprobs(np.full(n, 0.5))


def test_every_route_has_its_traits():
    """Each route name has traits; only ``none`` is not exact, only ``snapshot`` scores per batch."""
    from protocol import OLDLOGIT_ROUTES, ROUTE_TRAITS

    assert set(ROUTE_TRAITS) == set(OLDLOGIT_ROUTES)
    assert [r for r, t in ROUTE_TRAITS.items() if not t.exact] == ["none"]
    assert [r for r, t in ROUTE_TRAITS.items() if t.per_batch] == ["snapshot"]
