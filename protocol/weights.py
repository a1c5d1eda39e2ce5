"""Weight publications on the wire: tensor specs, LoRA adapter specs and keys, the manifest of one
version, and the checksum a payload must match before any consumer applies it (torch-free)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import numpy as np
import xxhash
from pydantic import Field, field_validator, model_validator

from protocol.messages import FINGERPRINT_PATTERN, Message, ProtocolError

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
