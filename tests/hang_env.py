"""A test-only environment that hangs one rollout worker: the first ``step`` of the whole test (the
one that creates the file ``marker``) never returns; every other episode is
:class:`rollout.envs.toy.AlphabetEnv`. The hanging step holds its worker's generation lock, so that
worker answers no call again: alive, but hung."""

from __future__ import annotations

import os
import time
from typing import Any

from rollout.envs.toy import AlphabetEnv


class HangOnceEnv(AlphabetEnv):
    """:class:`AlphabetEnv` whose first step across every process (``marker`` created) sleeps forever."""

    def __init__(self, marker: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.marker = marker

    def step(self, action: str) -> Any:
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return super().step(action)
        while True:
            time.sleep(3600)
