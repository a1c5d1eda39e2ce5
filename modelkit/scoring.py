"""Learner-side scoring: per-token log-probs of given sequences under a model (learner numerics)."""

from __future__ import annotations

import torch


def sequence_logprobs(
    model: torch.nn.Module,
    token_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    first: int = 1,
) -> torch.Tensor:
    """Log-prob of each token given its prefix, with the sampling temperature applied.

    Args:
        model: an HF causal LM (returns ``.logits`` of shape ``[batch, seq, vocab]``).
        token_ids: ``[batch, seq]`` int64, right-padded.
        attention_mask: ``[batch, seq]`` 1 on real tokens.
        temperature: sampling temperature (> 0); logits are divided by it before log_softmax,
            exactly as the engine samples.
        first: the first position whose log-prob is wanted (>= 1). The output projection and the
            log-softmax over the vocabulary run only from position ``first - 1`` on (HF
            ``logits_to_keep``), so a caller that reads only completion tokens skips the prompt's
            vocabulary-sized logits; positions before ``first`` hold 0.0.

    Returns:
        ``[batch, seq]`` float32 log-probs in nats; position 0 (no prefix) and padding hold 0.0.
        Gradients flow when the caller has them enabled.

    Raises:
        ValueError: ``temperature`` is not > 0.
    """
    if not temperature > 0:
        raise ValueError(f"temperature: must be > 0 for log-prob ratios, got {temperature}")
    T = token_ids.shape[1]
    first = min(max(1, int(first)), T)
    if first == 1:
        logits = model(input_ids=token_ids, attention_mask=attention_mask).logits  # [B, T, V]
    else:  # logits of positions first-1 .. T-1 only: [B, T - first + 1, V]
        logits = model(input_ids=token_ids, attention_mask=attention_mask, logits_to_keep=T - first + 1).logits
    logits = logits[:, :-1].float() / temperature  # predicts tokens first..T-1
    lp = torch.log_softmax(logits, dim=-1).gather(-1, token_ids[:, first:, None]).squeeze(-1)  # [B, T-first]
    lp = lp * attention_mask[:, first:].to(lp.dtype)
    return torch.cat([lp.new_zeros((lp.shape[0], first)), lp], dim=1)
