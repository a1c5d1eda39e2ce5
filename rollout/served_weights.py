"""What a rollout worker knows of the weights its engine serves: the fingerprint read back from the
engine, that of the tensors it handed over at the last update, and the pristine base weights an
adapter publication is merged into (:mod:`modelkit.fingerprint`, :mod:`modelkit.lora`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from protocol import AdapterSpec
from rollout.engine import GenerationEngine


class ServedWeights:
    """The fingerprints of one engine's weights and the base its adapters merge into.

    Args:
        engine: the worker's engine.
        on_error: called with a one-line message when the engine's weights cannot be read back.

    Attributes:
        served: fingerprint read back from the engine after the last update (and at the start);
            None when it cannot be read.
        applied: fingerprint of the tensors handed to the engine at the last update (None before
            one, or for an engine without a checkpoint folder to name its weights).
    """

    def __init__(self, engine: GenerationEngine, on_error: Callable[[str], None]) -> None:
        self.engine, self._on_error = engine, on_error
        self.base: dict[str, Any] | None = None
        """The pristine base weights in the engine's dtype, loaded at the first adapter."""
        self.applied: str | None = None
        self.served: str | None = self.read_served()

    def read_served(self) -> str | None:
        """The engine's own fingerprint of what it serves, or None (and ``on_error``) when reading
        it back fails: an engine that cannot be read back serves unknown weights."""
        try:
            return self.engine.served_fingerprint()
        except Exception as e:
            self._on_error(f"served_fingerprint failed: {e!r}")
            return None

    def record_update(self, named: Mapping[str, Any]) -> None:
        """After the engine took ``named`` (``{hf_name: tensor}``): set :attr:`applied` from those
        tensors and :attr:`served` from the engine."""
        from modelkit.fingerprint import weights_fingerprint

        try:
            names = self.engine.expected_weights()
        except (FileNotFoundError, OSError):  # an engine without a checkpoint folder (test fakes)
            self.applied = None
        else:
            self.applied = weights_fingerprint({n: named[n] for n in names}, self.engine.config.dtype)
        self.served = self.read_served()

    def merged_adapter(self, adapter: Mapping[str, Any], spec: AdapterSpec) -> dict[str, Any]:
        """Full weights ``W0 + (alpha / r) * B @ A`` of an adapter version, from the kept base.

        The base (the engine's model folder, cast to the engine dtype) is loaded at the first call
        and kept unchanged: merging is always from it, never cumulative.

        Raises:
            ValueError: the adapter does not fit the base (names, shapes; the message names the module).
        """
        import torch

        from modelkit.lora import load_base_weights, merged_weights

        if self.base is None:
            dtype = getattr(torch, self.engine.config.dtype)
            self.base = {k: v.to(dtype) for k, v in load_base_weights(self.engine.config.model_path).items()}
        return merged_weights(self.base, adapter, spec)
