"""sequence_logprobs from a first position equals the full computation there, and 0.0 before it."""

from __future__ import annotations

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
