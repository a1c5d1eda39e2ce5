"""The building blocks of every config section: unknown fields and non-finite numbers refused,
thread settings, and an actor group's Ray placement. Imports no other module of the driver."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from modelkit.cores import AUTO


class Section(BaseModel):
    """Unknown fields and non-finite numbers (NaN, +-inf) are refused in every section."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _threads(v: Any) -> Any:
    if v == AUTO or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        return v
    raise ValueError('must be "auto" or a whole number >= 1')


def auto_or_bool(v: Any) -> Any:
    """``v`` when it is ``"auto"`` or a bool (a ``BeforeValidator``).

    Raises:
        ValueError: anything else.
    """
    if v == AUTO or isinstance(v, bool):
        return v
    raise ValueError('must be "auto", true or false')


ThreadsSetting = Annotated[int | Literal["auto"], BeforeValidator(_threads)]
"""Torch intra-op threads of one process: a whole number >= 1, or ``"auto"`` (:func:`modelkit.cores.plan_threads`)."""


class Placement(Section):
    """Where an actor group runs: Ray CPUs, GPUs and custom resources per actor."""

    num_cpus: float = Field(1.0, ge=0.0)
    """Ray CPUs reserved by each actor of this group."""
    num_gpus: float = Field(0.0, ge=0.0)
    """GPUs reserved by each actor (0 on CPU machines)."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Ray custom resources per actor, e.g. ``{rollout = 1}`` to pin a group to its KubeRay worker group."""

    def actor_options(self) -> dict:
        """``.options(...)`` keyword arguments for one actor of this group."""
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "resources": dict(self.resources)}
