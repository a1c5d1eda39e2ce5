"""Hugging Face folders of a policy version: a full model (``save_pretrained``) or a peft adapter.

Both are built from the base model folder (its ``config.json``, generation config and tokenizer)
and the version's tensors, without running the model:

- :func:`save_full_model`: the architecture is instantiated on the ``meta`` device (no memory, no
  random init), the version's tensors are assigned to it, tied weights are tied again
  (``tie_weights``) and ``save_pretrained`` writes the safetensors. A tied weight (SmolLM2's
  ``lm_head.weight`` = ``model.embed_tokens.weight``) is therefore stored once, under the name
  transformers keeps, and tied back on load: the folder is the one transformers itself would save.
- :func:`save_adapter`: peft's saved-adapter layout, ``adapter_config.json`` (rank, alpha, target
  modules, ``base_model_name_or_path`` = the base folder) and ``adapter_model.safetensors`` (names
  ``base_model.model.<module>.lora_A.weight``), which ``peft.PeftModel.from_pretrained`` loads on
  the base model.

The tokenizer (:func:`save_tokenizer`) is the base folder's, written by transformers' own
``save_pretrained`` (its files and chat template).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from modelkit.lora import adapter_factors
from protocol import AdapterSpec


def save_full_model(state: Mapping[str, Tensor], base: str | Path, out: str | Path) -> None:
    """Write ``state`` as an HF causal-LM folder (config, safetensors, generation config) into ``out``.

    Args:
        state: ``{HF name: tensor}`` of every weight of the base folder's architecture, one floating
            dtype (the folder's ``dtype``); a weight the config ties to another (``lm_head.weight``)
            may be missing or present, and when present must equal the weight it is tied to.
        base: the model folder whose ``config.json`` (and ``generation_config.json``, when it has
            one) describe the model.
        out: the folder to write (created; existing files of the same names are replaced).

    Raises:
        ValueError: ``state`` lacks a weight of the architecture or holds an unknown name, holds
            several floating dtypes, or a tied weight differs from its source (the message names
            the weight).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    dtypes = sorted({str(t.dtype) for t in state.values() if t.is_floating_point()})
    if len(dtypes) != 1:
        raise ValueError(f"weights: expected one floating dtype, got {dtypes}")
    dtype = getattr(torch, dtypes[0].removeprefix("torch."))
    config = AutoConfig.from_pretrained(base)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tied = model.get_expanded_tied_weights_keys(all_submodels=True)  # {alias: source}
    for alias, source in tied.items():
        if alias in state and source in state and not torch.equal(state[alias], state[source]):
            raise ValueError(f"weights: {alias!r} differs from {source!r}, which the base config ties it to")
    result = model.load_state_dict({k: v for k, v in state.items() if k not in tied}, strict=False, assign=True)
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        what = f"lacks {missing[0]!r}" if missing else f"holds {result.unexpected_keys[0]!r}, unknown to"
        raise ValueError(f"weights: the version {what} the architecture of {base}")
    model.tie_weights()
    if (Path(base) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(base)
    model.save_pretrained(out)


def save_adapter(
    adapter: Mapping[str, Tensor], spec: AdapterSpec, base: str | Path, out: str | Path, dropout: float = 0.0
) -> None:
    """Write a LoRA adapter as a peft folder (``adapter_config.json``, ``adapter_model.safetensors``).

    Args:
        adapter: ``{protocol.adapter_key name: tensor}``, A ``[r, in]`` and B ``[out, r]`` per module.
        spec: rank, alpha and target modules (peft's ``r``, ``lora_alpha``, ``target_modules``).
        base: the base model folder, recorded as ``base_model_name_or_path``.
        out: the folder to write (created).
        dropout: ``lora_dropout`` recorded in the config (peft applies it in training mode only).

    Raises:
        ValueError: a name is not an adapter factor name or a module lacks its A or B.
    """
    from peft import LoraConfig
    from safetensors.torch import save_file

    adapter_factors(adapter)  # names and pairs
    Path(out).mkdir(parents=True, exist_ok=True)
    LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.target_modules),
        lora_dropout=dropout,
        bias="none",
        task_type="CAUSAL_LM",
        inference_mode=True,  # as peft's own save_pretrained records it
        base_model_name_or_path=str(base),
    ).save_pretrained(str(out))
    tensors = {k: adapter[k].detach().contiguous() for k in sorted(adapter)}
    save_file(tensors, str(Path(out) / "adapter_model.safetensors"), metadata={"format": "pt"})


def save_tokenizer(base: str | Path, out: str | Path) -> None:
    """Write the base folder's tokenizer (files and chat template) into ``out`` with transformers."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(base).save_pretrained(out)
