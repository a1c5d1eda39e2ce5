"""The DeepSpeed learner: :class:`LearnerCore` (one DeepSpeed rank), :data:`Learner` (its Ray actor,
one per data-parallel rank), :class:`LearnerGroup` (every rank, one call each), checkpoints, the
CPU comm op build and the LoRA settings.

Invariants: one DeepSpeed rank per actor; the version is bumped only by an applied optimizer step
(a skipped, non-finite step changes no weight, no optimizer state and no version); imports
:mod:`trainer.algorithm`, never :mod:`trainer.driver`.

The names below are re-exported from :mod:`trainer.learner.core`, ``group``, ``rollback`` and ``settings`` on first use, so importing a
light submodule (``trainer.learner.lora_config``, ``trainer.learner.ds_ops``) does not import Ray,
torch or DeepSpeed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.learner.core import Learner, LearnerCore
    from trainer.learner.group import LearnerGroup
    from trainer.learner.rollback import OptimizerRollback
    from trainer.learner.settings import LearnerOptions, LearnerSettings, free_port

__all__ = [
    "Learner",
    "LearnerCore",
    "LearnerGroup",
    "LearnerOptions",
    "LearnerSettings",
    "OptimizerRollback",
    "free_port",
]


_HOMES = {
    "LearnerGroup": "group", "OptimizerRollback": "rollback",
    "LearnerOptions": "settings", "LearnerSettings": "settings", "free_port": "settings",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in __all__:
        import importlib

        return getattr(importlib.import_module(f"trainer.learner.{_HOMES.get(name, 'core')}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
