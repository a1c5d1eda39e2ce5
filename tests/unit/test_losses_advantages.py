"""Advantages, returns, lengths and truncation."""

import math

import pytest
import torch

from trainer.algorithm.advantages import (
    generated_lengths,
    grpo_advantages,
    overlong_penalty,
    reinforce_returns,
    rloo_advantages,
    truncation_mask,
    zero_variance_groups,
)
from trainer.algorithm.losses import aggregate


def test_grpo_population_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 2.0, 1.0]])
    adv = grpo_advantages(rewards)
    assert adv[0].tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0])
    std = math.sqrt(0.5)
    assert adv[1].tolist() == pytest.approx([0.0, -1 / std, 1 / std, 0.0])
    # population, not sample std: a pair [1, 0] gives +-1 (sample std would give +-0.707)
    assert grpo_advantages(torch.tensor([[1.0, 0.0]])).tolist() == [[1.0, -1.0]]


def test_grpo_with_group_ids_of_unequal_size():
    rewards = torch.tensor([1.0, 5.0, 0.0, 3.0, 0.0, 1.0])
    ids = torch.tensor([7, 2, 7, 2, 7, 9])
    adv = grpo_advantages(rewards, ids)
    mean7, std7 = 1 / 3, math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 3)
    expected = [(1 - mean7) / std7, 1.0, -mean7 / std7, -1.0, -mean7 / std7, 0.0]
    assert adv.tolist() == pytest.approx(expected)
    assert grpo_advantages(rewards, ids, scale=False).tolist() == pytest.approx(
        [1 - mean7, 1.0, -mean7, -1.0, -mean7, 0.0]
    )


def test_grpo_floor_keeps_near_zero_variance_groups_small():
    adv = grpo_advantages(torch.tensor([[1.0, 1.0, 1.0, 1.0 + 1e-6]], dtype=torch.float64))
    assert torch.isfinite(adv).all() and adv.abs().max().item() < 1e-2
    assert grpo_advantages(torch.tensor([[0.3, 0.3, 0.3]])).tolist() == [[0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="std_floor"):
        grpo_advantages(torch.zeros(1, 2), std_floor=0.0)
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(torch.zeros(4))


def test_equal_rewards_not_representable_in_binary_give_exact_zero():
    # the fp32 mean of eight 0.35 is 2.98e-8 below fp32(0.35): without the rule that residue over
    # the 1e-3 std floor gives every sample +2.98e-5 (GRPO); three 0.1 give RLOO -7.45e-9 each
    eights = torch.full((1, 8), 0.35)
    assert (eights.mean() - eights[0, 0]).item() != 0.0  # the residue the rule guards against
    threes = torch.full((1, 3), 0.1)
    for r in (eights, threes):
        assert grpo_advantages(r).tolist() == [[0.0] * r.shape[1]]
        assert grpo_advantages(r, scale=False).tolist() == [[0.0] * r.shape[1]]
        assert rloo_advantages(r).tolist() == [[0.0] * r.shape[1]]
    # flat form with group ids: the equal group is exactly 0, the other group is untouched
    flat = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0])
    gid = torch.tensor([7, 7, 7, 2, 2])
    assert grpo_advantages(flat, gid).tolist() == [0.0, 0.0, 0.0, 1.0, -1.0]
    assert rloo_advantages(flat, gid).tolist() == [0.0, 0.0, 0.0, 1.0, -1.0]


def test_zero_variance_groups_counted():
    rewards = torch.tensor([[0.35] * 4, [1.0, 0.0, 0.0, 0.0], [0.1] * 4, [0.0] * 4])
    assert zero_variance_groups(rewards) == 3
    assert zero_variance_groups(torch.tensor([0.1, 0.1, 0.2, 5.0]), torch.tensor([0, 0, 0, 1])) == 1  # one of size 1


def test_rloo_leave_one_out():
    adv = rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    assert adv.tolist()[0] == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert rloo_advantages(torch.tensor([1.0, 4.0]), torch.tensor([0, 1])).tolist() == [0.0, 0.0]  # groups of one


def test_reinforce_returns_discount_model_tokens_only():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])  # second row: a tool token in the middle
    returns = reinforce_returns(rewards, mask, gamma=0.5)
    assert returns.tolist() == [[0.25, 0.5, 1.0], [0.5, 0.0, 1.0]]
    assert reinforce_returns(rewards, mask).tolist() == [[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]]
    with pytest.raises(ValueError, match="gamma"):
        reinforce_returns(rewards, mask, gamma=1.5)


def test_case7_lengths_and_denominator_count_model_tokens_only():
    action_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1]])
    lengths = generated_lengths(action_mask)
    assert lengths.tolist() == [9]  # not the 12-token span
    # expected length 10, overlong buffer starting at 10 (max_length 14, buffer 4)
    assert overlong_penalty(lengths, max_length=14, buffer_length=4).tolist() == [0.0]
    assert overlong_penalty(torch.tensor([12]), max_length=14, buffer_length=4).tolist() == [-0.5]  # the span would be
    assert overlong_penalty(torch.tensor([10, 14, 20]), 14, 4).tolist() == [0.0, -1.0, -1.0]
    per_token = torch.ones(1, 15)
    per_token[action_mask == 0] = float("nan")  # tool and prompt tokens: placeholder, never read
    assert aggregate(per_token, action_mask).item() == pytest.approx(1.0)  # 9 / 9
    assert aggregate(torch.arange(15.0)[None], action_mask).item() == pytest.approx(
        sum([3, 4, 5, 6, 10, 11, 12, 13, 14]) / 9
    )
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(lengths, 4, 10)


def test_case9_truncation_from_finish_reason():
    mask = torch.ones(4, 3, dtype=torch.int8)
    # (a) stop on an end-of-turn id that is not the tokenizer's eos: kept; (b) length: masked;
    # (c) length whose last token happens to be end-of-turn: masked; (d) stop, but a later turn
    # was cut by the context budget: masked
    out = truncation_mask(mask, ["stop", "length", "length", "stop"], truncated=[False, False, False, True])
    assert out.tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert out.dtype == torch.int8
    assert truncation_mask(mask[:1].bool(), ["abort"]).tolist() == [[False] * 3]
    for bad in (None, "eos", ""):
        with pytest.raises(ValueError, match="finish_reasons"):
            truncation_mask(mask[:1], [bad])
    with pytest.raises(ValueError, match="entries"):
        truncation_mask(mask, ["stop"])
