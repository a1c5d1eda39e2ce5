"""Packed scoring: rows packed first-fit decreasing give the padded path's log-probs, entropies and
gradients, and no token attends across the sequences of one packed row."""

from __future__ import annotations

import pytest
import torch

from modelkit.modelhub import load_causal_lm
from modelkit.scoring import pack_rows, packed_token_counts, sequence_logprobs_and_entropy

LENGTHS = [11, 4, 7, 2, 9]
B, T, V = len(LENGTHS), 11, 49152
ATOL = 2e-5
"""Packed against padded, fp32: the same arithmetic on matrices of other shapes, so only the
rounding of the CPU kernels' blocking differs (measured at most 1e-6 in log-probs, 8e-6 in entropies)."""


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``([B, T] ids, [B, T] right-padded mask of LENGTHS, [B, T] weights)``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    attn = (torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]).long()
    return ids, attn, torch.randn(B, T, generator=g)


def test_rows_pack_first_fit_decreasing():
    assert pack_rows([5, 3, 4, 2, 6], 8) == [[4, 3], [0, 1], [2]]
    assert pack_rows([5, 3, 4, 2, 6], 6) == [[4], [0], [2, 3], [1]]
    assert pack_rows([0, 2, 0], 4) == [[1]] and pack_rows([], 4) == []
    with pytest.raises(ValueError, match=r"lengths\[1\]: 9 tokens do not fit a packed row of 8"):
        pack_rows([1, 9], 8)


def test_packed_token_counts_of_the_test_batch():
    """LENGTHS at width 11: bins [[0], [4, 3], [2, 1]] fill 11, 11, 11: 3 x 11 = 33 of 55 padded."""
    _, attn, _ = _batch()
    assert pack_rows(LENGTHS, T) == [[0], [4, 3], [2, 1]]
    assert packed_token_counts(attn) == (55, 33)
    assert packed_token_counts(torch.tensor([[1, 1, 0], [1, 0, 0]])) == (6, 3)


@pytest.mark.parametrize("first,chunk_bytes", [(1, 0), (1, 3 * V * 4), (4, 2 * V * 4), (4, 10**9)])
def test_packed_scoring_equals_the_padded_path(tiny_model_path, first, chunk_bytes):
    model = load_causal_lm(str(tiny_model_path), "float32").eval()
    ids, attn, _ = _batch()
    with torch.no_grad():
        ref_lp, ref_ent = sequence_logprobs_and_entropy(model, ids, attn, 0.7, first, chunk_bytes=0)
        lp, ent = sequence_logprobs_and_entropy(model, ids, attn, 0.7, first, chunk_bytes=chunk_bytes, packed=True)
    assert lp.shape == ent.shape == (B, T) and lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=ATOL)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=ATOL)
    assert torch.equal(lp[:, :first], torch.zeros(B, first)) and torch.equal(lp[3, 2:], torch.zeros(T - 2))


def test_a_packed_row_does_not_attend_across_its_sequences(tiny_model_path):
    """Rows 3 and 4 share a packed row (after row 4): changing row 4's tokens leaves row 3's log-probs."""
    model = load_causal_lm(str(tiny_model_path), "float32").eval()
    ids, attn, _ = _batch()
    other = ids.clone()
    other[4, :9] = (other[4, :9] + 17) % V
    with torch.no_grad():
        a, _ = sequence_logprobs_and_entropy(model, ids, attn, 1.0, entropy=False, packed=True)
        b, _ = sequence_logprobs_and_entropy(model, other, attn, 1.0, entropy=False, packed=True)
    assert torch.equal(a[3], b[3]) and not torch.equal(a[4], b[4])


def _grads(model, ids, attn, w, packed: bool, entropy_grad: bool) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    lp, ent = sequence_logprobs_and_entropy(
        model, ids, attn, 0.7, 4, chunk_bytes=2 * V * 4, entropy_grad=entropy_grad, packed=packed
    )
    (lp * w + (0.1 * ent if entropy_grad else 0)).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_packed_gradients_equal_the_padded_path(tiny_model_path, entropy_grad):
    model = load_causal_lm(str(tiny_model_path), "float32").train()
    ids, attn, w = _batch(seed=1)
    ref = _grads(model, ids, attn, w, False, entropy_grad)
    got = _grads(model, ids, attn, w, True, entropy_grad)
    assert got.keys() == ref.keys() and len(ref) == len(list(model.parameters()))
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-5, msg=k)


def test_packing_refuses_a_row_that_is_not_right_padded(tiny_model_path):
    model = load_causal_lm(str(tiny_model_path), "float32").eval()
    ids, attn, _ = _batch()
    attn[2, 0] = 0
    with pytest.raises(ValueError, match=r"attention_mask: row 2 is not right-padded"):
        sequence_logprobs_and_entropy(model, ids, attn, 1.0, packed=True)
