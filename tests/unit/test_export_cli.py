"""``vintage export`` refuses what it cannot export in one line naming the value, exit 2, before
any weight is read (a hand-made run folder: the resolved config and checkpoint state files only)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from trainer.driver.records.export import ExportError, parse_version
from trainer.learner.checkpoint import FORMAT, STATE_FILE, checkpointed_versions
from vintage_cli.main import app


def fake_run(tmp_path, versions=(2, 4), incomplete=(6,), lora=False):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.resolved.json").write_text(json.dumps({"model": {"path": "tiny", "tiny_seed": 0}}))
    for v in versions:
        (run / "checkpoints" / f"v{v}").mkdir()
        settings = {"dtype": "float32", "zero_stage": 0, "temperature": 1.0, "lora": {"enabled": lora}}
        torch.save({"format": FORMAT, "version": v, "settings": settings}, run / "checkpoints" / f"v{v}" / STATE_FILE)
    for v in incomplete:  # DeepSpeed's files without vintage's state: a save that did not finish
        (run / "checkpoints" / f"v{v}").mkdir()
    if versions:
        (run / "checkpoints" / "vintage_latest").write_text(f"v{max(versions)}")
    return run


def export(*args: str) -> tuple[int, list[str]]:
    r = CliRunner().invoke(app, ["export", *args])
    return r.exit_code, r.output.strip().splitlines()


def test_checkpointed_versions_are_the_complete_ones(tmp_path):
    run = fake_run(tmp_path, versions=(10, 2, 4))
    assert checkpointed_versions(run / "checkpoints") == [2, 4, 10]
    assert checkpointed_versions(tmp_path / "nowhere") == []


def test_missing_run_dir_is_one_line_naming_it(tmp_path):
    missing = tmp_path / "no-such-run"
    code, lines = export(str(missing), "--out", str(tmp_path / "out"))
    assert code == 2 and lines == [f"export error: RUN_DIR: '{missing}' is not a folder"]
    (tmp_path / "empty").mkdir()
    code, lines = export(str(tmp_path / "empty"), "--out", str(tmp_path / "out"))
    assert code == 2 and lines == [
        f"export error: RUN_DIR: '{tmp_path / 'empty'}' has no config.resolved.json (not a vintage run folder)"
    ]


def test_version_not_checkpointed_lists_those_that_are(tmp_path):
    run = fake_run(tmp_path)
    code, lines = export(str(run), "--version", "6", "--out", str(tmp_path / "out"))
    assert code == 2 and lines == [
        f"export error: --version 6: not checkpointed in {run / 'checkpoints'} (checkpointed: 2, 4)"
    ]
    empty = fake_run(tmp_path / "b", versions=(), incomplete=())
    code, lines = export(str(empty), "--out", str(tmp_path / "out"))
    assert code == 2 and lines == [f"export error: --version latest: no complete checkpoint in {empty / 'checkpoints'}"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", ""])
def test_version_must_be_a_number_latest_or_best(value):
    assert parse_version("latest") == "latest" and parse_version("best") == "best" and parse_version("12") == 12
    with pytest.raises(ExportError, match=f"^--version: {value!r} is not a version number, 'latest' or 'best'$"):
        parse_version(value)


def test_out_not_empty_and_merge_without_lora_are_refused(tmp_path):
    run = fake_run(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, lines = export(str(run), "--version", "2", "--out", str(out))
    assert code == 2 and lines == [f"export error: --out: '{out}' exists and is not empty (--overwrite replaces it)"]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    code, lines = export(str(run), "--merge", "--out", str(tmp_path / "m"))
    assert code == 2 and lines == [
        "export error: --merge: the run trained full weights (lora.enabled = false); its export is a full model"
    ]


def eval_env(*args: str) -> tuple[int, list[str]]:
    r = CliRunner().invoke(app, ["eval", "env", *args])
    return r.exit_code, r.output.strip().splitlines()


def test_eval_env_refuses_a_version_not_checkpointed_before_any_engine_starts(tmp_path):
    run = fake_run(tmp_path)
    code, lines = eval_env(str(run), "--version", "6", "--out", str(tmp_path / "e.json"))
    assert code == 2 and lines == [
        f"eval error: --version 6: not checkpointed in {run / 'checkpoints'} (checkpointed: 2, 4)"
    ]
    code, lines = eval_env(str(run), "--version", "six")
    assert code == 2 and lines == ["eval error: --version: 'six' is not a version number, 'latest' or 'best'"]
    assert not (tmp_path / "e.json").exists()


def test_eval_env_needs_one_model_and_a_config_with_model_path(tmp_path):
    code, out = eval_env()
    assert code == 2 and "give exactly one of RUN_DIR and --model-path" in " ".join(out)
    code, out = eval_env("--model-path", "tiny")
    assert code == 2 and "--model-path needs --config" in " ".join(out)
    (tmp_path / "c.toml").write_text("[env]\neval_prompts = 2\n")
    code, lines = eval_env("--model-path", str(tmp_path / "nowhere"), "--config", str(tmp_path / "c.toml"))
    assert code == 2 and lines == [
        f"eval error: --model-path: '{tmp_path / 'nowhere'}' is not a folder, 'smollm2' or 'tiny'"
    ]
