"""An exported folder has ordinary permissions (0644 files, 0755 folders under umask 022), although
safetensors writes its files owner-only (0600); checked on a hand-made run folder with the weight
writing replaced (no model is loaded)."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

import modelkit.modelhub
import trainer.driver.records.export as export
from trainer.learner.checkpoint import FORMAT, STATE_FILE


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_process_umask_is_read_without_changing_it():
    old = os.umask(0o027)
    try:
        assert export.process_umask() == 0o027
        assert export.process_umask() == 0o027  # unchanged by reading
    finally:
        os.umask(old)


def test_ordinary_permissions_of_owner_only_files(tmp_path, umask_022):
    from safetensors.torch import save_file

    folder = tmp_path / "f"
    (folder / "sub").mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    (folder / "sub" / "x.json").write_text("{}")
    os.chmod(folder / "sub" / "x.json", 0o600)
    os.chmod(folder / "sub", 0o700)
    os.symlink(folder / "sub" / "x.json", folder / "link")
    export.ordinary_permissions(folder)
    assert mode(folder / "model.safetensors") == 0o644
    assert mode(folder / "sub" / "x.json") == 0o644
    assert mode(folder / "sub") == 0o755 and mode(folder) == 0o755


def test_export_run_writes_ordinary_permissions(tmp_path, monkeypatch, umask_022):
    run = tmp_path / "run"
    (run / "checkpoints" / "v2").mkdir(parents=True)
    (run / "config.resolved.json").write_text(json.dumps({"model": {"path": "tiny", "tiny_seed": 0}}))
    settings = {"dtype": "float32", "zero_stage": 0, "temperature": 1.0, "lora": {"enabled": False}}
    torch.save({"format": FORMAT, "version": 2, "settings": settings}, run / "checkpoints" / "v2" / STATE_FILE)
    (run / "checkpoints" / "vintage_latest").write_text("v2")
    monkeypatch.setattr(modelkit.modelhub, "model_folder", lambda path, seed=0: tmp_path / "base")

    def owner_only_write(record, ckpt, tag, base, tmp, lora):  # as safetensors writes: mode 0600
        from safetensors.torch import save_file

        tmp.mkdir(parents=True)
        save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text("{}")
        assert mode(tmp / "model.safetensors") == 0o600

    monkeypatch.setattr(export, "_write", owner_only_write)
    out = tmp_path / "exports" / "demo"
    record = export.export_run(run, out)
    assert record.version == 2
    for name in ("model.safetensors", "config.json", export.RECORD_FILE):
        assert mode(out / name) == 0o644, name
    assert mode(out) == 0o755
