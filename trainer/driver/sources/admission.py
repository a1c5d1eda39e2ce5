"""The staleness window that admission counts with, narrowed while trajectories go stale.

:func:`trainer.driver.sources.buffer.admission_capacity` keeps every trajectory within
``max_staleness`` only while batches take trajectories in the order they were admitted. Agent
sessions that finish out of order, and a batch taken ahead for the next version, break that order:
a session that arrives after the batch it was counted for has been taken goes stale, and its drop
frees an admission place for new work, so a producer faster than the learner keeps producing
work that goes stale. :class:`AdmissionWindow` closes that loop: each learner version that saw a
stale drop narrows the window admission counts with by one (down to 0, the synchronous rule:
one batch per version, which can always progress), and ``recover_after`` versions in a row
without one widen it by one (up to ``max_staleness``), as additive-increase / decrease congestion
control does with a sending window (Jacobson 1988). The bound the buffer enforces is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol import NO_VERSION


@dataclass
class AdmissionWindow:
    """The window of :func:`admission_capacity`, in versions, between 0 and ``max_staleness``.

    Args:
        max_staleness: the bound (``controller.max_staleness``); the window starts there.
        recover_after: learner versions in a row without a stale drop before the window widens by one (>= 1).

    Example: bound 2, ``recover_after`` 2; stale drops seen at versions 5 and 6, none after: the
    window is 2 until version 5, 1 at 5, 0 at 6, 0 at 7, 1 at 8, 1 at 9, 2 at 10.

    Raises:
        ValueError: ``max_staleness < 0`` or ``recover_after < 1`` (the message names the value).
    """

    max_staleness: int
    recover_after: int = 4
    window: int = field(init=False)
    _version: int = field(default=NO_VERSION, init=False)
    _stale_seen: int = field(default=0, init=False)
    _quiet: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {self.max_staleness}")
        if self.recover_after < 1:
            raise ValueError(f"controller.admission_recover_after: must be >= 1, got {self.recover_after}")
        self.window = self.max_staleness

    def update(self, version: int, stale_total: int) -> int:
        """The window at learner ``version``, given the run's stale drops so far (``stale_total``);
        it moves at most once per version (the first call at a new version)."""
        if version == self._version:
            return self.window
        new_stale = stale_total > self._stale_seen
        self._version, self._stale_seen = version, stale_total
        if new_stale:
            self.window, self._quiet = max(0, self.window - 1), 0
        else:
            self._quiet += 1
            if self._quiet >= self.recover_after and self.window < self.max_staleness:
                self.window, self._quiet = self.window + 1, 0
        return self.window
