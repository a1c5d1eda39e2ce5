"""Publication of the learner's weights: the full fp32 state, the LoRA adapter, and the packed,
versioned payload the rollout workers and the old-logit service apply.

Functions over a learner (:class:`trainer.learner.views.PublishingLearner`; ``LearnerCore``'s
methods of the same names call them): they read the engine's module and settings and record ``core.last_publish``; they never
train, so the learner's step and its publication stay apart.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from modelkit.weights import PackedWeights, Transport, pack_weights, perturbed_weights
from protocol import WeightManifest

if TYPE_CHECKING:
    from trainer.learner.views import PublishingLearner


def state_dict_full(core: PublishingLearner) -> dict[str, torch.Tensor]:
    """CPU fp32 copy of the full weights in HF naming (tied tensors appear under both names).

    With LoRA: the merged weights a consumer runs, ``W0 + (alpha / r) * B @ A`` per adapted
    module (:func:`modelkit.lora.merged_weights`)."""
    with core._full_params():
        if core.settings.lora.enabled:
            from modelkit.lora import adapter_state, base_state, merged_weights

            module = core.engine.module
            state = merged_weights(base_state(module), adapter_state(module), core.settings.lora.spec())
        else:
            state = core.engine.module.state_dict()
        return {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in state.items()}


def adapter_state(core: PublishingLearner) -> dict[str, torch.Tensor]:
    """CPU fp32 copy of the LoRA adapter, ``{protocol.adapter_key name: tensor}`` (A ``[r, in]``,
    B ``[out, r]``).

    Raises:
        ValueError: LoRA is off."""
    if not core.settings.lora.enabled:
        raise ValueError("lora.enabled: false, the learner has no adapter")
    from modelkit.lora import adapter_state

    return {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in adapter_state(core.engine.module).items()}


def publish(
    core: PublishingLearner,
    dtype: str = "float32",
    copy: bool = True,
    transport: Transport = "host",
    mismatch_std: float = 0.0,
    mismatch_seed: int = 0,
) -> tuple[WeightManifest, Mapping[str, torch.Tensor]]:
    """Pack the current weights as version :attr:`version` for the rollout workers and the
    old-logit service (:func:`modelkit.weights.pack_weights`: cast to ``dtype``, tied tensors sent
    once, digest computed once here). Records ``last_publish`` = {seconds, gather_s, pack_s,
    bytes, version}: ``gather_s`` is the time to get whole tensors (the ZeRO-3 all-gather),
    ``pack_s`` the copy/cast and digest.

    ``copy=False`` is for the Ray wrappers (:class:`LearnerGroup`): the actor's return value is
    serialised into the object store before the actor runs its next call, so that copy is the
    private one and the weights are not copied first. Under ZeRO-3 the gathered tensors are
    released on leaving the gather, so a copy is always made there. ``transport="cuda_ipc"``
    (or ``auto`` on a GPU) keeps the payload on the device (:mod:`modelkit.cuda_ipc`); the last
    two such payloads are kept alive here, as their consumers read this process's memory.

    With LoRA only the adapter is packed (:func:`modelkit.lora.pack_adapter`, ``manifest.adapter``
    set): ``rank * (in + out)`` elements per adapted module; consumers merge it into their own base.

    ``mismatch_std`` > 0 publishes perturbed weights (:func:`modelkit.weights.perturbed_weights`
    with seed ``mismatch_seed + version``): a train-inference mismatch injected for experiments,
    drawn here so no one else handles the payload.

    Under ZeRO-3 with several ranks every rank must call it (parameters are gathered).

    Raises:
        ValueError: ``mismatch_std`` < 0, or > 0 with LoRA or a device transport (full host weights only).
    """
    if mismatch_std < 0 or (mismatch_std > 0 and (core.settings.lora.enabled or transport != "host")):
        raise ValueError(f"mismatch_std: {mismatch_std} needs >= 0, and full weights on the host transport when > 0")
    t0 = time.perf_counter()
    if core.settings.lora.enabled:  # ZeRO 0-2 only: the adapter is whole on every rank
        from modelkit.lora import adapter_state, pack_adapter

        named = adapter_state(core.engine.module)
        t1 = time.perf_counter()
        manifest, payload = pack_adapter(named.items(), core.version, core.settings.lora.spec(), dtype)
    else:
        with core._full_params():
            named = core.engine.module.state_dict()
            t1 = time.perf_counter()
            copy = copy or core.settings.zero_stage == 3
            manifest, payload = pack_weights(named.items(), core.version, dtype, copy=copy, transport=transport)
        if mismatch_std > 0:
            manifest, payload = perturbed_weights(manifest, payload, mismatch_std, mismatch_seed + core.version)
        if not isinstance(payload, PackedWeights):  # a device payload: consumers map this memory
            core._device_payloads.append(payload)
            torch.cuda.ipc_collect()
    t2 = time.perf_counter()
    core.last_publish = {
        "seconds": t2 - t0,
        "gather_s": t1 - t0,
        "pack_s": t2 - t1,
        "bytes": float(manifest.total_bytes),
        "version": float(core.version),
    }
    return manifest, payload
