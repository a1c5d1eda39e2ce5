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
    return sequence_logprobs_and_entropy(model, token_ids, attention_mask, temperature, first, entropy=False)[0]


def sequence_logprobs_and_entropy(
    model: torch.nn.Module,
    token_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    first: int = 1,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`sequence_logprobs` and, with ``entropy``, the entropy of each position's next-token
    distribution ``H_t = -sum_v p_v log p_v`` (nats, at the sampling temperature, no gradient).

    Returns ``([batch, seq] log-probs, [batch, seq] entropies or None)``; the entropy at position t
    is that of the distribution token t was drawn from, 0.0 before ``first`` and on padding.
    Example: a uniform distribution over 4 tokens has entropy log 4 = 1.386294 nats.
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
    log_p = torch.log_softmax(logits, dim=-1)  # [B, T-first, V]
    real = attention_mask[:, first:].to(torch.float32)
    lp = log_p.gather(-1, token_ids[:, first:, None]).squeeze(-1) * real  # [B, T-first]
    pad = lp.new_zeros((lp.shape[0], first))
    ent = None
    if entropy:
        with torch.no_grad():
            ent = torch.cat([pad, -(log_p.exp() * log_p).sum(-1) * real], dim=1)
    return torch.cat([pad, lp], dim=1), ent
