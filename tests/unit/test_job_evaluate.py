"""Held-out evaluation in the driver: its requests are tagged ``purpose="eval"`` and seeded per
prompt, training trajectories that finish meanwhile are held back for the next collect, an
evaluation started beside training picks its episodes out of the training polls, an episode of
another version than the pinned one is refused, and a worker that never answers stops the job with
an error naming ``env.eval_timeout_s`` (a recording pool stands in for the Ray workers)."""

from __future__ import annotations

import numpy as np
import pytest

from protocol import Trajectory
from trainer.driver.config.schema import load_config
from trainer.driver.sources.buffer import TrajectoryBuffer
from trainer.driver.sources.source import EnvSource


def traj(tid, reward, purpose, versions=(3, 3)):
    return Trajectory(
        trajectory_id=tid,
        group_id=tid,
        token_ids=np.arange(3),
        loss_mask=[0, 1, 1],
        behav_logprobs=[0.0, -0.5, -0.5],
        versions=[-1, *versions],
        policy_version=versions[-1],
        prompt_len=1,
        finish_reason="stop",
        reward=reward,
        purpose=purpose,
    )


class Pool:
    """Answers each poll with the next scripted list (then nothing); records submitted requests;
    never loses a worker."""

    def __init__(self, polls):
        self.polls, self.submitted = list(polls), []

    def __len__(self):
        return 1

    def take_lost(self):
        return []

    def kill_hung(self):
        return []

    def submit(self, reqs):
        self.submitted += reqs
        return len(reqs)

    def poll(self):
        return self.polls.pop(0) if self.polls else []


def job(pool, *overrides):
    cfg = load_config(None, ["env.eval_prompts=2", "env.train_seeds=10", *overrides])  # the env loop at version 3
    return EnvSource(cfg, pool, TrajectoryBuffer(capacity=16, max_staleness=1), lambda: 3)


def test_eval_requests_are_tagged_and_training_trajectories_held_back():
    train = traj("v2-5-0/1", 1.0, "train")
    pool = Pool([[train, traj("eval-after-10", 1.0, "eval")], [traj("eval-after-11", 0.25, "eval")]])
    j = job(pool)
    # rewards 1.0 and 0.25: mean 0.625, one of two above 0.5; both sampled at the learner's version 3
    assert j.evaluate("after") == {
        "reward": 0.625,
        "success_rate": 0.5,
        "episodes": 2,
        "version": 3,
        "sampled_versions": [3],
        "resubmitted": 0,
    }
    # one sample each, no seed on vLLM (the default engine)
    assert [(r.request_id, r.purpose, r.env.seed, r.sampling.n, r.sampling.seed) for r in pool.submitted] == [
        ("eval-after-10", "eval", 10, 1, None),
        ("eval-after-11", "eval", 11, 1, None),
    ]
    assert j._held_back == [train]


def test_eval_requests_are_seeded_per_prompt_on_the_transformers_engine():
    from trainer.driver.records.heldout import held_out_requests

    cfg = load_config(
        None, ["env.eval_prompts=2", "env.train_seeds=10", "controller.seed=2", 'rollout.engine="transformers"']
    )
    # controller.seed 2 * 100_003 + env seed 10, 11
    assert [r.sampling.seed for r in held_out_requests(cfg, "after", 3)] == [200_016, 200_017]
    assert [r.sampling.seed for r in held_out_requests(cfg, "after", 3, engine="vllm")] == [None, None]


def test_eval_that_never_finishes_raises_naming_the_timeout():
    train = traj("v2-5-0/1", 1.0, "train")
    j = job(Pool([[train, traj("eval-before-10", 1.0, "eval")]]), "env.eval_timeout_s=0.5")
    with pytest.raises(TimeoutError) as e:
        j.evaluate("before")
    assert str(e.value) == (
        "env.eval_timeout_s: held-out evaluation 'before' got 1 of 2 episodes in 0.5 s (a rollout worker failed or hung)"
    )
    assert j._held_back == [train]


def test_end_reason_and_exit_code():
    from trainer.driver.loop.job import end_reason
    from vintage_cli.main import exit_code

    assert end_reason(5, 5, interrupted=False) == "completed"
    assert end_reason(5, 5, interrupted=True) == "completed"  # the last step finished anyway
    assert end_reason(2, 5, interrupted=True) == "interrupted"
    assert end_reason(0, 5, interrupted=False) == "time_budget"
    fin = {"state": "finished"}
    assert exit_code({**fin, "end_reason": "completed", "steps": 5}) == 0
    assert exit_code({**fin, "end_reason": "interrupted", "steps": 2}) == 0
    assert exit_code({**fin, "end_reason": "time_budget", "steps": 3}) == 0
    assert exit_code({**fin, "end_reason": "time_budget", "steps": 0}) == 3
    assert exit_code({"state": "failed", "end_reason": "failed: learner"}) == 1


def test_failed_part_names_the_actor_role():
    import ray

    from trainer.driver.loop.report import failed_part

    err = ray.exceptions.RayActorError(error_msg="The actor died: class_name: RolloutWorkerActor")
    assert failed_part(err) == "rollout worker"
    assert failed_part(ValueError("x")) == "ValueError"


def test_resume_auto_finds_the_run_dirs_latest_checkpoint(tmp_path):
    from vintage_cli.main import resume_path

    assert resume_path(str(tmp_path), "auto") is None  # nothing yet: a fresh start
    (tmp_path / "checkpoints").mkdir()
    assert resume_path(str(tmp_path), "auto") is None  # a save that never completed names no tag
    (tmp_path / "checkpoints" / "vintage_latest").write_text("v6")
    assert resume_path(str(tmp_path), "auto") == str(tmp_path / "checkpoints")
    assert resume_path(str(tmp_path), "/some/ckpt") == "/some/ckpt"


def test_intake_refuses_aborted_and_out_of_vocabulary_trajectories():
    from trainer.driver.loop.parts import intake_refusal

    ok = traj("a", 1.0, "train")  # token ids 0, 1, 2
    assert intake_refusal(ok, vocab_size=3) is None
    assert intake_refusal(ok, vocab_size=2) == "token_id_out_of_vocab"  # id 2 has no row in a 2-row embedding
    aborted = ok.model_copy(update={"finish_reason": "abort"})
    assert intake_refusal(aborted, vocab_size=3) == "aborted"


def test_eval_requests_no_worker_took_are_submitted_again():
    """The pool takes one request per call (its only worker is busy with a late call meanwhile):
    the second is submitted on a later round, and both episodes are scored."""

    class OneAtATime(Pool):
        def submit(self, reqs):
            self.submitted += reqs[:1]
            return len(reqs[:1])

    pool = OneAtATime([[], [traj("eval-after-10", 1.0, "eval")], [traj("eval-after-11", 0.0, "eval")]])
    assert job(pool).evaluate("after") == {
        "reward": 0.5,
        "success_rate": 0.5,
        "episodes": 2,
        "version": 3,
        "sampled_versions": [3],
        "resubmitted": 0,
    }
    assert [r.request_id for r in pool.submitted] == ["eval-after-10", "eval-after-11"]


def test_eval_started_beside_training_takes_its_episodes_out_of_the_polls():
    """start_eval returns at once; each training poll passes the training trajectories on and keeps
    the evaluation's; finish_eval waits only for what is left. An episode of an abandoned evaluation
    that arrives later is discarded, never trained on."""
    t1, t2 = traj("v3-1-0/0", 1.0, "train"), traj("v3-1-0/1", 0.0, "train")
    pool = Pool([[t1, traj("eval-during-10", 0.75, "eval")], [t2], [traj("eval-during-11", 0.0, "eval")]])
    j = job(pool)
    assert j.start_eval("during") and j.eval_running
    assert j.poll() == [t1]  # the evaluation's first episode is kept for it
    assert j.poll() == [t2]
    # rewards 0.75 and 0.0: mean 0.375, one of two above 0.5
    assert j.finish_eval() == {
        "reward": 0.375,
        "success_rate": 0.5,
        "episodes": 2,
        "version": 3,
        "sampled_versions": [3],
        "resubmitted": 0,
    }
    assert not j.eval_running and j.finish_eval() == {}
    j2 = job(Pool([[], [traj("eval-during-10", 1.0, "eval"), t1]]))
    assert j2.start_eval("during")
    j2.abandon_eval()
    assert j2.poll() == [] and j2.poll() == [t1]  # the stray episode is dropped, the training one passes


def test_an_episode_sampled_by_another_version_is_refused():
    # learner (and pinned) version 3; the second episode's last token came from version 4
    pool = Pool([[traj("eval-after-10", 1.0, "eval"), traj("eval-after-11", 1.0, "eval", versions=(3, 4))]])
    with pytest.raises(RuntimeError) as e:
        job(pool).evaluate("after")
    assert str(e.value) == "held-out episode eval-after-11 was sampled at versions [3, 4], not only the pinned 3"


def test_eval_due_every_n_versions_below_the_last():
    from trainer.driver.records.heldout import eval_due

    # every 2 of 4: 2 only (0 is "before", 4 is "after"); every 3 of 10: 3, 6, 9; 0: never
    assert [v for v in range(0, 5) if eval_due(v, 2, 4)] == [2]
    assert [v for v in range(0, 11) if eval_due(v, 3, 10)] == [3, 6, 9]
    assert [v for v in range(0, 11) if eval_due(v, 0, 10)] == []


def test_eval_every_without_held_out_prompts_is_refused():
    from pydantic import ValidationError

    from trainer.driver.config.schema import one_line

    with pytest.raises(ValidationError) as e:
        load_config(None, ["controller.eval_every=2", "env.eval_prompts=0"])
    assert one_line(e.value) == (
        "controller.eval_every: 2 with env.eval_prompts = 0: there are no held-out prompts to evaluate"
    )
    with pytest.raises(ValidationError) as e:
        load_config(None, ["controller.eval_every=-1"])
    assert one_line(e.value) == "controller.eval_every: Input should be greater than or equal to 0 (got -1)"
