"""Old-logit routes as objects: what the driver loop does differently for each route kind.

The loop calls the same hooks on every route; each route kind answers them its own way:

==================  ============================  ==============================  ===========================
hook                ``none``                      ``snapshot``                    scorer (``old_logit_model``,
                                                                                  ``interrupt_sync``)
==================  ============================  ==============================  ===========================
``attach``          returns the trajectories      returns the trajectories        scores them at the loaded
(on collect)        unchanged                     unchanged                       version (exact ``old_logprobs``)
``async_old_logits``  None                        the submitted call for the      None (already attached)
(per batch)                                       service's per-token answer
``before_publish``  nothing                       nothing                         collects: finished work is
                                                                                  scored before the scorer
                                                                                  moves to the new version
``publish``         workers only                  service and workers at once     workers first (interrupt_sync:
                                                                                  prefixes scored at the outgoing
                                                                                  version), then the scorer
==================  ============================  ==============================  ===========================

The snapshot route's answer is asked for as soon as a batch is taken; the driver takes the next
batch while the learner trains on the current one (version V), so the service scores it then. Its
tokens are at versions <= V, all held; the service runs one call at a time, in order, so the
publication of V+1 reaches it after that request.

A route holds the old-logit service's Ray handle (None on ``none``) and makes every driver call to it
through :class:`oldlogit_service.calls.ServiceCalls` (``calls``), which waits out a restart of the
service; it never owns the buffer or the workers - the loop passes what a hook needs. The route
module also starts the service with its settings (:func:`start_service`) and decides what of a
publication the service installs (:meth:`Route.scorer_publication`, in the learner's dtype).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from rich.console import Console

from oldlogit_service.calls import PendingCall, RestartWait, ServiceCalls
from protocol import OLDLOGIT_ROUTES, OldLogitRequest, Trajectory, WeightManifest

if TYPE_CHECKING:
    from trainer.driver.config.schema import JobConfig

ScorerWeights = tuple[WeightManifest, Any]
"""``(manifest, payload ObjectRef)`` of the publication the old-logit service installs (learner dtype)."""


class Route:
    """An old-logit route: the hooks the loop calls at collect, take, train and publish. This base
    is route ``none`` itself (every hook does nothing: no old-logit service, the learner uses its
    configured proxy for every token); the other routes override what they need."""

    name = "none"
    scorer_dtype = "float32"
    """The dtype the old-logit service holds and scores in: the learner's (``learner.dtype``), so an
    exact pi_old is the learner's own value in bf16 as in fp32 (:func:`make_route` sets it)."""
    background_publish = True
    """Whether a publication is applied in the background while the loop goes on (the consumers'
    switch does not have to be in step with collection); False keeps the loop waiting for it."""

    def __init__(self, oldlogit: Any = None, restart_timeout_s: float = 600.0) -> None:
        self.oldlogit = oldlogit
        self.calls = None if oldlogit is None else ServiceCalls(oldlogit, RestartWait(restart_timeout_s))
        """The driver's calls to the service (None without one)."""

    def scorer_publication(
        self, rollout: ScorerWeights, rollout_dtype: str, publish: Callable[[str], ScorerWeights], perturbed: bool
    ) -> ScorerWeights | None:
        """What the service installs of a publication: None without a service; the rollout
        workers' publication ``rollout`` when it is in :attr:`scorer_dtype` and not perturbed;
        otherwise a publication of its own, ``publish(scorer_dtype)``."""
        if self.oldlogit is None:
            return None
        return rollout if rollout_dtype == self.scorer_dtype and not perturbed else publish(self.scorer_dtype)

    def service_record(self) -> dict[str, float]:
        """The service's restart and outage counters so far (:meth:`ServiceCalls.record`); {} without one."""
        return self.calls.record() if self.calls is not None else {}

    @property
    def worker_scorer(self) -> Any:
        """The service handle rollout workers score their interrupted prefixes with (None here)."""
        return None

    def attach(self, got: list[Trajectory], temperature: float) -> list[Trajectory]:
        """Finished trajectories as they enter the buffer (unchanged here)."""
        return got

    def async_old_logits(self, batch: Sequence[Trajectory], version: int, temperature: float) -> PendingCall | None:
        """The submitted call for the per-token exact ``pi_old`` of ``batch`` (None: nothing to ask for)."""
        return None

    def before_publish(self, collect: Callable[[], None]) -> None:
        """Called after an applied learner step, before the new version is published (nothing here)."""

    def publish(self, update_workers: Callable[[], Any], scorer_weights: ScorerWeights | None) -> None:
        """Install a publication: the rollout workers' update (``update_workers``) and the service's."""
        update_workers()


class SnapshotRoute(Route):
    """Route ``snapshot``: the service keeps every version in ``[V - W, V]`` and answers per batch."""

    name = "snapshot"

    def __init__(
        self,
        oldlogit: Any,
        restart_timeout_s: float = 600.0,
        learner_gives_current: bool = False,
        reference_version: int | None = None,
    ) -> None:
        super().__init__(oldlogit, restart_timeout_s)
        self.learner_gives_current = learner_gives_current
        """The consuming learner supplies pi_old of its own version's tokens
        (:func:`trainer.algorithm.batch.learner_gives_current`): the service scores only older ones."""
        self.reference_version = reference_version
        """The version the service keeps pinned as the KL penalties' reference: every request also
        asks for its log-probs of the batch's sampled tokens (None: the learner scores its own)."""

    def async_old_logits(self, batch: Sequence[Trajectory], version: int, temperature: float) -> PendingCall:
        from oldlogit_service.items import items_before, items_from_trajectories

        items = items_before(batch, version) if self.learner_gives_current else items_from_trajectories(batch)
        ref = {}
        if self.reference_version is not None:
            ref = {"reference_version": self.reference_version, "reference_masks": [t.loss_mask for t in batch]}
        return self.calls.submit(
            "score", OldLogitRequest(request_id=f"step-{version}", temperature=temperature, items=items, **ref)
        )

    def publish(self, update_workers: Callable[[], Any], scorer_weights: ScorerWeights | None) -> None:
        # the service and the workers take the same publication concurrently
        pending = self.calls.submit("update_weights", *scorer_weights)
        update_workers()
        pending.result()


class ScorerRoute(Route):
    """Routes ``old_logit_model`` and ``interrupt_sync``: one scorer replica at the newest version.

    Finished trajectories are scored on collect, so they must be collected before the scorer moves
    on; on ``interrupt_sync`` the workers also score their in-flight prefixes at the outgoing
    version during their weight update, so the workers are updated before the scorer.
    """

    background_publish = False

    def __init__(self, name: str, oldlogit: Any, restart_timeout_s: float = 600.0) -> None:
        super().__init__(oldlogit, restart_timeout_s)
        self.name = name

    @property
    def worker_scorer(self) -> Any:
        return self.oldlogit if self.name == "interrupt_sync" else None

    def attach(self, got: list[Trajectory], temperature: float) -> list[Trajectory]:
        if not got:
            return got
        return self.calls.call("attach_old_logprobs", got, temperature)

    def before_publish(self, collect: Callable[[], None]) -> None:
        collect()

    def publish(self, update_workers: Callable[[], Any], scorer_weights: ScorerWeights | None) -> None:
        update_workers()
        self.calls.call("update_weights", *scorer_weights)


def make_route(
    name: str,
    oldlogit: Any,
    restart_timeout_s: float = 600.0,
    current_from_learner: bool = False,
    scorer_dtype: str = "float32",
    reference_version: int | None = None,
) -> Route:
    """The route object for ``loss.oldlogit_route`` ``name`` around the service handle ``oldlogit``;
    its calls wait at most ``restart_timeout_s`` seconds for a restarting service (:class:`RestartWait`);
    ``current_from_learner``: the learner gives its own version's pi_old, so the snapshot route asks
    the service only for older tokens (:attr:`trainer.driver.config.schema.JobConfig.current_from_learner`);
    ``scorer_dtype``: the learner's dtype, the one the service is fed and scores in;
    ``reference_version``: the snapshot route asks the service for the KL reference's log-probs of
    every batch too (:attr:`trainer.driver.config.schema.OldLogitConfig.score_reference`).

    Raises:
        ValueError: an unknown route name, a route other than ``none`` without a service handle,
            or a ``reference_version`` off the snapshot route.
    """
    if reference_version is not None and name != "snapshot":
        raise ValueError(f"oldlogit.score_reference: needs the snapshot route, not {name!r}")
    if name == "none":
        route = Route(oldlogit, restart_timeout_s)
    elif oldlogit is None:
        raise ValueError(f"oldlogit_route: {name!r} needs a running old-logit service")
    elif name == "snapshot":
        route = SnapshotRoute(oldlogit, restart_timeout_s, current_from_learner, reference_version)
    elif name in ("old_logit_model", "interrupt_sync"):
        route = ScorerRoute(name, oldlogit, restart_timeout_s)
    else:
        raise ValueError(f"oldlogit_route: {name!r} is not one of {', '.join(OLDLOGIT_ROUTES)}")
    route.scorer_dtype = scorer_dtype
    return route


def start_service(cfg: JobConfig, model_path: Path, console: Console) -> Any:
    """The old-logit service's Ray handle, started and ready; None on the ``none`` route. Its
    settings come from the route and the job: ``loss.oldlogit_route``, the versions it keeps
    (``controller.max_staleness``), ``oldlogit.memory_budget_bytes``, the LoRA adapter spec,
    ``learner.dtype`` and ``learner.pack_sequences`` (the learner's numerics: an exact pi_old is the
    learner's own value), and its threads and CPU priority
    (:meth:`JobConfig.thread_plan`: ``oldlogit.threads``, ``machine.yield_to_learner``).

    Raises:
        TimeoutError: not ready within ``controller.start_timeout_s`` (the actor is killed).
    """
    from oldlogit_service.actor import OldLogitServer

    if cfg.oldlogit_route == "none":
        return None
    c, plan = cfg.controller, cfg.thread_plan()
    with console.status(f"starting old-logit service ({cfg.oldlogit_route}) ..."):
        restarts = cfg.oldlogit.max_restarts
        oldlogit = OldLogitServer.options(
            **cfg.oldlogit.actor_options(), max_restarts=restarts, max_task_retries=restarts
        ).remote(
            str(model_path),
            **cfg.oldlogit_service_options(),
            torch_threads=plan.oldlogit,
            yield_cpu=plan.yield_to_learner,
        )
        try:
            ray.get(oldlogit.ready.remote(), timeout=c.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(oldlogit)
            raise TimeoutError(
                f"old-logit service: not started within controller.start_timeout_s = {c.start_timeout_s} s"
            ) from None
    return oldlogit
