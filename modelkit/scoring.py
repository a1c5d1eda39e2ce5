"""Learner-side scoring: per-token log-probs of given sequences under a model (learner numerics).

Two paths give the same numbers (the temperature applied to fp32 logits, then ``log_softmax``):

* **chunked** (default, ``chunk_bytes > 0``): the model body runs once and returns its final,
  post-norm hidden states ``[batch, seq, hidden]`` (HF ``output_hidden_states`` with only the last
  layer recorded, ``logits_to_keep=1``); the output projection, the temperature, the log-softmax
  and the gather then run over chunks of positions. One chunk's fp32 logits ``[batch, chunk, vocab]``
  take at most ``chunk_bytes``. Under autograd every chunk but the last sits inside
  ``torch.utils.checkpoint`` (non-reentrant), so backward recomputes its logits instead of keeping
  them; the last chunk (the only one when every wanted position fits) is kept for backward, whose
  first step frees it before any other chunk is recomputed. No fp32 logits tensor larger than
  ``chunk_bytes`` exists in the forward or in the saved graph; the price is one extra output
  projection and log-softmax in backward per chunk but the last.
* **full** (``chunk_bytes=0``): HF's own forward materialises the ``[batch, seq, vocab]``
  logits, and autograd keeps the log-softmax of them for backward.

With ``packed=True`` no compute is spent on padding: the right-padded rows are packed first-fit
decreasing into as few rows as hold them, none longer than the padded width (so no packed row's
attention costs more than a padded row's), each sequence restarting its ``position_ids`` at 0 and
no attention mask given. HF then builds a block-diagonal causal mask from the position ids (a new
sequence wherever the position does not grow by 1), so every token attends only to its own
sequence, as in the padded layout. The output projection runs only at the positions whose log-prob
is wanted, gathered from the packed hidden states, chunk by chunk as on the chunked path. Results
equal the padded path's up to the floating-point rounding of other matrix shapes.

The chunked path needs ``model.get_output_embeddings()`` (the output projection as a callable) and
the HF config (``num_hidden_layers``, ``vocab_size``) of the causal LM, read from the model itself,
from ``model.module`` (a DeepSpeed engine or DDP wrapper: the call still goes through the wrapper,
whose forward registers its backward hooks on the returned hidden states) or through a peft
model's attribute forwarding. Both paths run under ZeRO-3: the output projection is a submodule
call, whose hooks gather its weight each time it runs, in the forward and in the recomputation.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_BYTES = 64 * 2**20
"""Bytes of one chunk's fp32 logits ``[batch, chunk, vocab]`` on the chunked path when the caller
names none (64 MiB: 42 positions of a micro-batch of 8 over SmolLM2's 49,152 tokens; the old-logit
service's no-grad scoring, where chunks cost no recompute). The chunk's working set is about three
times that (logits, log-softmax, and with entropy the probabilities)."""


@contextmanager
def scoring_mode(model: Any) -> Iterator[Any]:
    """Context for a forward that only scores: ``model`` in eval mode (no dropout) under
    ``torch.no_grad()``; its train/eval mode is restored on exit, also when the forward raises.
    Yields ``model``."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was_training)


def sequence_logprobs(
    model: Any,
    token_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    first: int = 1,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    packed: bool = False,
) -> torch.Tensor:
    """Log-prob of each token given its prefix, with the sampling temperature applied.

    Args:
        model: an HF causal LM, a DeepSpeed engine or a peft model wrapping one, or a callable with
            the HF keyword interface that offers ``config`` and ``get_output_embeddings()``.
        token_ids: ``[batch, seq]`` int64, right-padded.
        attention_mask: ``[batch, seq]`` 1 on real tokens.
        temperature: sampling temperature (> 0); fp32 logits are divided by it before log_softmax,
            exactly as the engine samples.
        first: the first position whose log-prob is wanted (>= 1). The output projection and the
            log-softmax over the vocabulary run only from position ``first - 1`` on, so a caller
            that reads only completion tokens skips the prompt's vocabulary-sized logits;
            positions before ``first`` hold 0.0.
        chunk_bytes: the largest fp32 ``[batch, chunk, vocab]`` logits tensor of the chunked path,
            bytes (at least one position per chunk); 0: the full-logit path.
        packed: pack the rows before the forward (module docstring); ``token_ids`` must then be
            right-padded.

    Returns:
        ``[batch, seq]`` float32 log-probs in nats; position 0 (no prefix) and padding hold 0.0.
        Gradients flow when the caller has them enabled.

    Raises:
        ValueError: ``temperature`` is not a finite number > 0 (a bool is not a number here),
            ``chunk_bytes`` is negative, or with ``packed`` a row is not right-padded.
    """
    return sequence_logprobs_and_entropy(
        model, token_ids, attention_mask, temperature, first, entropy=False, chunk_bytes=chunk_bytes, packed=packed
    )[0]


def sequence_logprobs_and_entropy(
    model: Any,
    token_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    first: int = 1,
    entropy: bool = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    entropy_grad: bool = False,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`sequence_logprobs` and, with ``entropy``, the entropy of each position's next-token
    distribution ``H_t = -sum_v p_v log p_v`` (nats, at the sampling temperature). The entropy
    carries no gradient unless ``entropy_grad`` (an entropy bonus in the loss); on the chunked path
    backward then recomputes each chunk's probabilities as it does its log-probs.

    Returns ``([batch, seq] log-probs, [batch, seq] entropies or None)``; the entropy at position t
    is that of the distribution token t was drawn from, 0.0 before ``first`` and on padding.
    Example: a uniform distribution over 4 tokens has entropy log 4 = 1.386294 nats. With
    ``packed`` the rows are packed (module docstring) and the output projection runs in chunks of
    at most ``chunk_bytes`` (all wanted positions at once when 0).

    Raises:
        ValueError: as :func:`sequence_logprobs`; with ``packed``, a row of ``attention_mask`` that
            is not right-padded (a 0 before a 1).
    """
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not 0 < temperature < math.inf:
        raise ValueError(
            f"temperature: must be a finite number > 0 for log-prob ratios, got {temperature!r} "
            "(greedy sampling has no log-probs to form an importance ratio with)"
        )
    if chunk_bytes < 0:
        raise ValueError(f"chunk_bytes: must be >= 0 (0: the full-logit path), got {chunk_bytes}")
    T = token_ids.shape[1]
    first = min(max(1, int(first)), T)
    if packed:
        return _packed(model, token_ids, attention_mask, temperature, first, entropy, chunk_bytes, entropy_grad)
    if chunk_bytes == 0:
        lp, ent = _full(model, token_ids, attention_mask, temperature, first, entropy, entropy_grad)
    else:
        lp, ent = _chunked(model, token_ids, attention_mask, temperature, first, entropy, chunk_bytes, entropy_grad)
    real = attention_mask[:, first:].to(torch.float32)
    pad = lp.new_zeros((lp.shape[0], first))
    if ent is not None:
        ent = torch.cat([pad, ent * real], dim=1)
    return torch.cat([pad, lp * real], dim=1), ent


def _full(
    model: Any,
    token_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    first: int,
    entropy: bool,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``([batch, seq - first] log-probs, entropies or None)`` of tokens ``first ..`` from the whole
    ``[batch, seq - first + 1, vocab]`` logits of HF's forward."""
    T = token_ids.shape[1]
    if first == 1:
        logits = model(input_ids=token_ids, attention_mask=attention_mask).logits  # [B, T, V]
    else:  # logits of positions first-1 .. T-1 only: [B, T - first + 1, V]
        logits = model(input_ids=token_ids, attention_mask=attention_mask, logits_to_keep=T - first + 1).logits
    log_p = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)  # [B, T - first, V]
    return _token_logprobs(log_p, token_ids[:, first:], entropy, entropy_grad)


def _chunked(
    model: Any,
    token_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    first: int,
    entropy: bool,
    chunk_bytes: int,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`_full`'s result from the final hidden states, ``chunk_bytes`` of logits at a time."""
    lm = _causal_lm(model)
    config = lm.config
    B, T = token_ids.shape
    # only the last decoder layer is recorded, and HF replaces it by the post-norm last hidden
    # state; logits_to_keep=1 leaves HF's own projection a [B, 1, V] remnant
    out = model(
        input_ids=token_ids,
        attention_mask=attention_mask,
        output_hidden_states=[config.num_hidden_layers - 1],
        logits_to_keep=1,
    )
    hidden = out.hidden_states[-1][:, first - 1 : T - 1]  # [B, T - first, H]: predicts tokens first..T-1
    targets = token_ids[:, first:]  # [B, T - first]
    step = max(1, int(chunk_bytes) // (B * int(config.vocab_size) * 4))
    return _head_in_chunks(lm.get_output_embeddings(), hidden, targets, temperature, step, entropy, entropy_grad)


def _head_in_chunks(
    head: Any,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    step: int,
    entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``([rows, n] log-probs, entropies or None)`` of ``targets`` ``[rows, n]`` from the final
    hidden states ``[rows, n, H]`` that predict them: the output projection ``head``, the
    temperature and the log-softmax over ``step`` positions at a time. When the hidden states carry
    a gradient, every chunk but the last is recomputed in backward (``torch.utils.checkpoint``); the
    last is kept, and backward, which starts there, frees it before recomputing the others."""
    n = hidden.shape[1]
    recompute = torch.is_grad_enabled() and hidden.requires_grad

    def chunk(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        # a contiguous [rows, c, H] block: on a strided view the CPU matmul's rounding depended on
        # where the weight sits in memory, so two copies of the same weights disagreed by ~1e-6.
        # One expression, so the projection's output is freed once divided by the temperature.
        log_p = torch.log_softmax(head(h.contiguous()).float() / temperature, dim=-1)  # [rows, c, V]
        return _token_logprobs(log_p, t, entropy, entropy_grad)

    lps, ents = [], []
    for s in range(0, max(n, 1), step):  # one (empty) chunk when no position is wanted
        h, t = hidden[:, s : s + step], targets[:, s : s + step]
        lp, ent = checkpoint(chunk, h, t, use_reentrant=False) if recompute and s + step < n else chunk(h, t)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps, dim=1), torch.cat(ents, dim=1) if entropy else None


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows of ``lengths`` tokens packed first-fit decreasing into bins of at most ``capacity``
    tokens: the rows in order of length, longest first (ties by index), each into the first bin
    with room, else a new bin. Returns each bin's row indices in packing order; rows of length 0
    are left out. Example: lengths [5, 3, 4, 2, 6], capacity 8 -> [[4, 3], [0, 1], [2]].

    Raises:
        ValueError: a length above ``capacity`` or below 0.
    """
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        if not 0 <= n <= capacity:
            raise ValueError(f"lengths[{i}]: {n} tokens do not fit a packed row of {capacity}")
        if n == 0:
            continue
        k = next((k for k, r in enumerate(room) if r >= n), len(bins))
        if k == len(bins):
            bins.append([])
            room.append(capacity)
        bins[k].append(i)
        room[k] -= n
    return bins


def packed_token_counts(attention_mask: torch.Tensor) -> tuple[int, int]:
    """``(padded, packed)`` token positions a forward of right-padded ``attention_mask`` ``[batch,
    seq]`` computes: ``batch * seq`` padded, and ``rows * width`` after :func:`pack_rows` at the
    padded width (``width`` the fullest packed row). Example: lengths 5, 3, 4, 2, 6 padded to 6:
    5 x 6 = 30 padded; bins [[4], [0], [2, 3], [1]], 4 x 6 = 24 packed."""
    B, T = attention_mask.shape
    bins, width = _packed_layout([int(n) for n in attention_mask.sum(1).tolist()], T)
    return B * T, len(bins) * width


def _packed_layout(lengths: list[int], capacity: int) -> tuple[list[list[int]], int]:
    """``(bins, width)``: :func:`pack_rows` of ``lengths`` at ``capacity`` and the fullest bin's tokens (0 without any)."""
    bins = pack_rows(lengths, capacity)
    return bins, max((sum(lengths[i] for i in b) for b in bins), default=0)


def _packed(
    model: Any,
    token_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    first: int,
    entropy: bool,
    chunk_bytes: int,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`sequence_logprobs_and_entropy`'s ``[batch, seq]`` result from packed rows (see the
    module docstring)."""
    B, T = token_ids.shape
    lengths = attention_mask.sum(1)
    if not torch.equal(lengths, attention_mask.cumprod(1).sum(1)):
        row = int((lengths != attention_mask.cumprod(1).sum(1)).nonzero()[0, 0])
        raise ValueError(f"attention_mask: row {row} is not right-padded (packing needs its tokens first)")
    n = [int(x) for x in lengths.tolist()]
    bins, width = _packed_layout(n, T)
    bins, width = bins or [[]], max(1, width)  # no token at all: one empty row of width 1
    device = token_ids.device
    ids = torch.zeros((len(bins), width), dtype=token_ids.dtype, device=device)
    pos = torch.zeros((len(bins), width), dtype=torch.long, device=device)
    src, dst = [], []  # flat [P * width] index of each wanted position's predecessor; flat [B * T] target
    for p, rows in enumerate(bins):
        off = 0
        for b in rows:
            ids[p, off : off + n[b]] = token_ids[b, : n[b]]
            pos[p, off : off + n[b]] = torch.arange(n[b], device=device)
            t = torch.arange(first, max(first, n[b]), device=device)
            src.append(p * width + off + t - 1)
            dst.append(b * T + t)
            off += n[b]
        pos[p, off:] = torch.arange(width - off, device=device)  # the tail is a sequence of its own
    src_i = torch.cat(src) if src else torch.zeros(0, dtype=torch.long, device=device)
    dst_i = torch.cat(dst) if dst else torch.zeros(0, dtype=torch.long, device=device)
    lm = _causal_lm(model)
    config = lm.config
    # no cache: HF reads packing from the position ids only when there is none
    out = model(
        input_ids=ids, position_ids=pos, use_cache=False,
        output_hidden_states=[config.num_hidden_layers - 1], logits_to_keep=1,
    )  # fmt: skip
    hidden = out.hidden_states[-1].reshape(-1, out.hidden_states[-1].shape[-1])[src_i][None]  # [1, K, H]
    targets = token_ids.reshape(-1)[dst_i][None]  # [1, K]
    K = int(src_i.numel())
    step = max(1, int(chunk_bytes) // (int(config.vocab_size) * 4)) if chunk_bytes else max(K, 1)
    lp, ent = _head_in_chunks(lm.get_output_embeddings(), hidden, targets, temperature, step, entropy, entropy_grad)
    flat = torch.zeros(B * T, dtype=torch.float32, device=device)
    lp_out = flat.index_put((dst_i,), lp[0]).view(B, T)
    return lp_out, flat.index_put((dst_i,), ent[0]).view(B, T) if ent is not None else None


def _token_logprobs(
    log_p: torch.Tensor, targets: torch.Tensor, entropy: bool, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``([batch, n] log-probs of targets, [batch, n] entropies or None)`` from the ``[batch, n,
    vocab]`` fp32 ``log_softmax(logits / T)`` predicting ``[batch, n]`` targets; the entropies
    carry a gradient only with ``entropy_grad``."""
    lp = log_p.gather(-1, targets[..., None]).squeeze(-1)  # [B, n]
    ent = None
    if entropy and entropy_grad:
        ent = -(log_p.exp() * log_p).sum(-1)  # [B, n]
    elif entropy:
        with torch.no_grad():  # p * log p in place: one [B, n, V] temporary instead of two
            ent = -log_p.exp().mul_(log_p).sum(-1)  # [B, n]
    return lp, ent


def _causal_lm(model: Any) -> Any:
    """The object that holds the HF config and output projection: ``model.module`` for a DeepSpeed
    engine (whose own ``config`` is DeepSpeed's), else ``model`` (peft forwards both attributes)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def enable_gradient_checkpointing(model: Any) -> None:
    """Recompute each decoder layer in backward instead of storing its intermediates (HF
    ``gradient_checkpointing_enable`` with ``use_reentrant=False``, the form that needs no input
    with ``requires_grad`` and so also fits a frozen base under LoRA). Active in train mode only.

    What backward keeps per micro-batch of ``B x T`` tokens falls from every layer's intermediates
    (attention inputs and outputs, the MLP's ``[B, T, intermediate]`` tensors) to each layer's input
    ``[B, T, hidden]``, at the cost of one more forward of the decoder stack.

    Raises:
        ValueError: the model has no ``gradient_checkpointing_enable`` (not an HF pretrained model).
    """
    lm = _causal_lm(model)
    enable = getattr(lm, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ValueError(f"gradient_checkpointing: {type(lm).__name__} has no gradient_checkpointing_enable")
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})
