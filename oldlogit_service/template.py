"""The weightless module the old-logit service binds each held version to.

:func:`load_template` loads the model folder once: its module keeps its code and buffers but gives
up its weights (every forward binds a held version's tensors to it with a functional call), and
the folder's weights can become the service's first version. With LoRA adapters the module is the
peft-wrapped model, the base weights are kept once, and a version is an adapter over that base; a
zero adapter is then exactly the base model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from oldlogit_service.store import dedup
from protocol import AdapterSpec


@dataclass
class ScoringTemplate:
    """What :func:`load_template` gives the service."""

    model: torch.nn.Module
    """The module, its parameters emptied and frozen."""
    vocab_size: int
    """Rows of its input embedding."""
    shapes: dict[str, tuple[int, ...]]
    """The shape of every tensor a publication carries, by publication name (the model's, or the adapter's)."""
    folder_version: dict[str, Tensor]
    """The folder's weights as a held version, in the module's names (with adapters: a zero adapter)."""
    base: dict[str, Tensor] = field(default_factory=dict)
    """With adapters: the base weights, kept once, in the wrapped module's names (tied tensors shared)."""


def peft_named(adapter: dict[str, Tensor]) -> dict[str, Tensor]:
    """An adapter's tensors from publication names to the wrapped module's (:func:`modelkit.lora.adapter_to_peft`)."""
    from modelkit.lora import adapter_to_peft

    return {adapter_to_peft(k): t for k, t in adapter.items()}


def load_template(
    model_path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    store_device: torch.device,
    adapter: AdapterSpec | None,
) -> ScoringTemplate:
    """Load ``model_path`` in ``dtype`` onto ``device`` as a :class:`ScoringTemplate`; held tensors
    (the folder's version, the adapter base) go to ``store_device``."""
    from modelkit.lora import peft_to_adapter, peft_to_hf, wrap_lora
    from modelkit.modelhub import load_causal_lm

    model = load_causal_lm(model_path, dtype=str(dtype).removeprefix("torch.")).to(device)
    vocab_size = int(model.get_input_embeddings().weight.shape[0])
    base: dict[str, Tensor] = {}
    if adapter is None:
        state = model.state_dict()
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        folder = {k: v.detach().to(store_device) for k, v in state.items()}  # no copy: the template gives them up
    else:
        model = wrap_lora(model, adapter)
        shapes = {}
        for name, t in model.state_dict().items():
            key = peft_to_adapter(name)
            if key is not None:
                shapes[key] = tuple(t.shape)
            elif peft_to_hf(name) is not None:
                base[name] = t.detach().to(store_device)
        base = dedup(base)
        folder = peft_named({k: torch.zeros(s, dtype=dtype, device=store_device) for k, s in shapes.items()})
    with torch.no_grad():  # the template keeps its code and buffers, not its weights
        for p in model.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    model.requires_grad_(False)
    return ScoringTemplate(model, vocab_size, shapes, folder, base)
