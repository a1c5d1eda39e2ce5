"""Metric trackers: one interface, one class per kind, chosen once in ``logging.trackers``.

Every tracker gets each step's finite numeric fields under the names ``metrics.jsonl`` uses
(:func:`scalars`; booleans, histograms and non-finite values stay in ``metrics.jsonl`` only), with
the step of its row (the learner's version after the step). The packages are imported only by the
tracker that needs them.

- ``tensorboard``: event files under ``<run_dir>/tensorboard``.
- ``wandb``: a Weights & Biases run under ``<run_dir>/wandb``, offline unless ``WANDB_MODE`` is
  set (the job never needs the network; ``wandb sync <run_dir>/wandb/offline-run-*`` uploads it
  later); the resolved config is the run's config.
- ``mlflow``: an MLflow run in the experiment ``logging.project``, in a file store under
  ``<run_dir>/mlruns`` unless ``MLFLOW_TRACKING_URI`` is set; the resolved config is logged as the
  artifact ``config.resolved.json``.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from trainer.driver.config.schema import LoggingConfig


class Tracker(Protocol):
    """Where step metrics go besides ``metrics.jsonl``."""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Record ``scalars`` (name -> finite float) at ``step``."""

    def close(self) -> None:
        """Flush and finish the run."""


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a ``metrics.jsonl`` row (booleans, dicts, strings and NaN left out)."""
    return {
        k: float(v)
        for k, v in row.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


class TensorBoardTracker:
    """TensorBoard event files under ``<run_dir>/tensorboard``."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A Weights & Biases run under ``<run_dir>/wandb``: ``WANDB_MODE`` if set, else offline."""

    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict[str, Any]):
        self.wandb = wandb = _import("wandb", "wandb")
        self.run = wandb.init(
            project=project,
            name=run_name,
            dir=str(run_dir),
            config=config,
            mode=os.environ.get("WANDB_MODE", "offline"),
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
        self.wandb.teardown()  # finish() can return before the run's file is written; this waits for it


class MlflowTracker:
    """An MLflow run in experiment ``project``: at ``MLFLOW_TRACKING_URI`` if set, else in a file
    store under ``<run_dir>/mlruns``."""

    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict[str, Any]):
        tracking = _import("mlflow.tracking", "mlflow")
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:  # MLflow 3 keeps the file store behind this switch
            uri = (Path(run_dir) / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.uri = uri
        self.client = tracking.MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(project)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(project)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        self.client.log_dict(self.run_id, config, "config.resolved.json")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, ms, step) for k, v in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _import(module: str, kind: str):
    """Import ``module`` for the tracker ``kind``.

    Raises:
        ImportError: the package is missing (the message names ``logging.trackers`` and the extra).
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"logging.trackers: {kind!r} needs the {kind} package (pip install 'vintage[trackers]')"
        ) from None


def start_trackers(logging: LoggingConfig, config: dict[str, Any] | None = None) -> list[Tracker]:
    """The trackers ``logging.trackers`` names, started, for the run folder ``logging.run_dir``;
    ``config``: the resolved config (the W&B run's config, the MLflow run's artifact).

    Raises:
        ImportError: a chosen tracker's package is not installed.
    """
    run_dir = Path(logging.run_dir)
    run_name = logging.run_name or run_dir.resolve().name
    out: list[Tracker] = []
    try:
        for kind in logging.trackers:
            if kind == "tensorboard":
                out.append(TensorBoardTracker(run_dir))
            elif kind == "wandb":
                out.append(WandbTracker(run_dir, logging.project, run_name, config or {}))
            else:
                out.append(MlflowTracker(run_dir, logging.project, run_name, config or {}))
    except BaseException:
        for t in out:
            t.close()
        raise
    return out
