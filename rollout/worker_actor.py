"""The rollout worker's Ray actor: :class:`RolloutWorkerActor` builds an engine and runs a
:class:`rollout.worker.RolloutWorkerCore` in its own thread; :data:`RolloutWorker` is its
``ray.remote`` class. Every method passes through to the core."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ray

from oldlogit_service.calls import RestartWait, ServiceCalls
from protocol import RolloutRequest, Trajectory, WeightManifest, WorkerStatus
from rollout.engine import EngineConfig, make_engine
from rollout.worker import RolloutWorkerCore


class RolloutWorkerActor:
    """Ray actor body: builds its engine from an :class:`EngineConfig` and runs the core's thread.

    ``oldlogit=handle`` (interrupt_sync route) scores the prefixes with
    ``handle.score_prefixes(items, temperature, known)`` at the outgoing version and attaches them;
    each such call waits out a restart of the service for at most ``oldlogit_restart_timeout_s``
    seconds (:class:`oldlogit_service.calls.ServiceCalls`), then the weight update fails.

    ``torch_threads``: the generation thread's torch threads (None: the process's). ``yield_cpu``:
    the whole process runs at idle CPU priority (:func:`modelkit.cores.yield_cpu`, set before the
    engine starts, so every thread it creates inherits it).
    """

    def __init__(
        self,
        engine_config: EngineConfig | dict,
        worker_id: str = "rollout-0",
        max_num_seqs: int = 64,
        autostart: bool = True,
        oldlogit: Any = None,
        oldlogit_restart_timeout_s: float = 600.0,
        torch_threads: int | None = None,
        yield_cpu: bool = False,
    ):
        if yield_cpu:
            from modelkit.cores import yield_cpu as to_idle

            to_idle()
        cfg = engine_config if isinstance(engine_config, EngineConfig) else EngineConfig.model_validate(engine_config)
        scorer = None
        if oldlogit is not None:
            calls = ServiceCalls(oldlogit, RestartWait(oldlogit_restart_timeout_s))

            def scorer(items, temperature, known):
                return calls.call("score_prefixes", items, temperature, known)

        self.core = RolloutWorkerCore(
            make_engine(cfg), worker_id=worker_id, max_num_seqs=max_num_seqs, score_prefixes=scorer,
            torch_threads=torch_threads,
        )  # fmt: skip
        self.engine_start_seconds = getattr(self.core.engine, "start_seconds", None)
        if autostart:
            self.core.start()

    def ready(self) -> dict[str, Any]:
        """Blocks until built; returns ``{"worker_id", "version", "engine_start_seconds"}``."""
        return {
            "worker_id": self.core.worker_id,
            "version": self.core.version,
            "engine_start_seconds": self.engine_start_seconds,
        }

    def submit(self, requests: list[RolloutRequest]) -> int:
        return self.core.submit(requests)

    def poll(self, max_items: int | None = None) -> list[Trajectory]:
        return self.core.poll(max_items)

    def update_weights(self, manifest: WeightManifest, payload: Mapping[str, Any]) -> int:
        return self.core.update_weights(manifest, payload)

    def status(self) -> WorkerStatus:
        return self.core.status()

    def fingerprint(self) -> dict[str, Any]:
        return self.core.fingerprint()

    def start(self) -> None:
        self.core.start()

    def stop(self, abort_in_flight: bool = False) -> None:
        self.core.stop(abort_in_flight)

    def close(self) -> None:
        self.core.close()


RolloutWorker = ray.remote(num_cpus=1)(RolloutWorkerActor)
"""Ray actor of :class:`RolloutWorkerActor`: ``RolloutWorker.remote(engine_config, worker_id=...)``."""
