"""Learner-side scoring: per-token log-probs of given sequences under a model (learner numerics)."""

from __future__ import annotations

import torch


def sequence_logprobs(
    model: torch.nn.Module, token_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Log-prob of each token given its prefix, with the sampling temperature applied.

    Args:
        model: an HF causal LM (returns ``.logits`` of shape ``[batch, seq, vocab]``).
        token_ids: ``[batch, seq]`` int64, right-padded.
        attention_mask: ``[batch, seq]`` 1 on real tokens.
        temperature: sampling temperature (> 0); logits are divided by it before log_softmax,
            exactly as the engine samples.

    Returns:
        ``[batch, seq]`` float32 log-probs in nats; position 0 (no prefix) and padding hold 0.0.
        Gradients flow when the caller has them enabled.

    Raises:
        ValueError: ``temperature`` is not > 0.
    """
    if not temperature > 0:
        raise ValueError(f"temperature: must be > 0 for log-prob ratios, got {temperature}")
    logits = model(input_ids=token_ids, attention_mask=attention_mask).logits  # [B, T, V]
    logits = logits[:, :-1].float() / temperature  # predicts tokens 1..T-1
    lp = torch.log_softmax(logits, dim=-1).gather(-1, token_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
    lp = lp * attention_mask[:, 1:].to(lp.dtype)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
