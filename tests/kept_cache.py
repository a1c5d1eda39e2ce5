"""What a request kept across a weight update samples from: the learner's own computation of it."""

from __future__ import annotations

import numpy as np
import torch


@torch.no_grad()
def kept_cache_logprobs(model, w0: dict, w1: dict, prompt: list[int], tokens: list[int], k: int, temperature: float):
    """``[len(tokens) - k]`` log-probs (nats) of ``tokens[k:]`` for a request that had sampled
    ``tokens[:k]`` (``k >= 1``) under weights ``w0`` when ``w1`` was applied: the KV cache of
    ``prompt + tokens[:k-1]`` is ``w0``'s (the last sampled token is fed at the next step, under
    ``w1``), and each later token is fed under ``w1`` one at a time, as a stepping engine does;
    ``log_softmax(logits / T)`` of each token. ``model`` (an HF causal LM) is left holding ``w1``."""
    model.load_state_dict(w0, strict=False)
    cache = model(input_ids=torch.tensor([prompt + tokens[: k - 1]]), use_cache=True).past_key_values
    model.load_state_dict(w1, strict=False)
    lps = []
    for i in range(k, len(tokens)):
        out = model(input_ids=torch.tensor([[tokens[i - 1]]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        lps.append(float(torch.log_softmax(out.logits[0, -1].float() / temperature, dim=-1)[tokens[i]]))
    return np.asarray(lps)
