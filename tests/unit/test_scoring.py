"""sequence_logprobs: a first position equals the full computation there (0.0 before it); the
chunked path (the default) equals the full-logit path in values, entropies and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from modelkit.lora import wrap_lora
from modelkit.modelhub import load_causal_lm
from modelkit.scoring import (
    DEFAULT_CHUNK_BYTES,
    _causal_lm,
    enable_gradient_checkpointing,
    scoring_mode,
    sequence_logprobs,
    sequence_logprobs_and_entropy,
)
from protocol import AdapterSpec
from trainer.algorithm.batch import Batch, first_loss_position


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
    with torch.no_grad():
        whole = sequence_logprobs(model, ids, attn, temperature=0.7, first=5, chunk_bytes=0)
    torch.testing.assert_close(part, whole, rtol=0, atol=1e-5)


def test_first_loss_position_is_the_first_trained_column():
    mask = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    mb = Batch.__new__(Batch)
    object.__setattr__(mb, "loss_mask", mask)
    assert first_loss_position(mb) == 5
    object.__setattr__(mb, "loss_mask", torch.zeros_like(mask))
    assert first_loss_position(mb) == 1


class _ConstantLogits(torch.nn.Module):
    """A stand-in causal LM whose logits are the same at every position: ``[0, 0, 0, 0]`` then
    ``[log 1, log 2, log 3, log 4]`` scaled by the position index (0 at position 0). Its hidden
    state at position t is ``[t]`` and its output projection the column ``log [1, 2, 3, 4]``, so
    both the full-logit and the chunked path run on it."""

    config = type("Config", (), {"num_hidden_layers": 1, "vocab_size": 4})()

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(1, 4, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(torch.log(torch.tensor([[1.0], [2.0], [3.0], [4.0]])))

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0, output_hidden_states=None):
        b, t = input_ids.shape
        hidden = torch.arange(t, dtype=torch.float32)[None, :, None].expand(b, t, 1)  # [B, T, 1]
        logits = self.head(hidden)  # [B, T, 4]
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return type("Out", (), {"logits": logits, "hidden_states": (hidden,) if output_hidden_states else None})()


@pytest.mark.parametrize("chunk_bytes", [0, 4 * 4, DEFAULT_CHUNK_BYTES])  # full, one position per chunk, one chunk
def test_entropy_of_each_position_by_hand(chunk_bytes):
    """Position 1 is predicted from position 0's uniform logits: H = log 4 = 1.386294; position 2
    from logits k * log[1, 2, 3, 4] with k = 1: p = [0.1, 0.2, 0.3, 0.4],
    H = -(0.1 ln 0.1 + 0.2 ln 0.2 + 0.3 ln 0.3 + 0.4 ln 0.4) = 1.279854; token 3 there has log 0.4."""
    ids = torch.tensor([[0, 1, 3]])
    model, kw = _ConstantLogits(), {"chunk_bytes": chunk_bytes}
    with torch.no_grad():
        lp, ent = sequence_logprobs_and_entropy(model, ids, torch.ones_like(ids), temperature=1.0, **kw)
        torch.testing.assert_close(ent, torch.tensor([[0.0, 1.386294, 1.279854]]), rtol=0, atol=1e-6)
        torch.testing.assert_close(lp, torch.tensor([[0.0, -1.386294, math.log(0.4)]]), rtol=0, atol=1e-6)
        assert torch.equal(lp, sequence_logprobs(model, ids, torch.ones_like(ids), 1.0, **kw))
        # temperature 2 on the uniform row leaves it uniform; a padded position holds 0.0
        lp, ent = sequence_logprobs_and_entropy(model, ids, torch.tensor([[1, 1, 0]]), temperature=2.0, **kw)
    assert ent[0, 1].item() == pytest.approx(math.log(4)) and ent[0, 2].item() == 0.0 and lp[0, 2].item() == 0.0


def test_a_negative_chunk_budget_is_refused():
    ids = torch.tensor([[0, 1, 3]])
    with pytest.raises(ValueError, match="chunk_bytes"):
        sequence_logprobs(_ConstantLogits(), ids, torch.ones_like(ids), 1.0, chunk_bytes=-1)


class _FixedLogits(torch.nn.Module):
    """A stand-in causal LM whose logits at each position are the given rows ``[T, V]``: its hidden
    state is the row itself (a leaf with a gradient) and its output projection the identity, so
    both the full-logit and the chunked path run on it."""

    def __init__(self, rows):
        super().__init__()
        self.rows = torch.nn.Parameter(torch.tensor(rows))  # [T, V]
        self.config = type("Config", (), {"num_hidden_layers": 1, "vocab_size": self.rows.shape[1]})()
        self.head = torch.nn.Linear(self.rows.shape[1], self.rows.shape[1], bias=False)
        with torch.no_grad():
            self.head.weight.copy_(torch.eye(self.rows.shape[1]))
        self.head.weight.requires_grad_(False)

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0, output_hidden_states=None):
        hidden = self.rows[None].expand(input_ids.shape[0], -1, -1)  # [B, T, V]
        logits = self.head(hidden)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return type("Out", (), {"logits": logits, "hidden_states": (hidden,) if output_hidden_states else None})()


# token 1 is drawn from logits [2, 1, 0], token 2 from the same row; the third row predicts nothing
SAME_ROWS, IDS = [[2.0, 1.0, 0.0], [2.0, 1.0, 0.0], [0.0, 0.0, 0.0]], torch.tensor([[2, 0, 1]])


@pytest.mark.parametrize("chunk_bytes", [0, DEFAULT_CHUNK_BYTES])
def test_temperature_divides_the_logits_before_the_log_softmax(chunk_bytes):
    """T = 0.5: logits [4, 2, 0], log Z = 4 + log(1 + e^-2 + e^-4) = 4.14293, so token 0 has
    -0.14293 and token 1 -2.14293; T = 1: log Z = 2.40761, -0.40761 and -1.40761."""
    model, ones = _FixedLogits(SAME_ROWS), torch.ones_like(IDS)
    with torch.no_grad():
        half = sequence_logprobs(model, IDS, ones, 0.5, chunk_bytes=chunk_bytes)
        one = sequence_logprobs(model, IDS, ones, 1.0, chunk_bytes=chunk_bytes)
    torch.testing.assert_close(half, torch.tensor([[0.0, -0.14293, -2.14293]]), rtol=0, atol=1e-5)
    torch.testing.assert_close(one, torch.tensor([[0.0, -0.40761, -1.40761]]), rtol=0, atol=1e-5)


def test_the_same_temperature_on_both_sides_gives_a_discrepancy_ratio_of_one():
    from trainer.algorithm.losses import discrepancy_ratio

    model, logits, ids = _FixedLogits(SAME_ROWS), torch.tensor(SAME_ROWS[:2])[None], IDS[:, 1:]
    with torch.no_grad():
        prox = sequence_logprobs(model, IDS, torch.ones_like(IDS), 0.5)[:, 1:]
    mu = torch.distributions.Categorical(logits=logits / 0.5).log_prob(ids)  # the engine's sampler
    torch.testing.assert_close(discrepancy_ratio(prox, mu, torch.ones(1, 2)), torch.ones(1, 2), rtol=0, atol=1e-6)
    # the failure signature this guards against: the engine side skipped the temperature
    # (d = e^(-0.14293 + 0.40761) = 1.303, e^(-2.14293 + 1.40761) = 0.479)
    raw_mu = torch.distributions.Categorical(logits=logits).log_prob(ids)
    skipped = discrepancy_ratio(prox, raw_mu, torch.ones(1, 2))
    torch.testing.assert_close(skipped, torch.tensor([[1.303, 0.479]]), rtol=0, atol=1e-3)


@pytest.mark.parametrize("chunk_bytes", [0, DEFAULT_CHUNK_BYTES])
def test_the_gradient_of_a_log_prob_with_respect_to_its_logits_by_hand(chunk_bytes):
    """d log softmax(z / T)_i / dz = (onehot_i - softmax(z / T)) / T. z = [2, 1, 0], T = 0.5, i = 0:
    softmax([4, 2, 0]) = [0.866813, 0.117310, 0.015876], gradient [0.266373, -0.234620, -0.031753]
    on row 0, which predicts position 1; the other rows get none."""
    model = _FixedLogits(SAME_ROWS)
    lp = sequence_logprobs(model, IDS, torch.ones_like(IDS), 0.5, chunk_bytes=chunk_bytes)
    lp[0, 1].backward()
    expected = torch.tensor([[0.266373, -0.234620, -0.031753], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(model.rows.grad, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, float("nan"), float("inf"), True, "1"])
def test_a_temperature_that_is_not_a_finite_number_above_zero_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="^temperature: must be a finite number > 0"):
        sequence_logprobs(_FixedLogits(SAME_ROWS), IDS, torch.ones_like(IDS), bad)


# Tolerances of the chunked path against the full-logit path (fp32, CPU). The two differ only in
# the shape of the output projection's matmul (a chunk's rows instead of the whole sequence's):
# observed 0 (bit-identical) for chunks of 2 or more positions and <= 1e-6 nats (log-probs),
# <= 8e-6 nats (entropies, ~10.8 nats here) with one position per chunk; gradients <= 2e-6.
LP_ATOL, ENT_ATOL, GRAD_RTOL, GRAD_ATOL = 1e-5, 2e-5, 1e-4, 1e-5

B, T, V = 3, 11, 49152


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``([B, T] ids over the whole vocabulary, [B, T] mask with a right-padded row, [B, T] weights)``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 6:] = 0
    return ids, attn, torch.randn(B, T, generator=g)


def _positions(n: int) -> int:
    """``chunk_bytes`` giving ``n`` positions per chunk for a batch of ``B`` rows."""
    return n * B * V * 4


@pytest.mark.parametrize("first", [1, 4])
@pytest.mark.parametrize("positions", [1, 3, 4, 64])  # 3 and 4 do not divide T - first; 64 > T: one chunk
def test_chunked_matches_full_logits_values_and_entropy(tiny_model_path, first, positions):
    model = load_causal_lm(str(tiny_model_path), "float32").eval()
    ids, attn, _ = _batch()
    with torch.no_grad():
        ref_lp, ref_ent = sequence_logprobs_and_entropy(model, ids, attn, 0.7, first, chunk_bytes=0)
        lp, ent = sequence_logprobs_and_entropy(model, ids, attn, 0.7, first, chunk_bytes=_positions(positions))
    assert lp.shape == ent.shape == ref_lp.shape == (B, T) and lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=LP_ATOL)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=ENT_ATOL)
    assert torch.equal(lp[:, :first], torch.zeros(B, first)) and torch.equal(ent[:, :first], torch.zeros(B, first))
    assert torch.equal(lp[1, 6:], torch.zeros(T - 6)) and torch.equal(ent[1, 6:], torch.zeros(T - 6))  # padding


def _grads(model, ids, attn, w, first, chunk_bytes, entropy_bonus: float = 0.0) -> dict[str, torch.Tensor]:
    """Gradients of ``sum(w * log-probs + entropy_bonus * entropies)`` (the entropy's gradient only
    with a bonus)."""
    model.zero_grad(set_to_none=True)
    lp, ent = sequence_logprobs_and_entropy(
        model, ids, attn, 0.7, first, chunk_bytes=chunk_bytes, entropy_grad=entropy_bonus != 0
    )
    (lp * w + entropy_bonus * ent).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("first,positions", [(1, 2), (4, 3), (4, 64)])
def test_chunked_gradients_match_full_logits(tiny_model_path, first, positions):
    """Backward of a weighted sum of log-probs: every parameter's gradient (the tied output
    projection among them), every chunk's logits but the last recomputed in backward (64
    positions: one chunk, kept)."""
    model = load_causal_lm(str(tiny_model_path), "float32").train()
    ids, attn, w = _batch(seed=1)
    ref = _grads(model, ids, attn, w, first, chunk_bytes=0)
    got = _grads(model, ids, attn, w, first, chunk_bytes=_positions(positions))
    assert got.keys() == ref.keys() and len(ref) == len(list(model.parameters()))
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=k)


@pytest.mark.parametrize("positions,recomputed", [(64, 0), (T - 1, 0), (T - 2, 1), (3, 3)])
def test_backward_recomputes_every_chunk_but_the_last(tiny_model_path, monkeypatch, positions, recomputed):
    """first = 1 wants T - 1 = 10 positions: chunks of 10 or more positions are one chunk kept for
    backward (no checkpoint); 9 positions a chunk make 2 chunks (1 checkpointed), 3 make 4 (3)."""
    import modelkit.scoring as scoring

    calls = []
    real = scoring.checkpoint
    monkeypatch.setattr(scoring, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = load_causal_lm(str(tiny_model_path), "float32").train()
    ids, attn, w = _batch(seed=1)
    _grads(model, ids, attn, w, 1, chunk_bytes=_positions(positions))
    assert len(calls) == recomputed


@pytest.mark.parametrize("positions", [64, 3])  # one kept chunk; 4 chunks, 3 recomputed
def test_an_entropy_bonus_has_the_full_logit_gradients_in_one_chunk_or_several(tiny_model_path, positions):
    """The learner's default micro-batch with the adaptive entropy bonus: backward of log-probs
    plus 0.1 x entropy equals the full-logit path's."""
    model = load_causal_lm(str(tiny_model_path), "float32").train()
    ids, attn, w = _batch(seed=2)
    ref = _grads(model, ids, attn, w, 4, chunk_bytes=0, entropy_bonus=0.1)
    got = _grads(model, ids, attn, w, 4, chunk_bytes=_positions(positions), entropy_bonus=0.1)
    assert got.keys() == ref.keys() and len(ref) == len(list(model.parameters()))
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=k)


def test_chunked_gradients_match_full_logits_through_a_lora_adapter(tiny_model_path):
    model = wrap_lora(
        load_causal_lm(str(tiny_model_path), "float32"),
        AdapterSpec(rank=4, alpha=8.0, target_modules=["q_proj", "down_proj"]),
    )
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # B = 0 at the start: give the adapter an effect
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    ids, attn, w = _batch(seed=2)
    ref = _grads(model, ids, attn, w, 3, chunk_bytes=0)
    got = _grads(model, ids, attn, w, 3, chunk_bytes=_positions(3))
    assert got.keys() == ref.keys() and all("lora_" in k for k in ref) and ref
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=k)


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_gives_the_stored_activation_gradients(tiny_model_path, lora):
    """Every trainable parameter's gradient (full weights, or only the adapter on a frozen base)
    with each decoder layer recomputed in backward equals the stored-activation gradient."""

    def build():  # the same adapter factors A in both builds
        torch.manual_seed(0)
        m = load_causal_lm(str(tiny_model_path), "float32")
        if lora:
            m = wrap_lora(m, AdapterSpec(rank=4, alpha=8.0, target_modules=["q_proj", "down_proj"]), dropout=0.0)
            with torch.no_grad():
                for n, p in m.named_parameters():
                    if "lora_B" in n:
                        p.fill_(0.05)
        return m.train()

    ids, attn, w = _batch(seed=3)
    ref = _grads(build(), ids, attn, w, 3, chunk_bytes=_positions(3))
    model = build()
    enable_gradient_checkpointing(model)
    assert _causal_lm(model).is_gradient_checkpointing
    got = _grads(model, ids, attn, w, 3, chunk_bytes=_positions(3))
    assert got.keys() == ref.keys() and ref
    assert all("lora_" in k for k in ref) if lora else len(ref) == len(list(model.parameters()))
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-7, msg=k)


def test_gradient_checkpointing_needs_an_hf_model():
    with pytest.raises(ValueError, match="gradient_checkpointing: Linear has no gradient_checkpointing_enable"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2))


def test_the_learner_keeps_the_demo_micro_batch_in_one_chunk_and_scoring_chunks_smaller():
    """160 MiB hold 16 rows x 53 positions x 49,152 fp32 logits (the demo's replies are <= 48
    tokens, its prompts within a few tokens of each other); no-grad scoring keeps 64 MiB chunks (42
    positions of 8 rows)."""
    from trainer.driver.config.schema import LearnerConfig

    assert LearnerConfig().logprob_chunk_bytes == 160 * 2**20
    assert LearnerConfig().logprob_chunk_bytes // (16 * V * 4) == 53
    assert DEFAULT_CHUNK_BYTES // (8 * V * 4) == 42


def test_scoring_mode_scores_without_grad_in_eval_mode_and_restores_the_mode():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    with scoring_mode(model) as m:
        assert m is model and not model.training and not torch.is_grad_enabled()
        assert not model(torch.ones(1, 2)).requires_grad
    assert model.training and torch.is_grad_enabled()
    model.eval()
    with pytest.raises(RuntimeError, match="boom"), scoring_mode(model):
        model.train()  # a forward that changed the mode and then raised
        raise RuntimeError("boom")
    assert not model.training  # the mode it had before, eval
