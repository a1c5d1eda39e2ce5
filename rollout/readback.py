"""Read sampled weight values back from a loaded vLLM model, in HF names (for the served fingerprint).

vLLM holds some HF tensors inside fused modules (``qkv_proj`` = ``q_proj``, ``k_proj``, ``v_proj``
stacked along the output rows; ``gate_up_proj`` = ``gate_proj``, ``up_proj``; the model class's
``packed_modules_mapping`` and each fused layer's ``output_sizes`` say where), and on CPU it repacks
every linear weight for its GEMM kernel after loading and leaves an empty ``weight`` parameter. A
linear whose weight is gone is read through the kernel it computes with: one-hot input rows
``e_c`` give ``cpu_linear(e_c) = W[:, c]`` (products with 1 and sums of zeros are exact, in fp32
and in bf16 with fp32 accumulation), so the values read are the ones the engine multiplies with.

The positions are :func:`modelkit.fingerprint.sample_positions` of the HF tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from modelkit.fingerprint import sample_positions


def _locate(model: torch.nn.Module, hf_name: str) -> tuple[torch.nn.Module, str, int]:
    """``(module, parameter name, first output row)`` holding ``hf_name`` in the vLLM model.

    Raises:
        KeyError: no module of the model holds the tensor (the message names it).
    """
    mods = dict(model.named_modules())
    path, attr = hf_name.rsplit(".", 1)
    if path in mods:
        return mods[path], attr, 0
    prefix, leaf = path.rsplit(".", 1) if "." in path else ("", path)
    for fused, parts in getattr(model, "packed_modules_mapping", {}).items():
        name = f"{prefix}.{fused}" if prefix else fused
        if leaf in parts and name in mods:
            sizes = list(getattr(mods[name], "output_sizes", []))
            k = parts.index(leaf)
            if len(sizes) != len(parts):
                raise KeyError(f"{hf_name!r}: fused module {name!r} has output_sizes {sizes} for parts {parts}")
            return mods[name], attr, sum(sizes[:k])
    raise KeyError(f"{hf_name!r}: no module of the vLLM model holds it")


def _probe_columns(mod: torch.nn.Module, cols: torch.Tensor, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """``W[:, cols].T`` ``[len(cols), out_total]`` through the layer's CPU kernel (one-hot inputs)."""
    x = torch.zeros(len(cols), in_features, dtype=dtype)
    x[torch.arange(len(cols)), cols] = 1
    return mod.cpu_linear(x, mod.weight, None)


def read_samples(
    model: torch.nn.Module, shapes: Mapping[str, Sequence[int]], dtype: torch.dtype
) -> dict[str, list[float]]:
    """``{hf_name: values at sample_positions}`` (float64 Python floats) read from the loaded model.

    Args:
        model: vLLM's model (``model_runner.get_model()``) after loading.
        shapes: ``{hf_name: HF shape}`` of the tensors to read (e.g. the checkpoint's).
        dtype: the engine's dtype (the one-hot probes are built in it).

    Raises:
        KeyError: a tensor is not found in the model (the message names it).
    """
    out: dict[str, list[float]] = {}
    for name, shape in shapes.items():
        mod, attr, row0 = _locate(model, name)
        numel = 1
        for d in shape:
            numel *= int(d)
        pos = torch.from_numpy(sample_positions(name, numel))
        p = mod._parameters.get(attr)
        if p is not None and p.numel() > 0:
            if len(shape) == 2:
                r, c = pos // int(shape[1]), pos % int(shape[1])
                vals = p.detach()[(r + row0).to(p.device), c.to(p.device)]
            else:
                vals = p.detach().reshape(-1)[pos.to(p.device)]
        elif attr == "weight" and len(shape) == 2 and hasattr(mod, "cpu_linear"):
            r, c = pos // int(shape[1]), pos % int(shape[1])
            cols, inv = torch.unique(c, return_inverse=True)
            y = _probe_columns(mod, cols, int(shape[1]), dtype)
            vals = y[inv, r + row0]
        else:
            raise KeyError(f"{name!r}: {type(mod).__name__}.{attr} holds no values to read")
        out[name] = vals.to(device="cpu", dtype=torch.float64).tolist()
    return out
