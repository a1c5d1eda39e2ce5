"""``controller.source`` picks the job's trajectory source: the built-in kinds by name, ``auto`` by
the ``[agent]`` section, or a factory of the user's own by import path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from rich.console import Console

from trainer.driver.config.schema import load_config, preflight
from trainer.driver.loop import assembly


def own_source(job, console):
    """A user's source factory: a source that holds the job it was given."""
    return ("own source", job)


def test_a_source_of_ones_own_is_built_by_its_factory_with_the_job():
    cfg = load_config(None, ['model.path="tiny"', 'controller.source="tests.unit.test_source_selector:own_source"'])
    preflight(cfg)
    job = SimpleNamespace(cfg=cfg)
    name, given = assembly.start_source(job, Console(quiet=True))
    assert name == "own source" and given is job


def test_auto_picks_the_env_loop_without_agents(monkeypatch):
    picked = []
    monkeypatch.setitem(assembly.SOURCES, "env", lambda job, console: picked.append("env") or "env source")
    cfg = load_config(None, ['model.path="tiny"'])
    assert cfg.controller.source == "auto"
    assert assembly.start_source(SimpleNamespace(cfg=cfg), Console(quiet=True)) == "env source" and picked == ["env"]


def test_bad_source_settings_are_refused_in_one_line():
    with pytest.raises(
        ValueError, match=r"controller.source: 'gateway' is not auto, env, agent or 'package.module:factory'"
    ):
        load_config(None, ['model.path="tiny"', 'controller.source="gateway"'])
    with pytest.raises(ValueError, match=r'controller.source: "agent" needs an \[agent\] section'):
        load_config(None, ['model.path="tiny"', 'controller.source="agent"'])
    cfg = load_config(None, ['model.path="tiny"', 'controller.source="no_such_module:factory"'])
    with pytest.raises(ValueError, match=r"controller.source: 'no_such_module:factory' does not import"):
        preflight(cfg)
