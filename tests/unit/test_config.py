"""Config: defaults, presets, overrides, and errors that name the field."""

import pydantic
import pytest

from trainer.config import load_config, parse_override


def test_defaults_are_the_demo_method():
    cfg = load_config()
    assert cfg.loss.method == "snapshot" and cfg.oldlogit_route == "snapshot"
    assert cfg.loss.proxy == "ewma"
    assert cfg.server.host == "127.0.0.1"


def test_file_then_overrides(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[controller]\nmax_staleness = 3\n[loss]\nmethod = "icepop"\nmask_high = 3.0\n')
    cfg = load_config(p, ["controller.max_staleness=1", 'model.path="tiny"'])
    assert cfg.controller.max_staleness == 1 and cfg.model.path == "tiny"
    assert cfg.loss.method == "icepop" and cfg.loss.discrepancy_mask and cfg.loss.mask_high == 3.0


@pytest.mark.parametrize(
    "override, field",
    [
        ("controller.max_staleness=-1", "max_staleness"),
        ("rollout.sampling.temperature=0", "temperature"),
        ("learner.zero_stage=4", "zero_stage"),
        ('rollout.engine="sglang"', "engine"),
        ("controller.bogus=1", "bogus"),
        ('loss.method="nope"', "method"),
        ("controller.max_token_staleness=5", "max_token_staleness"),
        ("learner.lr=inf", "lr"),
        ("learner.grad_clip=nan", "grad_clip"),
        ("loss.eps_high=inf", "eps_high"),
    ],
)
def test_invalid_config_names_field(override, field):
    with pytest.raises((pydantic.ValidationError, ValueError), match=field):
        load_config(None, [override])


def test_parse_override_types():
    assert parse_override("a.b=1") == ("a.b", 1)
    assert parse_override("a.b=true") == ("a.b", True)
    assert parse_override("a.b=hello") == ("a.b", "hello")
    with pytest.raises(ValueError, match="expected"):
        parse_override("nonsense")
