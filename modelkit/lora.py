"""LoRA adapters as weight updates: the merge rule, the names, the peft wrapper and the kept base.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3) adapts a frozen
linear weight ``W0`` ``[out, in]`` by ``h = W0 x + (alpha / r) * B A x`` with ``A`` ``[r, in]`` and
``B`` ``[out, r]``; peft implements the same (``peft.tuners.lora.layer.Linear``: ``scaling =
lora_alpha / r``). The weight a consumer runs is therefore ``W0 + (alpha / r) * B @ A``
(:func:`merged_weights`).

Names: a publication names each factor as peft's saved adapters do (``get_peft_model_state_dict``):
``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight`` (:func:`protocol.adapter_key`),
where ``<module>`` is the HF module name, so the base weight it adapts is ``<module>.weight``
(:func:`base_key`). Inside a peft-wrapped model the same parameters carry the adapter name
(``...lora_A.default.weight``) and an adapted base weight is ``...<module>.base_layer.weight``
(:func:`peft_to_hf`, :func:`adapter_to_peft`).

Invariant: merging never changes the base tensors it is given; a consumer that keeps its base
merges each version from that pristine base, never from the previous version.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import Tensor

from modelkit.weights import pack_weights
from protocol import ADAPTER_KEY_PREFIX, AdapterSpec, WeightManifest, split_adapter_key

PEFT_ADAPTER_NAME = "default"
"""peft's name of the one adapter a wrapped model carries."""


def base_key(module: str) -> str:
    """HF name of the base weight an adapter on ``module`` changes: ``<module>.weight``."""
    return f"{module}.weight"


def adapter_factors(adapter: Mapping[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """``{module: (A [r, in], B [out, r])}`` of an adapter payload named by :func:`protocol.adapter_key`.

    Raises:
        ValueError: a name is not an adapter factor name, or a module lacks its ``A`` or ``B``
            (the message names it).
    """
    out: dict[str, dict[str, Tensor]] = {}
    for name, t in adapter.items():
        key = split_adapter_key(name)
        if key is None:
            raise ValueError(
                f"adapter[{name!r}]: not a LoRA factor name ({ADAPTER_KEY_PREFIX}<module>.lora_A|B.weight)"
            )
        out.setdefault(key[0], {})[key[1]] = t
    for module, ab in out.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter: module {module!r} has lora_{''.join(ab)} without its pair")
    return {m: (ab["A"], ab["B"]) for m, ab in out.items()}


@torch.no_grad()
def merged_weights(base: Mapping[str, Tensor], adapter: Mapping[str, Tensor], spec: AdapterSpec) -> dict[str, Tensor]:
    """The full weights of an adapter version: ``W0 + (alpha / r) * B @ A`` for every adapted module.

    Args:
        base: ``{hf_name: W0}``, the pristine base weights (``[out, in]`` for an adapted linear).
        adapter: ``{adapter_key(module, "A"|"B"): tensor}``, ``A`` ``[r, in]``, ``B`` ``[out, r]``.
        spec: rank and alpha (scaling ``alpha / rank``, LoRA eq. 3 / peft's ``scaling``).

    Returns:
        ``{hf_name: tensor}`` with every name of ``base``: adapted weights are new tensors (computed
        in float32, cast to ``W0``'s dtype and device), the others are ``base``'s own tensors (not
        copied). ``base`` is never modified.

    Raises:
        ValueError: an adapter name is malformed or unpaired, its base weight is missing, or the
            shapes do not fit ``[out, in] = [out, r] @ [r, in]`` with ``r = spec.rank``.
    """
    out = dict(base)
    for module, (a, b) in adapter_factors(adapter).items():
        name = base_key(module)
        w = base.get(name)
        if w is None:
            raise ValueError(f"adapter: module {module!r} adapts {name!r}, which the base does not have")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != spec.rank or b.shape[1] != spec.rank:
            raise ValueError(
                f"adapter: module {module!r} has A {list(a.shape)} and B {list(b.shape)}, not [{spec.rank}, in] and [out, {spec.rank}]"
            )
        if list(w.shape) != [b.shape[0], a.shape[1]]:
            raise ValueError(
                f"adapter: module {module!r}: B @ A is {[b.shape[0], a.shape[1]]}, base {name!r} is {list(w.shape)}"
            )
        delta = b.to(w.device, torch.float32) @ a.to(w.device, torch.float32)  # [out, in]
        out[name] = (w.to(torch.float32) + spec.scaling * delta).to(w.dtype)
    return out


def adapter_bytes(shapes: Iterable[tuple[int, int]], rank: int, itemsize: int = 4) -> int:
    """Bytes of one adapter: ``sum(rank * (in + out)) * itemsize`` over ``(out, in)`` of each adapted weight."""
    return sum(rank * (o + i) for o, i in shapes) * itemsize


def pack_adapter(
    named: Iterable[tuple[str, Tensor]], version: int, spec: AdapterSpec, dtype: str = "float32"
) -> tuple[WeightManifest, dict[str, Tensor]]:
    """Pack adapter tensors for publication: :func:`modelkit.weights.pack_weights` (cast, checksum,
    private copies) with ``manifest.adapter = spec``.

    Raises:
        pydantic.ValidationError: the tensors are not a valid adapter of ``spec`` (names, pairs, rank).
    """
    manifest, payload = pack_weights(named, version, dtype)
    manifest = WeightManifest.model_validate({**manifest.model_dump(), "adapter": spec.model_dump()})
    return manifest, payload


# -- peft ------------------------------------------------------------------------------------------


def wrap_lora(model: torch.nn.Module, spec: AdapterSpec, dropout: float = 0.0) -> torch.nn.Module:
    """``peft.get_peft_model`` of an HF causal LM with ``spec``'s rank, alpha and targets.

    The base weights are frozen (``requires_grad`` False); the new ``A`` factors are drawn from
    torch's global generator and ``B`` is zero (peft's default init), so the wrapped model computes
    exactly the base model's function until the first step.

    Raises:
        ValueError: no module of ``model`` matches ``spec.target_modules`` (peft's message).
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=dropout,
        target_modules=list(spec.target_modules),
        bias="none",
    )
    return get_peft_model(model, config, adapter_name=PEFT_ADAPTER_NAME)


def peft_to_hf(name: str) -> str | None:
    """HF name of a peft-wrapped model's base parameter (``base_model.model.X[.base_layer].weight`` ->
    ``X.weight``); None for adapter parameters."""
    if ".lora_A." in name or ".lora_B." in name:
        return None
    return name.removeprefix(ADAPTER_KEY_PREFIX).replace(".base_layer.", ".")


def peft_to_adapter(name: str) -> str | None:
    """Publication name of a peft-wrapped model's adapter parameter (``...lora_A.default.weight`` ->
    ``...lora_A.weight``); None for base parameters."""
    for which in ("A", "B"):
        inner = f".lora_{which}.{PEFT_ADAPTER_NAME}.weight"
        if name.endswith(inner):
            return name[: -len(inner)] + f".lora_{which}.weight"
    return None


def adapter_to_peft(key: str) -> str:
    """Inverse of :func:`peft_to_adapter`: the wrapped model's parameter name of a publication name."""
    parsed = split_adapter_key(key)
    if parsed is None:
        raise ValueError(f"{key!r} is not a LoRA factor name")
    module, which = parsed
    return f"{ADAPTER_KEY_PREFIX}{module}.lora_{which}.{PEFT_ADAPTER_NAME}.weight"


def adapter_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """``{publication name: tensor}`` of a peft-wrapped model's adapter parameters (the live tensors,
    not copies), in the model's parameter order."""
    out = {}
    for name, p in model.named_parameters():
        key = peft_to_adapter(name)
        if key is not None:
            out[key] = p
    return out


def base_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """``{hf_name: tensor}`` of a peft-wrapped model's state-dict entries outside the adapter (live
    tensors; tied weights appear under both names, as in the HF state dict)."""
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        hf = peft_to_hf(name)
        if hf is not None:
            out[hf] = t
    return out


def load_base_weights(model_path: str | Path) -> dict[str, Tensor]:
    """The weights stored in an HF folder's ``*.safetensors`` files, ``{hf_name: cpu tensor}`` in
    their stored dtype: the base a consumer keeps to merge adapter versions into.

    Raises:
        FileNotFoundError: no ``*.safetensors`` file in ``model_path``.
    """
    from safetensors.torch import load_file

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model_path: no .safetensors file in {model_path}")
    out: dict[str, Tensor] = {}
    for f in files:
        out.update(load_file(str(f), device="cpu"))
    return out
