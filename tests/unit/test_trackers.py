"""Trackers (``logging.trackers``): TensorBoard, Weights & Biases (offline, no network) and MLflow
(a file store in the run folder) each log two steps into a temporary run folder, read back and
checked against the values logged; every tracker gets the names ``metrics.jsonl`` uses; the
config refuses the old ``logging.tensorboard`` and a tracker named twice in one line."""

from __future__ import annotations

import json
import struct
import sys

import pydantic
import pytest

from trainer.driver.config.schema import load_config
from trainer.driver.records.metrics_log import MetricsLog, read_metrics
from trainer.driver.records.trackers import MlflowTracker, TensorBoardTracker, WandbTracker, scalars, start_trackers

STEPS = {1: {"loss": 0.5, "reward_mean": 0.25}, 2: {"loss": -0.125, "reward_mean": 0.75}}


@pytest.fixture
def no_network_env(monkeypatch):
    """No tracking server or W&B mode from the outside; MLflow's file-store switch restored after."""
    for name in ("WANDB_MODE", "WANDB_DIR", "WANDB_API_KEY", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # the tracker sets it; the test's end removes it


def wandb_history(path) -> dict[int, dict[str, float]]:
    """``{step: {name: value}}`` of an offline ``run-*.wandb`` file: a 7-byte W&B header, then
    LevelDB-log records (32 KiB blocks, 7-byte record headers: crc, length, type) of protobuf
    ``Record`` messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, part, out = 7, b"", {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's trailer
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        part += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            r = pb.Record()
            r.ParseFromString(part)
            part = b""
            if r.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                out[r.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return out


def test_scalars_keep_finite_numbers_only():
    row = {"loss": 0.5, "tokens": 3, "applied": True, "hist": {0: 1}, "grad_norm": float("nan"), "method": "x"}
    assert scalars(row) == {"loss": 0.5, "tokens": 3.0}


def test_tensorboard_logs_two_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = TensorBoardTracker(tmp_path)
    for step, values in STEPS.items():
        t.log(step, values)
    t.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 0.5), (2, -0.125)]
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(1, 0.25), (2, 0.75)]


def test_wandb_logs_two_steps_offline(tmp_path, no_network_env):
    t = WandbTracker(tmp_path, "vintage-test", "run-a", {"controller": {"total_steps": 2}})
    for step, values in STEPS.items():
        t.log(step, values)
    t.close()
    (run,) = (tmp_path / "wandb").glob("offline-run-*")  # offline: `wandb sync` uploads it later
    (records,) = run.glob("run-*.wandb")
    assert wandb_history(records) == STEPS


def test_mlflow_logs_two_steps_to_a_file_store_in_the_run_folder(tmp_path, no_network_env):
    from mlflow.tracking import MlflowClient

    t = MlflowTracker(tmp_path, "vintage-test", "run-a", {"controller": {"total_steps": 2}})
    for step, values in STEPS.items():
        t.log(step, values)
    t.close()
    assert t.uri == (tmp_path / "mlruns").resolve().as_uri() and (tmp_path / "mlruns").is_dir()
    client = MlflowClient(tracking_uri=t.uri)
    run = client.get_run(t.run_id)
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "vintage-test"
    assert [(m.step, m.value) for m in client.get_metric_history(t.run_id, "loss")] == [(1, 0.5), (2, -0.125)]
    assert [(m.step, m.value) for m in client.get_metric_history(t.run_id, "reward_mean")] == [(1, 0.25), (2, 0.75)]
    assert [a.path for a in client.list_artifacts(t.run_id)] == ["config.resolved.json"]


def test_every_tracker_gets_the_names_of_metrics_jsonl(tmp_path, no_network_env):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(None, ['logging.trackers=["tensorboard", "wandb", "mlflow"]', f'logging.run_dir="{tmp_path}"'])
    trackers = start_trackers(cfg.logging, cfg.model_dump(mode="json"))
    log = MetricsLog(tmp_path, trackers)
    for step, values in STEPS.items():
        log.log(step, {**values, "applied": True, "staleness_hist": {0: 4}})
    log.close()
    names = set(read_metrics(tmp_path / "metrics.jsonl")[0]) - {"step", "time", "applied", "staleness_hist"}
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == names
    (records,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert wandb_history(records) == STEPS
    mlflow = trackers[2]
    assert set(MlflowClient(tracking_uri=mlflow.uri).get_run(mlflow.run_id).data.metrics) == names
    assert MlflowClient(tracking_uri=mlflow.uri).get_run(mlflow.run_id).info.run_name == tmp_path.name


def test_a_missing_package_is_one_line_naming_the_setting(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    cfg = load_config(None, ['logging.trackers=["wandb"]', f'logging.run_dir="{tmp_path}"'])
    with pytest.raises(ImportError, match=r"^logging.trackers: 'wandb' needs the wandb package"):
        start_trackers(cfg.logging)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "logging.tensorboard=false",
            r"logging.tensorboard = False is now logging.trackers: trackers = \[\"tensorboard\"\]",
        ),
        ('logging.trackers=["mlflow", "mlflow"]', r"logging.trackers: 'mlflow' is listed more than once"),
        ('logging.trackers=["trackio"]', r"logging.trackers.0\n  Input should be 'tensorboard', 'wandb' or 'mlflow'"),
    ],
)
def test_config_refusals_name_the_field(override, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        load_config(None, [override])
