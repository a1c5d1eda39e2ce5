"""trainer.algorithm.batch: collation, per-token staleness, masks, old logits, advantages, splits (hand-worked)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from protocol import OldLogitAnswer, TokenStatus, Trajectory
from trainer.algorithm.batch import Batch, collate, empty_batch, sequence_advantages, staleness_histogram
from trainer.algorithm.losses import aggregate

NAN = float("nan")


def traj(
    tid="t",
    gid="g",
    n_prompt=2,
    versions=(0, 0),
    mu=None,
    reward=0.0,
    finish="stop",
    truncated=False,
    mask=None,
    policy_version=None,
    old=None,
):
    """A trajectory of ``n_prompt`` prompt tokens then sampled tokens with the given versions."""
    if mask is None:
        mask = [0] * n_prompt + [1] * len(versions)
    n = len(mask)
    ver, it = [], iter(versions)
    for m in mask:
        ver.append(next(it) if m else -1)
    mu = mu if mu is not None else [-0.5 if m else 0.0 for m in mask]
    return Trajectory(
        trajectory_id=tid, group_id=gid, token_ids=np.arange(10, 10 + n), loss_mask=np.array(mask, np.int8),
        behav_logprobs=np.array(mu, np.float32), versions=np.array(ver), prompt_len=n_prompt,
        policy_version=policy_version if policy_version is not None else max([v for v in ver if v >= 0] or [0]),
        finish_reason=finish, truncated=truncated, reward=reward, old_logprobs=old,
    )  # fmt: skip


def test_case5_partial_rollout_per_token_staleness():
    mu = [0.0, -0.1, -0.2, -0.3, -0.4, -0.5, -0.6]
    t = traj(n_prompt=1, versions=(3, 3, 3, 4, 4, 5), mu=mu, reward=1.0)
    b = collate([t], consuming_version=6, max_token_staleness=2, advantage="reinforce")
    assert b.staleness[0].tolist() == [0, 3, 3, 3, 2, 2, 1]
    assert b.versions[0].tolist() == [-1, 3, 3, 3, 4, 4, 5]
    assert b.loss_mask[0].tolist() == [False, False, False, False, True, True, True]
    assert b.sampled_mask[0].tolist() == [False] + [True] * 6  # stale tokens stay as context
    assert b.attention_mask[0].tolist() == [1] * 7
    assert b.n_tokens == 3 and b.stats["stale_masked_tokens"] == 3
    # each token keeps the mu recorded when it was sampled; the prompt gets a NaN placeholder
    assert math.isnan(b.behav_logprobs[0, 0])
    assert b.behav_logprobs[0, 1:].tolist() == pytest.approx(mu[1:])
    assert b.advantages[0].tolist() == [0, 0, 0, 0, 1, 1, 1]
    # the token-mean denominator is 3, not 6
    per_token = torch.ones(1, 7)
    assert float(aggregate(per_token, b.loss_mask, "token_mean", b.n_tokens)) == pytest.approx(1.0)
    assert staleness_histogram(b) == {1: 1, 2: 2, 3: 3}


def test_case5_no_limit_keeps_all_and_sequence_staleness_is_not_used():
    b = collate([traj(n_prompt=1, versions=(3, 3, 3, 4, 4, 5))], consuming_version=6)
    assert b.n_tokens == 6


def test_token_newer_than_learner_is_refused():
    with pytest.raises(ValueError, match="newer than the consuming learner version 2"):
        collate([traj(versions=(2, 3))], consuming_version=2)


def test_case6_micro_batch_split_keeps_token_mean():
    short = traj("a", versions=(0, 0))  # 2 valid tokens, loss 1 each
    long = traj("b", versions=(0,) * 8)  # 8 valid tokens, loss 0
    b = collate([short, long], consuming_version=0)
    assert b.n_tokens == 10 and b.token_ids.shape == (2, 10)
    per_token = torch.zeros(2, 10)
    per_token[0] = 1.0
    whole = float(aggregate(per_token, b.loss_mask, "token_mean", b.n_tokens))
    mbs = b.micro_batches(1)
    assert [m.size for m in mbs] == [1, 1]
    assert mbs[0].token_ids.shape == (1, 4)  # padding trimmed per micro-batch
    parts = [
        float(
            aggregate(torch.ones_like(m.loss_mask, dtype=torch.float) * (i == 0), m.loss_mask, "token_mean", b.n_tokens)
        )
        for i, m in enumerate(mbs)
    ]
    assert whole == pytest.approx(0.2) and sum(parts) == pytest.approx(0.2)
    # the failure signature would be the mean of per-micro-batch means: 0.5
    assert float(aggregate(per_token, b.loss_mask, "seq_mean_token_mean")) == pytest.approx(0.5)


def test_micro_batches_pad_with_empty_chunks_and_shard():
    b = collate([traj(str(i), versions=(0, 0)) for i in range(5)], consuming_version=0)
    assert [s.size for s in (b.shard(0, 2), b.shard(1, 2))] == [3, 2]
    mbs = b.shard(1, 2).micro_batches(2, count=2)
    assert len(mbs) == 2 and mbs[0].size == 2 and mbs[1].n_tokens == 0
    padded = b.shard(1, 2).micro_batches(1, count=3)
    assert len(padded) == 3 and padded[2].n_tokens == 0 and padded[2].size == 1
    with pytest.raises(ValueError):
        b.micro_batches(1, count=2)
    assert empty_batch().n_tokens == 0


def test_case7_multi_turn_only_model_tokens_count():
    mask = [0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1]
    t = traj(n_prompt=3, mask=mask, versions=(0,) * 9)
    b = collate([t], consuming_version=0, overlong_filter=True)
    assert t.num_generated == 9
    assert b.n_tokens == 9
    tool = torch.tensor(mask) == 0
    assert torch.isnan(b.behav_logprobs[0][tool]).all()  # placeholders, never read
    assert (b.advantages[0][tool] == 0).all()


def test_case9_truncation_from_finish_reason():
    eot = 99  # the end-of-turn id, not the tokenizer's eos id
    a = traj("a", versions=(0, 0), finish="stop")
    b_ = traj("b", versions=(0, 0), finish="length")
    c = traj("c", versions=(0, 0), finish="length")
    c = c.model_copy(update={"token_ids": np.array([10, 11, 12, eot], np.int32)})
    d = traj("d", versions=(0, 0), finish="stop", truncated=True)  # later turn cut by the context budget
    on = collate([a, b_, c, d], consuming_version=0, overlong_filter=True)
    assert on.loss_mask.any(-1).tolist() == [True, False, False, False]
    assert on.stats["overlong_masked_seqs"] == 3
    off = collate([a, b_, c, d], consuming_version=0, overlong_filter=False)
    assert off.loss_mask.any(-1).tolist() == [True, True, True, True]


def test_grpo_advantages_by_group_broadcast_to_sampled_tokens():
    ts = [
        traj("a", "g1", reward=1.0),
        traj("b", "g1", reward=0.0),
        traj("c", "g2", reward=1.0),
        traj("d", "g2", reward=1.0),
        traj("e", "g3", reward=0.3),
    ]
    b = collate(ts, consuming_version=0)
    assert b.seq_advantages.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0, 0.0])
    assert b.advantages[0].tolist() == [0, 0, 1, 1] and b.advantages[1].tolist() == [0, 0, -1, -1]
    assert sequence_advantages(torch.tensor([1.0, 0.0, 0.0]), ["x", "x", "x"], "rloo").tolist() == pytest.approx(
        [1.0, -0.5, -0.5]
    )
    with pytest.raises(ValueError, match="estimator"):
        sequence_advantages(torch.zeros(1), ["x"], "nope")


def test_case13_old_logits_from_answer_exact_fraction():
    t = traj(n_prompt=1, versions=(3, 3, 4, 4, 5))
    lp = np.array([0.0, NAN, NAN, -0.3, -0.4, -0.5], np.float32)
    st = np.array([TokenStatus.CONTEXT] + [TokenStatus.MISSING_EVICTED] * 2 + [TokenStatus.EXACT] * 3, np.int8)
    ans = OldLogitAnswer(request_id="r", route="snapshot", old_logprobs=[lp], status=[st], seconds=0.0)
    b = collate([t], consuming_version=5, old_logits=ans)
    assert b.exact_mask[0].tolist() == [False, False, False, True, True, True]
    assert float(b.exact_mask.sum()) / b.n_tokens == pytest.approx(0.6)
    assert torch.isnan(b.old_logprobs[0, :3]).all() and b.old_logprobs[0, 3:].tolist() == pytest.approx(
        [-0.3, -0.4, -0.5]
    )


def test_old_logits_attached_to_trajectory_or_given_as_arrays():
    old = np.array([0.0, 0.0, -0.2, NAN], np.float32)
    t = traj(versions=(0, 0), old=old)
    b = collate([t], consuming_version=1)
    assert b.exact_mask[0].tolist() == [False, False, True, False]  # prompt slot never exact
    b2 = collate([traj(versions=(0, 0))], consuming_version=1, old_logits=[np.array([0, 0, -0.2, -0.3], np.float32)])
    assert b2.exact_mask[0].tolist() == [False, False, True, True]
    with pytest.raises(ValueError, match="entries"):
        collate([t], consuming_version=1, old_logits=[None, None])


def test_raw_batch_validates_shapes_and_fills_defaults():
    ids = torch.ones(2, 3, dtype=torch.long)
    b = Batch(
        token_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=torch.ones(2, 3),
        behav_logprobs=torch.zeros(2, 3),
        advantages=torch.zeros(2, 3),
        consuming_version=4,
    )
    assert b.versions.unique().tolist() == [4] and b.staleness.unique().tolist() == [0] and not b.exact_mask.any()
    with pytest.raises(ValueError, match="advantages"):
        Batch(
            token_ids=ids,
            attention_mask=torch.ones_like(ids),
            loss_mask=torch.ones(2, 3),
            behav_logprobs=torch.zeros(2, 3),
            advantages=torch.zeros(2, 4),
        )


def test_mini_batches_split_rows_contiguously_near_equal():
    trajs = [traj(tid=f"t{i}", gid=f"g{i // 2}", versions=(0,) * (1 + i % 3), reward=float(i % 2)) for i in range(10)]
    b = collate(trajs, consuming_version=0)
    parts = b.mini_batches(3)
    assert [p.size for p in parts] == [4, 3, 3]  # 10 = 4 + 3 + 3, row order kept
    assert torch.equal(torch.cat([p.rewards for p in parts]), b.rewards)
    # advantages were computed over the whole batch before the split: each row keeps its own
    assert torch.equal(parts[1].seq_advantages, b.seq_advantages[4:7])
    assert sum(p.n_tokens for p in parts) == b.n_tokens
    assert parts[2].token_ids.shape[1] == 5  # trailing padding trimmed to the longest row (2 + 3)
    assert b.mini_batches(1)[0] is b
    assert torch.isnan(parts[0].recompute_logprobs).all()  # not taken until the learner takes it
    for bad in (0, 11):
        with pytest.raises(ValueError, match=f"learner.ppo_mini_batches: {bad} mini-batches for a batch of 10"):
            b.mini_batches(bad)


def test_collation_reports_response_lengths():
    b = collate([traj(versions=(0, 0, 0)), traj(tid="u", versions=(0,))], consuming_version=0)
    assert b.stats["response_tokens_mean"] == 2.0 and b.stats["response_tokens_max"] == 3.0


def test_tokens_of_the_consuming_version_without_an_exact_value_come_from_the_learner():
    from trainer.algorithm.batch import learner_gives_current

    # prompt 2, sampled versions 3, 4, 4 consumed at 4: the version-3 token has an exact value,
    # the two version-4 tokens have none -> current_mask on them only; off without the flag
    nan = float("nan")
    t = traj(versions=(3, 4, 4), old=np.array([nan, nan, -1.0, nan, nan], np.float32))
    b = collate([t], consuming_version=4, current_from_learner=True)
    assert b.exact_mask[0].tolist() == [False, False, True, False, False]
    assert b.current_mask[0].tolist() == [False, False, False, True, True]
    assert b.stats["current_exact_tokens"] == 2.0 and b.stats["exact_tokens"] == 1.0
    off = collate([t], consuming_version=4)
    assert not off.current_mask.any() and off.stats["current_exact_tokens"] == 0.0
    # the mask travels with the rows of every split
    assert b.micro_batches(1)[0].current_mask[0].tolist()[:5] == [False, False, False, True, True]
    assert [learner_gives_current(r, s) for r, s in [("snapshot", 1), ("snapshot", 2), ("none", 1), ("old_logit_model", 1)]] == [
        True, False, False, False,
    ]  # fmt: skip


def test_a_snapshot_request_leaves_the_consuming_versions_tokens_to_the_learner():
    from oldlogit_service.items import items_before

    # sampled versions 3, 4, 4 at positions 2-4; scored for consumption at 4: only position 2
    (item,) = items_before([traj(versions=(3, 4, 4))], 4)
    assert item.loss_mask.tolist() == [0, 0, 1, 0, 0] and item.versions.tolist() == [-1, -1, 3, 4, 4]


def test_to_moves_every_row_tensor_and_keeps_the_rest():
    ids = torch.tensor([[5, 6, 7], [8, 9, 2]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.bool)
    b = Batch(
        ids, torch.ones_like(ids), mask, torch.zeros(2, 3), torch.ones(2, 3), consuming_version=4, temperature=0.7
    )
    b.stats["groups"] = 1.0
    moved = b.to("meta")  # a device with shapes and no data: every row tensor must land there
    row = ("token_ids", "attention_mask", "loss_mask", "sampled_mask", "behav_logprobs", "versions", "staleness")
    row += (
        "old_logprobs",
        "exact_mask",
        "advantages",
        "rewards",
        "seq_advantages",
        "recompute_logprobs",
        "current_mask",
    )
    assert {getattr(moved, n).device.type for n in row} == {"meta"}
    assert (moved.consuming_version, moved.temperature, moved.stats) == (4, 0.7, {"groups": 1.0})
    back = b.to("cpu")  # already there: the same tensors, not copies
    assert back.token_ids is b.token_ids and back.n_tokens == 3
