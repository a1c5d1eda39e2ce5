"""``OldLogitServer``: the Ray actor around :class:`oldlogit_service.service.OldLogitService`.

A thin wrapper: every public method of the plain class is an actor method with the same
arguments and results (protocol messages and numpy arrays travel through Ray's object store).
Pass the weight payload as an ``ObjectRef`` from ``ray.put`` (resolved by Ray before the call), so
one published payload is shared with every consumer. Calls run one at a time, in order, so an
interrupt_sync driver that calls ``score_prefixes`` then ``update_weights`` gets the outgoing
version for the prefixes.

Example::

    server = OldLogitServer.options(num_cpus=0.5).remote(str(folder), route="snapshot", max_staleness=2)
    ray.get(server.update_weights.remote(manifest, ray.put(payload)))
    answer = ray.get(server.score.remote(request))
"""

from __future__ import annotations

import os
from typing import Any

import ray

from oldlogit_service.service import OldLogitService


class _OldLogitActorBody(OldLogitService):
    """:class:`OldLogitService` plus the actor-only bits: thread count and CPU priority, a readiness
    probe, and an empty start after a restart.

    A process Ray restarts (``max_restarts``) runs the constructor again with the same arguments; it
    then holds no version (``initial_version=None``) until the next publication: nothing held before
    the restart is assumed, and tokens of those versions are answered ``missing``. The one exception
    is a pinned initial version (``pin_initial``, the KL reference): it is the model folder's weights,
    loaded again as they were (:func:`restart_kwargs`).
    """

    def __init__(self, *args: Any, torch_threads: int | None = None, yield_cpu: bool = False, **kwargs: Any) -> None:
        import torch

        if yield_cpu:  # idle CPU priority for every thread, those created later included
            from modelkit.cores import yield_cpu as to_idle

            to_idle()
        torch.set_num_threads(torch_threads or int(os.environ.get("OMP_NUM_THREADS", "1")))
        super().__init__(*args, **restart_kwargs(kwargs, ray.get_runtime_context().was_current_actor_reconstructed))

    def ready(self) -> bool:
        """True once the model is loaded (``ray.get(server.ready.remote())`` waits for it)."""
        return True


def restart_kwargs(kwargs: dict[str, Any], reconstructed: bool) -> dict[str, Any]:
    """The constructor's keyword arguments for a process that Ray started again: no initial version
    (nothing held before the restart is assumed) unless it is pinned (``pin_initial``: the folder's
    own weights, the same after a restart); ``kwargs`` unchanged for a first start."""
    if reconstructed and not kwargs.get("pin_initial"):
        return {**kwargs, "initial_version": None}
    return kwargs


OldLogitServer = ray.remote(num_cpus=0.5, max_restarts=0)(_OldLogitActorBody)
"""Ray actor class: ``OldLogitServer.remote(model_path, route=..., max_staleness=..., memory_budget_bytes=...,
device=..., dtype=..., initial_version=..., torch_threads=None, yield_cpu=False)``; same methods as
OldLogitService. ``yield_cpu`` runs the server at idle CPU priority (:func:`modelkit.cores.yield_cpu`)."""


def start_server(
    model_path: str,
    route: str = "snapshot",
    max_staleness: int = 2,
    memory_budget_bytes: int | None = None,
    num_cpus: float = 0.5,
    name: str | None = None,
    **kwargs: Any,
) -> Any:
    """Start an :data:`OldLogitServer` and wait until its model is loaded; returns the actor handle.

    Raises:
        ray.exceptions.RayActorError: the constructor failed (e.g. an unknown ``route``); the
            original ``ValueError`` text names the argument.
    """
    opts: dict[str, Any] = {"num_cpus": num_cpus}
    if name:
        opts["name"] = name
    handle = OldLogitServer.options(**opts).remote(
        str(model_path), route=route, max_staleness=max_staleness, memory_budget_bytes=memory_budget_bytes, **kwargs
    )
    ray.get(handle.ready.remote())
    return handle
