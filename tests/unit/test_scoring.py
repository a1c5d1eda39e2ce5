"""sequence_logprobs from a first position equals the full computation there, and 0.0 before it."""

from __future__ import annotations

import math

import pytest
import torch

from modelkit.modelhub import load_causal_lm
from modelkit.scoring import sequence_logprobs
from trainer.algorithm.batch import Batch
from trainer.learner import first_loss_position


def test_logprobs_from_a_first_position_match_the_full_forward(tiny_model_path):
    model = load_causal_lm(str(tiny_model_path), "float32").eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (2, 9), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 7:] = 0  # a right-padded row
    with torch.no_grad():
        full = sequence_logprobs(model, ids, attn, temperature=0.7)
        part = sequence_logprobs(model, ids, attn, temperature=0.7, first=5)
    assert part.shape == full.shape == (2, 9)
    assert torch.equal(part[:, :5], torch.zeros(2, 5))
    torch.testing.assert_close(part[:, 5:], full[:, 5:], rtol=0, atol=1e-5)
    assert torch.equal(part[1, 7:], torch.zeros(2))  # padding stays 0.0


def test_first_loss_position_is_the_first_trained_column():
    mask = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    mb = Batch.__new__(Batch)
    object.__setattr__(mb, "loss_mask", mask)
    assert first_loss_position(mb) == 5
    object.__setattr__(mb, "loss_mask", torch.zeros_like(mask))
    assert first_loss_position(mb) == 1


class _ConstantLogits(torch.nn.Module):
    """A stand-in causal LM whose logits are the same at every position: ``[0, 0, 0, 0]`` then
    ``[log 1, log 2, log 3, log 4]`` scaled by the position index (0 at position 0)."""

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0):
        b, t = input_ids.shape
        base = torch.log(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        logits = torch.arange(t, dtype=torch.float32)[None, :, None] * base  # [1, T, 4]
        logits = logits.expand(b, t, 4)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return type("Out", (), {"logits": logits})()


def test_entropy_of_each_position_by_hand():
    """Position 1 is predicted from position 0's uniform logits: H = log 4 = 1.386294; position 2
    from logits k * log[1, 2, 3, 4] with k = 1: p = [0.1, 0.2, 0.3, 0.4],
    H = -(0.1 ln 0.1 + 0.2 ln 0.2 + 0.3 ln 0.3 + 0.4 ln 0.4) = 1.279854; token 3 there has log 0.4."""
    from modelkit.scoring import sequence_logprobs_and_entropy

    ids = torch.tensor([[0, 1, 3]])
    lp, ent = sequence_logprobs_and_entropy(_ConstantLogits(), ids, torch.ones_like(ids), temperature=1.0)
    torch.testing.assert_close(ent, torch.tensor([[0.0, 1.386294, 1.279854]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(lp, torch.tensor([[0.0, -1.386294, math.log(0.4)]]), rtol=0, atol=1e-6)
    assert torch.equal(lp, sequence_logprobs(_ConstantLogits(), ids, torch.ones_like(ids), 1.0))
    # temperature 2 on the uniform row leaves it uniform; a padded position holds 0.0
    lp, ent = sequence_logprobs_and_entropy(_ConstantLogits(), ids, torch.tensor([[1, 1, 0]]), temperature=2.0)
    assert ent[0, 1].item() == pytest.approx(math.log(4)) and ent[0, 2].item() == 0.0 and lp[0, 2].item() == 0.0
