"""Overrides (``--set`` items) of a short job on the tiny random model, shared by the job tests, and
a test environment whose groups are uniform by seed (:class:`UniformOnEvenSeeds`)."""

from __future__ import annotations

from typing import Any

from rollout.envs.toy import AlphabetEnv

TINY_JOB = [
    'model.path="tiny"',
    "env.eval_prompts=2",
    "rollout.num_workers=1",
    "rollout.max_num_seqs=16",
    "rollout.sampling.max_tokens=12",
    "rollout.sampling.n=4",
    "rollout.sampling.temperature=1.0",
    "controller.batch_groups=2",
    "controller.max_staleness=1",
    "learner.lr=1e-4",
    "learner.micro_batch_size=8",
    "server.port=0",
    "logging.trackers=[]",
    "logging.plots=false",
    "ray.num_cpus=6",
]


class UniformOnEvenSeeds(AlphabetEnv):
    """:class:`rollout.envs.toy.AlphabetEnv` whose even seeds score every reply 1.0, so each group of an
    even seed has equal rewards (what dynamic sampling drops); odd seeds score the share of alphabet
    letters, which differs between the random model's replies."""

    def step(self, action: str) -> tuple[list[dict[str, Any]], float, bool, dict[str, Any]]:
        obs, reward, done, info = super().step(action)
        return obs, 1.0 if self.seed % 2 == 0 else reward, done, info
