"""How the gateway generates: through the real rollout worker, one prompt-ids request per call.

Each call becomes a :class:`protocol.RolloutRequest` with ``prompt_ids`` (the worker's raw
"continue these ids" request kind): the worker samples it exactly like an in-process rollout, so
every token is stamped with the version that sampled it and a weight update interrupts the call
between two tokens and resumes it under the new version. The finished one-turn
:class:`protocol.Trajectory` carries the prompt (mask 0) followed by the sampled ids (mask 1),
their mu and versions.

:class:`WorkerBackend` works over anything with ``submit(requests) -> int`` and
``poll() -> list[Trajectory]``, both safe to call from two threads at once: a
:class:`rollout.worker.RolloutWorkerCore` (in-process, its own generation thread) or a
``trainer.driver.pool.WorkerPool`` of Ray actors. A dispatcher thread polls while
calls are pending and hands each trajectory to the call waiting for its id; trajectories of other
requests are kept in :attr:`WorkerBackend.foreign` for their owner.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from protocol import RolloutRequest, SamplingParams, Trajectory


class WorkerBackend:
    """Async ``generate(prompt_ids, sampling)`` over a rollout worker (see the module docstring).

    Args:
        submit: ``submit(list[RolloutRequest]) -> int`` of a worker core or pool.
        poll: ``poll() -> list[Trajectory]`` of the same.
        version: the serving policy version (admission and ``admitted_version``).
        poll_interval_s: dispatcher sleep between polls while calls are pending.
    """

    def __init__(
        self,
        submit: Callable[[list[RolloutRequest]], int],
        poll: Callable[[], list[Trajectory]],
        version: Callable[[], int],
        poll_interval_s: float = 0.002,
    ):
        self._submit, self._poll, self.version = submit, poll, version
        self.poll_interval_s = poll_interval_s
        self._waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._has_work = threading.Event()
        self._stop = threading.Event()
        self.foreign: list[Trajectory] = []
        self._thread = threading.Thread(target=self._dispatch, name="vintage-gateway-poll", daemon=True)
        self._thread.start()

    @classmethod
    def over_core(cls, core: Any, **kw) -> WorkerBackend:
        """Backend over an in-process :class:`rollout.worker.RolloutWorkerCore`."""
        return cls(core.submit, core.poll, lambda: core.version, **kw)

    async def generate(
        self, request_id: str, group_id: str, prompt_ids: list[int], sampling: SamplingParams, admitted_version: int
    ) -> Trajectory:
        """Sample one turn after ``prompt_ids``; returns the worker's trajectory for it.

        Raises:
            ValueError: the worker refused the request (the message names the field).
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        req = RolloutRequest(
            request_id=request_id,
            group_id=group_id,
            prompt_ids=prompt_ids,
            sampling=sampling,
            admitted_version=admitted_version,
        )
        self._waiting[request_id] = (loop, fut)
        try:
            await asyncio.to_thread(self._submit, [req])
        except Exception:
            self._waiting.pop(request_id, None)
            raise
        self._has_work.set()
        return await fut

    def _dispatch(self) -> None:
        while not self._stop.is_set():
            if not self._waiting:
                self._has_work.wait(0.05)
                self._has_work.clear()
                continue
            try:
                got = self._poll()
            except Exception as e:  # fail the waiting calls rather than hang them
                for loop, fut in list(self._waiting.values()):
                    loop.call_soon_threadsafe(_fail, fut, RuntimeError(f"worker poll failed: {e!r}"))
                self._waiting.clear()
                continue
            for t in got:
                w = self._waiting.pop(t.trajectory_id, None)
                if w is None:
                    self.foreign.append(t)
                else:
                    w[0].call_soon_threadsafe(_resolve, w[1], t)
            if not got:
                time.sleep(self.poll_interval_s)

    def take_foreign(self) -> list[Trajectory]:
        """Trajectories polled here that belong to no gateway call (requests submitted by others)."""
        out, self.foreign = self.foreign, []
        return out

    def close(self) -> None:
        """Stop the dispatcher thread."""
        self._stop.set()
        self._has_work.set()
        self._thread.join(timeout=5)


def _resolve(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _fail(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
