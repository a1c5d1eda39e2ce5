"""The driver's handle on the learner's ranks: :class:`LearnerGroup` fans every call out to the
``world_size`` :data:`trainer.learner.core.Learner` actors and returns rank 0's answer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch

from modelkit.weights import Transport
from protocol import Trajectory, WeightManifest
from trainer.learner.core import Learner
from trainer.learner.settings import LearnerSettings, free_port


class LearnerGroup:
    """Driver-side handle on ``world_size`` learner actors (one per rank) acting as one learner.

    Rank 0 is pinned to the driver's node, whose IP and a free port there are the rendezvous address;
    all ranks are created at once (DeepSpeed's init is collective). Every call fans out to all ranks
    and returns rank 0's answer.
    """

    def __init__(
        self,
        settings: LearnerSettings,
        world_size: int = 1,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        resources: dict[str, float] | None = None,
        start_timeout_s: float | None = None,
    ) -> None:
        """Raises:
        TimeoutError: the ranks did not start within ``start_timeout_s`` (the actors are killed).
        RuntimeError: Ray cannot place a rank (e.g. resources no node has); the message starts
            with ``learner:``."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        settings = settings.model_copy(
            update={
                "master_addr": ray.util.get_node_ip_address() if world_size > 1 else "127.0.0.1",
                "master_port": free_port(),
            }
        )
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        self.world_size, self.zero_stage = world_size, settings.zero_stage
        self.actors = [
            Learner.options(
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                resources=resources or {},
                scheduling_strategy=here if r == 0 else "DEFAULT",
            ).remote(settings, r, world_size)
            for r in range(world_size)
        ]
        try:  # wait for the collective init
            ray.get([a.get_version.remote() for a in self.actors], timeout=start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            for a in self.actors:
                ray.kill(a)
            raise TimeoutError(
                f"learner: {world_size} rank(s) not started within controller.start_timeout_s = {start_timeout_s} s"
            ) from None
        except ray.exceptions.ActorUnschedulableError as e:
            for a in self.actors:
                ray.kill(a)
            raise RuntimeError(f"learner: cannot be placed ({str(e).splitlines()[0]})") from None

    def _all(self, method: str, *args: Any) -> list[Any]:
        return ray.get([getattr(a, method).remote(*args) for a in self.actors])

    def train_step(self, trajectories: Sequence[Trajectory], old_logits: Any = None) -> dict[str, float]:
        """Every rank gets the same batch (put once in the object store); returns rank 0's metrics."""
        return ray.get(self.async_train_step(trajectories, old_logits))[0]

    def async_train_step(self, trajectories: Sequence[Trajectory], old_logits: Any = None) -> list[ray.ObjectRef]:
        """Launch one step on every rank without waiting: one reference per rank to its metrics
        (rank 0's first; every rank's result must be waited for, a failure shows on any of them).

        ``old_logits``: as for :meth:`LearnerCore.train_step`, or an ``ObjectRef`` to it (e.g. the
        old-logit service's pending answer), handed to the ranks as is: Ray starts the step once it
        is ready, and the driver never copies it.
        """
        traj_ref = ray.put(list(trajectories))
        old_ref = old_logits if isinstance(old_logits, ray.ObjectRef) else ray.put(old_logits)
        return [a.train_step.remote(traj_ref, old_ref) for a in self.actors]

    def publish(self, dtype: str = "float32") -> tuple[WeightManifest, Mapping[str, torch.Tensor]]:
        """Rank 0's publication (under ZeRO-3 every rank takes part in the gather)."""
        if self.zero_stage == 3:
            return self._all("publish", dtype)[0]
        return ray.get(self.actors[0].publish.remote(dtype, False))

    def async_publish(
        self, dtype: str = "float32", transport: Transport = "host", mismatch_std: float = 0.0, mismatch_seed: int = 0
    ) -> tuple[WeightManifest, ray.ObjectRef]:
        """Like :meth:`publish`, but the payload stays in Ray's object store: returns the manifest and
        an ``ObjectRef`` to hand to every consumer, so the driver never copies the weights. The
        learner returns as soon as the payload is stored (``copy=False``: storing it is the one copy).
        ``mismatch_std`` / ``mismatch_seed``: as :meth:`LearnerCore.publish` (injected mismatch)."""
        ranks = self.actors if self.zero_stage == 3 else self.actors[:1]
        refs = [
            a.publish.options(num_returns=2).remote(dtype, False, transport, mismatch_std, mismatch_seed) for a in ranks
        ]
        manifest = ray.get(refs[0][0])
        ray.get([r[0] for r in refs[1:]])  # ZeRO-3: every rank finished its part of the gather
        return manifest, refs[0][1]

    def version(self) -> int:
        return self._all("get_version")[0]

    def status(self) -> dict[str, Any]:
        return self._all("status")[0]

    def save_checkpoint(self, directory: str, extra: dict[str, Any] | None = None) -> str:
        return self._all("save_checkpoint", directory, extra)[0]

    def load_checkpoint(self, directory: str, tag: str | None = None) -> dict[str, Any]:
        return self._all("load_checkpoint", directory, tag)[0]

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a)
        self.actors = []
