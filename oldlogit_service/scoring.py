"""How the old-logit service scores a request: one forward per held version, each token its own version's value.

Pure functions over the request's items (:class:`protocol.OldLogitItem`, ``[seq]`` arrays each) and a
``forward(version, ids, mask)`` callable; the service (:class:`oldlogit_service.service.OldLogitService`)
supplies the forward with its held weights and the reason a version is missing.

Exactness: the forward for version v runs over the right-padded items that contain a scored
version-v token, cut after the last such token among them (a causal model needs no later tokens),
so a learner forward of the same rows with the same weights gives the same values.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from oldlogit_service.items import right_padded
from protocol import OldLogitItem, TokenStatus


class BoundModel:
    """A callable that runs ``model`` with the given weights (a functional call; the model is untouched).

    It stands in for the model in :func:`modelkit.scoring.sequence_logprobs`: called with
    ``input_ids`` / ``attention_mask`` ``[rows, seq]`` it returns the model's outputs under ``weights``.
    """

    def __init__(self, model: torch.nn.Module, weights: Mapping[str, Tensor]) -> None:
        self.model, self.weights = model, weights

    def __call__(self, **kwargs: Any) -> Any:
        return torch.func.functional_call(self.model, self.weights, (), kwargs, tie_weights=True, strict=False)

    @property
    def config(self) -> Any:
        return self.model.config

    def get_output_embeddings(self) -> Any:
        """The output projection with these weights: ``[..., hidden] -> [..., vocab]`` (what
        :func:`modelkit.scoring.sequence_logprobs` applies chunk by chunk).

        Raises:
            KeyError: the weights lack one of the projection's parameters (the template's own are
                emptied, so they never stand in)."""
        head = self.model.get_output_embeddings()
        name = next(n for n, m in self.model.named_modules() if m is head)
        params = {k: self.weights[f"{name}.{k}"] for k, _ in head.named_parameters()}
        return lambda h: torch.func.functional_call(head, params, (h,))


def validate_items(items: Sequence[OldLogitItem], vocab_size: int) -> None:
    """Refuse items the model cannot score.

    Raises:
        ValueError: ``items[i].token_ids`` holds an id outside ``[0, vocab_size)`` (checked when
            ``vocab_size`` > 0), or ``items[i].loss_mask`` marks offset 0 (a first token has no prefix).
    """
    for i, it in enumerate(items):
        ids = it.token_ids
        if vocab_size and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
            raise ValueError(f"items[{i}].token_ids: id {bad} outside the vocabulary [0, {vocab_size})")
        if it.loss_mask[0]:
            raise ValueError(
                f"items[{i}].loss_mask: offset 0 is marked to score, but a first token has no prefix to condition on"
            )


def score_by_version(
    items: Sequence[OldLogitItem],
    held: Collection[int],
    forward: Callable[[int, Tensor, Tensor], Tensor],
    missing_reason: Callable[[int], TokenStatus],
    max_tokens: int | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per item ``(old_logprobs [seq] float32, status [seq] int8)``.

    A scored token (``loss_mask`` 1) of a version in ``held`` is ``EXACT`` with the value of
    ``forward(v, ids [rows, end], mask [rows, end]) -> [rows, end]`` (nats) at its position; one of
    another version gets ``missing_reason(v)`` and NaN; an unscored token is ``CONTEXT`` and NaN.
    ``forward`` is called once per distinct held version present, over the rows that contain it,
    cut after the last token of that version; with ``max_tokens``, over consecutive runs of those
    rows (:func:`row_chunks`) of at most ``max_tokens`` positions each (rows x the run's own padded
    length), so one forward's activations stay under a bound.
    """
    lps = [np.full(len(it.token_ids), np.nan, np.float32) for it in items]
    sts = [
        np.where(it.loss_mask.astype(bool), np.int8(-1), np.int8(TokenStatus.CONTEXT)).astype(np.int8) for it in items
    ]
    present = sorted({int(v) for it in items for v in np.unique(it.versions[it.loss_mask.astype(bool)])})
    scored = [v for v in present if v in held]
    for v in present:
        if v not in held:
            reason = missing_reason(v)
            for it, st in zip(items, sts, strict=True):
                st[it.loss_mask.astype(bool) & (it.versions == v)] = reason
    if scored:
        ids, mask = right_padded(items)
        for v in scored:
            sel = [it.loss_mask.astype(bool) & (it.versions == v) for it in items]
            rows = [r for r, s in enumerate(sel) if s.any()]
            ends = [int(np.flatnonzero(sel[r]).max()) + 1 for r in rows]  # causal: later tokens are not needed
            for chunk in row_chunks(ends, max_tokens):
                part = [rows[k] for k in chunk]
                end = max(ends[k] for k in chunk)
                lp = forward(v, ids[part, :end], mask[part, :end]).numpy()
                for k, r in enumerate(part):
                    s = sel[r]
                    lps[r][s] = lp[k, : len(s)][s[:end]]
                    sts[r][s] = TokenStatus.EXACT
    return lps, sts


def row_chunks(ends: Sequence[int], max_tokens: int | None) -> list[list[int]]:
    """Consecutive runs of the indices of rows needing ``ends[i]`` positions each, every run at
    most ``max_tokens`` positions when padded to its longest row (a row longer than that alone);
    one run of all rows with ``max_tokens`` None. Example: ends [4, 6, 3, 5], 12 tokens ->
    [[0, 1], [2, 3]] (2 x 6 = 12, then 2 x 5 = 10)."""
    if max_tokens is None:
        return [list(range(len(ends)))] if ends else []
    runs: list[list[int]] = []
    for i, e in enumerate(ends):
        if runs and (len(runs[-1]) + 1) * max(e, *(ends[k] for k in runs[-1])) <= max_tokens:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def count_statuses(statuses: Sequence[np.ndarray]) -> tuple[int, Counter[str]]:
    """``(exact tokens, missing tokens by TokenStatus name)`` over ``statuses`` (int8 ``[seq]`` each);
    ``CONTEXT`` positions are not counted. Example: ``[EXACT, CONTEXT, MISSING_EVICTED, EXACT]`` ->
    ``(2, {"MISSING_EVICTED": 1})``."""
    exact, missing = 0, Counter[str]()
    for st in statuses:
        for code, n in zip(*np.unique(st, return_counts=True), strict=True):
            if code == TokenStatus.EXACT:
                exact += int(n)
            elif code != TokenStatus.CONTEXT:
                missing[TokenStatus(int(code)).name] += int(n)
    return exact, missing
