"""What the learner's checkpoint and publication functions read and set on a learner, as typing
protocols: :class:`trainer.learner.core.LearnerCore` satisfies both, and the functions
(:mod:`trainer.learner.checkpoint`, :mod:`trainer.learner.publication`) need not import it, so
``core`` imports them and nothing imports ``core`` back."""

from __future__ import annotations

from collections import deque
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from trainer.algorithm.entropy_control import EntropyControl
    from trainer.algorithm.ewma import EwmaProximal
    from trainer.learner.settings import LearnerSettings


class CheckpointedLearner(Protocol):
    """A learner as :func:`trainer.learner.checkpoint.save_checkpoint` and ``load_checkpoint`` see
    it: its DeepSpeed engine, settings, EWMA, version and step counters, and its rank."""

    engine: Any
    settings: LearnerSettings
    ewma: EwmaProximal | None
    version: int
    optimizer_steps: int
    skipped_steps: int
    entropy_control: EntropyControl
    rank: int
    world_size: int


class PublishingLearner(Protocol):
    """A learner as :mod:`trainer.learner.publication` sees it: its engine and settings, the
    version it publishes, the last publication's record and the device payloads consumers may still
    read, and a context in which its parameters are whole tensors."""

    engine: Any
    settings: LearnerSettings
    version: int
    last_publish: dict[str, float]
    _device_payloads: deque

    def _full_params(self) -> AbstractContextManager: ...
