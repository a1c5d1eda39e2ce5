"""A run folder as the job leaves it, trained by a real learner on the tiny model, for the export tests.

Rollouts are synthetic (random token ids, behaviour log-probs = the tiny model's own plus a little
noise, as in the learner tests); the run is checkpointed after each of its two versions with the
job's own functions (``write_resolved``, ``learner_settings``, ``LearnerCore.save_checkpoint``).
"""

from __future__ import annotations

import numpy as np
import torch

from modelkit.modelhub import load_causal_lm, model_folder
from modelkit.scoring import sequence_logprobs
from protocol import Trajectory
from trainer.algorithm.batch import Batch, collate
from trainer.driver.config.schema import load_config, write_resolved
from trainer.driver.loop.assembly import learner_settings
from trainer.learner import LearnerCore, free_port

TEMPERATURE = 0.8
"""The runs' sampling temperature: every log-prob compared is of ``softmax(logits / T)``."""


def trajectory_maker(model_path):
    """``make(n, length, prompt, seed) -> [Trajectory]``: one GRPO group per two trajectories."""
    model = load_causal_lm(model_path)

    def make(n=4, length=12, prompt=4, seed=0):
        rng = np.random.default_rng(seed)
        out = []
        for i in range(n):
            ids = rng.integers(3, 2000, length)
            ones = torch.ones(1, length, dtype=torch.long)
            with torch.no_grad():
                lp = sequence_logprobs(model, torch.tensor(ids)[None], ones, TEMPERATURE)
            mask = np.zeros(length, np.int8)
            mask[prompt:] = 1
            mu = np.where(mask == 1, np.minimum(lp[0].numpy() + rng.normal(0, 0.05, length), 0.0), 0.0)
            out.append(Trajectory(
                trajectory_id=f"t{seed}-{i}", group_id=f"g{i // 2}", token_ids=ids, loss_mask=mask,
                behav_logprobs=mu.astype(np.float32), versions=np.where(mask == 1, 0, -1), policy_version=0,
                prompt_len=prompt, finish_reason="stop", reward=float(i % 2),
            ))  # fmt: skip
        return out

    return make


def fixed_tokens(make, version: int) -> Batch:
    """Three right-padded rows (lengths 9, 12, 6): the tokens the learner and the export both score."""
    per_token = ("token_ids", "loss_mask", "behav_logprobs", "versions")
    rows = []
    for t, c in zip(make(n=3, seed=99), [9, 12, 6], strict=True):
        rows.append(t.model_copy(update={k: getattr(t, k)[:c] for k in per_token}))
    return collate(rows, consuming_version=version, temperature=TEMPERATURE, pad_token_id=2)


def trained_run(tmp_path, make, *overrides: str) -> tuple:
    """``(run_dir, learner, {version: [3, T] log-probs of fixed_tokens})`` for versions 1 and 2, both
    checkpointed in ``run_dir/checkpoints`` next to ``config.resolved.json``; ``overrides`` are ``--set`` items."""
    run_dir = tmp_path / "run"
    cfg = load_config(None, [
        'model.path="tiny"', f'logging.run_dir="{run_dir}"', f"rollout.sampling.temperature={TEMPERATURE}",
        "learner.micro_batch_size=4", *overrides,
    ])  # fmt: skip
    write_resolved(cfg, run_dir)
    settings = learner_settings(cfg, model_folder(cfg.model.path, cfg.model.tiny_seed))
    core = LearnerCore(settings.model_copy(update={"master_port": free_port()}))
    logprobs = {}
    for v in (1, 2):
        m = core.train_step(make(seed=v))
        assert m["applied"] == 1.0 and core.version == v
        logprobs[v] = core.logprobs(fixed_tokens(make, v))
        core.save_checkpoint(str(run_dir / "checkpoints"), {"buffer": {}, "run_segment": 0})  # as Job.checkpoint
    return run_dir, core, logprobs
