"""Config: defaults, presets, overrides, and errors that name the field."""

import re
from pathlib import Path

import pydantic
import pytest

from trainer.driver.config.schema import load_config, parse_override
from trainer.driver.loop.assembly import learner_settings


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


def test_kl_and_entropy_settings_reach_the_learner_and_a_bad_estimator_is_named():
    cfg = load_config(None, ["loss.kl_coef=0.05", "loss.kl_estimator=k2", "loss.entropy_coef=0.001"])
    settings = learner_settings(cfg, Path("/m"))
    assert (settings.loss.kl_coef, settings.loss.kl_estimator, settings.loss.entropy_coef) == (0.05, "k2", 0.001)
    with pytest.raises(pydantic.ValidationError, match="kl_estimator"):
        load_config(None, ["loss.kl_estimator=k4"])


def test_a_decaying_schedule_decays_over_the_whole_run_unless_told_otherwise():
    """20 versions of 2 mini-batches x 3 epochs: the decay reaches its floor at optimizer step 120."""
    base = ["controller.total_steps=20", "learner.ppo_mini_batches=2", "learner.ppo_epochs=3"]
    cfg = load_config(None, [*base, "learner.lr_schedule=cosine", "learner.lr_warmup_steps=4"])
    assert learner_settings(cfg, Path("/m")).lr_decay_steps == 120
    cfg = load_config(None, [*base, "learner.lr_schedule=linear", "learner.lr_decay_steps=50"])
    assert learner_settings(cfg, Path("/m")).lr_decay_steps == 50
    assert learner_settings(load_config(None, base), Path("/m")).lr_decay_steps is None


def test_overlong_filter_reaches_the_learner_settings():
    from trainer.driver.loop.assembly import learner_settings

    assert learner_settings(load_config(), "/m").overlong_filter is False
    s = learner_settings(load_config(None, ["learner.overlong_filter=true", "learner.grad_clip=0"]), "/m")
    assert s.overlong_filter is True and s.grad_clip == 0.0 and s.model_path == "/m"


def test_updates_per_batch_reach_the_learner_settings():
    from trainer.driver.loop.assembly import learner_settings

    s = learner_settings(load_config(), "/m")
    assert (s.ppo_mini_batches, s.ppo_epochs) == (1, 1)
    s = learner_settings(load_config(None, ["learner.ppo_mini_batches=4", "learner.ppo_epochs=2"]), "/m")
    assert (s.ppo_mini_batches, s.ppo_epochs) == (4, 2)
    with pytest.raises(pydantic.ValidationError, match="learner.ppo_epochs"):
        load_config(None, ["learner.ppo_epochs=0"])


def test_learner_options_are_declared_once_for_the_config_and_the_settings():
    from trainer.driver.config.schema import LearnerConfig
    from trainer.driver.loop.assembly import learner_settings
    from trainer.learner import LearnerOptions, LearnerSettings

    assert issubclass(LearnerConfig, LearnerOptions) and issubclass(LearnerSettings, LearnerOptions)
    assert sorted(LearnerOptions.model_fields) == [
        "dtype", "grad_clip", "gradient_checkpointing", "logprob_chunk_bytes", "lr", "lr_decay_steps",
        "lr_min_ratio", "lr_schedule", "lr_warmup_steps", "micro_batch_size", "overlong_filter", "pack_sequences",
        "ppo_epochs", "ppo_mini_batches", "rollback_copy", "shuffle_mini_batches", "weight_decay", "zero_stage",
    ]  # fmt: skip
    cfg = load_config(
        None,
        [
            "learner.lr=3e-4",
            "learner.ppo_mini_batches=3",
            "learner.logprob_chunk_bytes=0",
            "learner.gradient_checkpointing=true",
        ],
    )
    s = learner_settings(cfg, Path("/m"))
    assert (s.lr, s.ppo_mini_batches, s.logprob_chunk_bytes, s.gradient_checkpointing, s.model_path) == (
        3e-4, 3, 0, True, "/m",
    )  # fmt: skip
    from trainer.learner.settings import LOGPROB_CHUNK_BYTES

    assert LOGPROB_CHUNK_BYTES == 160 * 2**20


def test_token_redacted_in_resolved_config_and_private_files(tmp_path):
    import json
    import stat

    from trainer.driver.config.schema import write_private, write_resolved

    cfg = load_config(None, ['server.token="tok-0123456789abcdef"'])
    assert cfg.server.token.get_secret_value() == "tok-0123456789abcdef"
    text = write_resolved(cfg, tmp_path).read_text()
    assert "tok-0123456789abcdef" not in text and json.loads(text)["server"]["token"] == "**********"
    p = write_private(tmp_path / "token", "abc")
    assert stat.S_IMODE(p.stat().st_mode) == 0o600 and p.read_text() == "abc"
    with pytest.raises(pydantic.ValidationError, match="token"):
        load_config(None, ['server.token="short"'])


@pytest.mark.parametrize(
    "override, message",
    [
        ("controller.buffer_capacity=4", "controller.buffer_capacity: 4 < one batch (4 groups x 4 samples)"),
        ("rollout.max_num_seqs=2", "rollout.max_num_seqs: 2 < sampling.n 4"),
        ("rollout.num_workers=0", "rollout.num_workers: 0 without controller.time_budget_s"),
        ("learner.ppo_mini_batches=17", "learner.ppo_mini_batches: 17 > one batch (4 groups x 4 samples)"),
    ],
)
def test_configs_that_cannot_work_are_refused(override, message):
    with pytest.raises(pydantic.ValidationError, match=re.escape(message)):
        load_config(None, ["rollout.sampling.n=4", "controller.batch_groups=4", override])


@pytest.mark.parametrize(
    "override, message",
    [
        ('env.path="rollout.envs.nope:Env"', "env.path: 'rollout.envs.nope:Env' does not import (ModuleNotFoundError"),
        ('env.path="rollout.envs:NOPE"', "env.path: 'rollout.envs:NOPE' does not import (AttributeError"),
        ('env.path="rollout.envs:__doc__"', "env.path: 'rollout.envs:__doc__' is not a class or callable"),
        ('agent.path="nope.x:run"', "agent.path: 'nope.x:run' does not import (ModuleNotFoundError"),
        (
            'agent.tasks="/nonexistent.jsonl"',
            "agent.tasks: '/nonexistent.jsonl' is not 'env' or an existing JSONL file",
        ),
        ('model.path="/nonexistent/model"', "model.path: '/nonexistent/model' is not 'smollm2', 'tiny'"),
        ('controller.resume_from="/nonexistent/ckpt"', "controller.resume_from: '/nonexistent/ckpt' does not exist"),
    ],
)
def test_preflight_names_the_field(override, message):
    from trainer.driver.config.schema import preflight

    with pytest.raises(ValueError, match=re.escape(message)):
        preflight(load_config(None, [override]))


def test_cli_config_error_is_one_line_exit_2():
    from typer.testing import CliRunner

    from vintage_cli.main import app

    r = CliRunner().invoke(app, ["run", "--set", "learner.lr=inf"])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "config error: learner.lr: Input should be a finite number (got inf)"
    )
    r = CliRunner().invoke(app, ["run", "--set", 'model.path="/nonexistent/model"'])
    assert r.exit_code == 2 and r.output.strip() == (
        "config error: model.path: '/nonexistent/model' is not 'smollm2', 'tiny' or an existing folder"
    )


def test_cli_imports_modules_of_the_working_directory(tmp_path, monkeypatch):
    import sys

    from typer.testing import CliRunner

    from vintage_cli.main import app

    (tmp_path / "my_envs").mkdir()
    (tmp_path / "my_envs" / "__init__.py").write_text("")
    (tmp_path / "my_envs" / "toy.py").write_text("class Env:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    r = CliRunner().invoke(app, ["run", "--set", 'env.path="my_envs.toy:Env"', "--set", 'model.path="/nonexistent/m"'])
    # env.path imported from the working directory; the next check (model.path) is the one refused
    assert r.exit_code == 2 and r.output.strip().startswith("config error: model.path: '/nonexistent/m'")


def test_cli_status_unreachable_is_one_line():
    from typer.testing import CliRunner

    from vintage_cli.main import app

    r = CliRunner().invoke(app, ["status", "--url", "http://127.0.0.1:1"])
    assert r.exit_code == 1 and r.output.strip().splitlines() == [
        "cannot reach http://127.0.0.1:1/v1/status: [Errno 111] Connection refused"
    ]


def test_cli_run_failure_is_one_line_with_the_part_and_a_traceback_file(tmp_path, monkeypatch):
    import json

    from typer.testing import CliRunner

    import trainer.driver.loop.job
    from vintage_cli.main import app

    def failing_run_job(cfg, console=None):  # stands in for a learner that never starts
        (tmp_path / "summary.json").write_text(
            json.dumps({"state": "failed", "end_reason": "failed: start-up: learner"})
        )
        raise TimeoutError("learner: 1 rank(s) not started within controller.start_timeout_s = 5.0 s\nmore detail")

    monkeypatch.setattr(trainer.driver.loop.job, "run_job", failing_run_job)
    args = ["run", "--set", 'model.path="tiny"', "--set", "ray.loopback_only=false"]
    r = CliRunner().invoke(app, [*args, "--set", f'logging.run_dir="{tmp_path}"'])
    assert r.exit_code == 1 and r.output.strip().splitlines() == [
        "run failed: start-up: learner: learner: 1 rank(s) not started within controller.start_timeout_s = 5.0 s"
        f"  (traceback: {tmp_path / 'error.log'})"
    ]
    assert "TimeoutError: learner: 1 rank(s) not started" in (tmp_path / "error.log").read_text()


def test_cli_run_without_a_c_compiler_for_the_loopback_cluster_is_a_config_error(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import trainer.driver.cluster.netguard
    from vintage_cli.main import app

    def no_compiler():
        raise trainer.driver.cluster.netguard.LoopbackUnavailable(
            "ray.loopback_only: no C compiler (cc/gcc) on PATH to build the bind interposer"
        )

    monkeypatch.setattr(trainer.driver.cluster.netguard, "reexec_with_loopback", no_compiler)
    r = CliRunner().invoke(app, ["run", "--set", 'model.path="tiny"', "--set", f'logging.run_dir="{tmp_path}"'])
    assert r.exit_code == 2 and r.output.strip() == (
        "config error: ray.loopback_only: no C compiler (cc/gcc) on PATH to build the bind interposer (install a "
        "C compiler, or accept a cluster on every interface with --set ray.loopback_only=false)"
    )


def test_masking_stale_tokens_sets_the_per_token_limit_to_the_bound():
    """``stale_trajectories = "mask"``: the learner's per-token limit is ``max_staleness`` (3) unless
    ``max_token_staleness`` is set (1); with ``drop`` it is only what is set (None by default)."""
    base = ["controller.max_staleness=3", 'model.path="/m"']
    cases = [([], None), (['controller.stale_trajectories="mask"'], 3),
             (['controller.stale_trajectories="mask"', "controller.max_token_staleness=1"], 1)]  # fmt: skip
    for extra, limit in cases:
        cfg = load_config(None, [*base, *extra])
        assert cfg.token_staleness_limit == limit
        assert learner_settings(cfg, "/m").max_token_staleness == limit
    with pytest.raises(pydantic.ValidationError, match="stale_trajectories"):
        load_config(None, ['controller.stale_trajectories="keep"'])


def test_the_service_scores_the_reference_only_on_the_snapshot_route_and_for_a_kl_penalty(tmp_path):
    cfg = load_config(None, ['loss.method="snapshot"', "loss.kl_reward_coef=0.1", "oldlogit.score_reference=true"])
    s = learner_settings(cfg, tmp_path)
    assert s.reference_in_batch and s.loss.kl_reward_coef == 0.1
    with pytest.raises(pydantic.ValidationError, match="oldlogit.score_reference: needs the snapshot route .* 'none'"):
        load_config(None, ['loss.method="decoupled_ppo"', "loss.kl_coef=0.1", "oldlogit.score_reference=true"])
    with pytest.raises(pydantic.ValidationError, match="oldlogit.score_reference: no KL penalty to score it for"):
        load_config(None, ['loss.method="snapshot"', "oldlogit.score_reference=true"])


@pytest.mark.parametrize(
    ("sets", "in_service"),
    [
        (['loss.method="snapshot"', "loss.kl_coef=0.01"], True),  # auto: snapshot route and a KL penalty
        (['loss.method="snapshot"', "loss.kl_reward_coef=0.01"], True),
        (['loss.method="snapshot"'], False),  # no penalty, nothing to score
        (['loss.method="decoupled_ppo"', "loss.kl_coef=0.01"], False),  # no snapshots held
        (['loss.method="snapshot"', "loss.kl_coef=0.01", "lora.enabled=true"], False),  # base model, adapter off
        (['loss.method="snapshot"', "loss.kl_coef=0.01", "oldlogit.score_reference=false"], False),
    ],
)
def test_the_reference_is_scored_in_the_service_by_default_where_it_holds_snapshots(tmp_path, sets, in_service):
    cfg = load_config(None, sets)
    assert cfg.oldlogit.score_reference == "auto" or "oldlogit.score_reference=false" in sets
    assert cfg.reference_in_service is in_service
    assert learner_settings(cfg, tmp_path).reference_in_batch is in_service


def test_the_old_logit_service_is_built_from_the_jobs_settings():
    cfg = load_config(
        None,
        ['loss.method="snapshot"', "controller.max_staleness=3", 'learner.dtype="bfloat16"', "loss.kl_coef=0.01"],
    )
    opts = cfg.oldlogit_service_options()
    assert (opts["route"], opts["max_staleness"], opts["dtype"], opts["pin_initial"], opts["adapter"]) == (
        "snapshot",
        3,
        "bfloat16",
        True,
        None,
    )
    assert opts["memory_budget_bytes"] == cfg.oldlogit.memory_budget_bytes
    assert opts["packed"] is cfg.learner.pack_sequences
