"""``vintage eval env``: ``--config`` takes a TOML config or a run's ``config.resolved.json``, and
``--seed`` sets the evaluation's ``controller.seed``; both checked without loading a model (the
evaluation functions are replaced by recorders)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import trainer.driver.loop.eval_env as eval_env
from trainer.driver.config.schema import load_config, write_resolved
from trainer.driver.loop.eval_env import config_file, resolved_config, with_seed
from vintage_cli.main import app

TOML = """
[model]
path = "tiny"

[env]
eval_prompts = 6

[controller]
seed = 3
"""


def resolved_json(tmp_path):
    """A run's resolved config, written as ``vintage run`` writes it (tokens redacted)."""
    cfg = load_config(None, ['server.token="0123456789abcdef0123"', "env.eval_prompts=5", "controller.seed=4"])
    return write_resolved(cfg, tmp_path / "run")


def test_resolved_json_config_reads_as_the_run_saved_it(tmp_path):
    path = resolved_json(tmp_path)
    assert '"**********"' in path.read_text()  # the redacted token would not validate as a token
    cfg = config_file(path)
    assert cfg.env.eval_prompts == 5 and cfg.controller.seed == 4 and cfg.server.token is None
    assert cfg.loss == load_config().loss  # the preset and its fields round-trip


def test_json_told_apart_by_content_too(tmp_path):
    path = tmp_path / "resolved.conf"
    path.write_text(resolved_json(tmp_path).read_text())
    assert config_file(path).env.eval_prompts == 5


def test_toml_config_still_reads(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(TOML)
    cfg = config_file(path)
    assert cfg.model.path == "tiny" and cfg.env.eval_prompts == 6 and cfg.controller.seed == 3


def test_bad_config_files_are_one_line_naming_the_flag_and_file(tmp_path):
    bad_json = tmp_path / "c.json"
    bad_json.write_text("{not json")
    with pytest.raises(ValueError, match=r"^--config: '.*c\.json' is not valid JSON \(.* at line 1, column 2\)$"):
        config_file(bad_json)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"^--config: '.*list\.json' holds a JSON list, not a config object$"):
        config_file(listed)
    bad_toml = tmp_path / "c.toml"
    bad_toml.write_text("this is = = not toml")
    with pytest.raises(ValueError, match=r"^--config: '.*c\.toml' is not TOML \(.*\); give a TOML config or a run's"):
        config_file(bad_toml)
    with pytest.raises(FileNotFoundError):
        config_file(tmp_path / "missing.toml")


def test_resolved_config_leaves_its_input_alone():
    data = {"server": {"token": "**********", "port": 0}, "gateway": {"token": "**********"}}
    cfg = resolved_config(data)
    assert cfg.server.port == 0 and data["server"]["token"] == "**********"


def test_with_seed_sets_controller_seed_only():
    cfg = load_config(None, ["controller.seed=2"])
    assert with_seed(cfg, None) is cfg
    seeded = with_seed(cfg, 9)
    assert seeded.controller.seed == 9 and cfg.controller.seed == 2
    assert seeded.model_dump(exclude={"controller"}) == cfg.model_dump(exclude={"controller"})
    with pytest.raises(ValueError, match=r"^--seed: -1 is negative"):
        with_seed(cfg, -1)


REPORT = {"reward": 0.5, "success_rate": 0.5, "episodes": 4, "version": None, "seconds": 1.0, "engine": "transformers"}


@pytest.fixture
def recorded(monkeypatch):
    """Replace the evaluations with recorders of their arguments."""
    calls: list[tuple] = []

    def model_path(path, cfg, engine=None):
        calls.append(("model_path", path, cfg, engine))
        return dict(REPORT)

    def run(run_dir, version="latest", engine=None, seed=None):
        calls.append(("run", str(run_dir), version, engine, seed))
        return dict(REPORT)

    monkeypatch.setattr(eval_env, "evaluate_model_path", model_path)
    monkeypatch.setattr(eval_env, "evaluate_run", run)
    return calls


def invoke(*args: str):
    r = CliRunner().invoke(app, ["eval", "env", *args])
    return r.exit_code, r.output


def test_cli_model_path_with_resolved_json_and_seed(tmp_path, recorded):
    path = resolved_json(tmp_path)
    out = tmp_path / "report.json"
    code, output = invoke("--model-path", "tiny", "--config", str(path), "--seed", "7", "--out", str(out))
    assert code == 0, output
    [(kind, model, cfg, engine)] = recorded
    assert (kind, model, engine) == ("model_path", "tiny", None)
    assert cfg.controller.seed == 7 and cfg.env.eval_prompts == 5
    assert json.loads(out.read_text())["episodes"] == 4
    assert "held-out success 0.500 (2 of 4)" in output


def test_cli_seed_defaults_to_the_config_and_reaches_run_evaluation(tmp_path, recorded):
    toml = tmp_path / "c.toml"
    toml.write_text(TOML)
    code, output = invoke("--model-path", "tiny", "--config", str(toml), "--out", str(tmp_path / "a.json"))
    assert code == 0, output
    assert recorded[-1][2].controller.seed == 3
    code, output = invoke(str(tmp_path / "run"), "--seed", "11", "--version", "4", "--out", str(tmp_path / "b.json"))
    assert code == 0, output
    assert recorded[-1] == ("run", str(tmp_path / "run"), 4, None, 11)


def test_cli_refusals_name_the_flag(tmp_path, recorded):
    bad = tmp_path / "c.json"
    bad.write_text("{oops")
    code, output = invoke("--model-path", "tiny", "--config", str(bad), "--out", str(tmp_path / "r.json"))
    assert code == 2 and output.startswith("eval error: --config: ") and len(output.strip().splitlines()) == 1
    code, output = invoke("--model-path", "tiny", "--config", str(bad), "--seed", "-2")
    assert code == 2 and "--seed" in output
    code, output = invoke(str(tmp_path / "run"), "--config", str(bad))
    assert code == 2 and "--config" in output
    assert recorded == []
