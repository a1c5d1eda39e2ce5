"""Single-turn verifiable tasks from ``reasoning-gym`` (offline, procedural), scored by its own scorer.

Simplification (documented on purpose): the model is asked to end with ``Answer: <answer>``; the
text after the last ``Answer:`` is scored, and when the model omits the marker the last number in
its reply is scored instead, so a tiny model that answers with a bare number is not scored zero for
format alone. The reward is ``dataset.score_answer(extracted, entry)`` in [0, 1].
"""

from __future__ import annotations

import functools
import re
from typing import Any

LEVELS: dict[str, dict[str, dict[str, Any]]] = {
    "basic_arithmetic": {
        # one-digit addition of two positive terms: the easiest level, SmolLM2-135M solves some
        "easy": dict(
            min_terms=2,
            max_terms=2,
            min_digits=1,
            max_digits=1,
            operators=("+",),
            allow_parentheses=False,
            allow_negation=False,
        ),
        "easy_mixed": dict(
            min_terms=2,
            max_terms=2,
            min_digits=1,
            max_digits=1,
            operators=("+", "-"),
            allow_parentheses=False,
            allow_negation=False,
        ),
        "medium": dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2),
        "hard": dict(min_terms=3, max_terms=5, min_digits=2, max_digits=3),
    },
    "chain_sum": {
        "easy": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
    },
}

SYSTEM = "You are a helpful assistant. Solve the task and finish with a line 'Answer: <answer>'."
_NUM = re.compile(r"-?\d+(?:\.\d+)?")


@functools.lru_cache(maxsize=16)
def _dataset(name: str, size: int, seed: int, frozen_kwargs: tuple):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=size, seed=seed, **dict(frozen_kwargs))


def extract_answer(text: str) -> str:
    """The candidate answer in a reply: text after the last ``Answer:``, else the last number, else ''."""
    idx = text.lower().rfind("answer:")
    if idx >= 0:
        tail = text[idx + len("answer:") :].strip().splitlines()
        return tail[0].strip().rstrip(".") if tail else ""
    nums = _NUM.findall(text)
    return nums[-1] if nums else ""


class ReasoningGymEnv:
    """One reasoning-gym task per episode (single turn).

    Args:
        dataset: reasoning-gym dataset name (e.g. ``basic_arithmetic``).
        level: a preset of dataset settings from :data:`LEVELS` (``easy`` ...), or None.
        size: number of procedural instances; ``reset(seed)`` picks instance ``seed % size``.
        dataset_seed: seed of the procedural generator.
        system_prompt: system message; None for the default, "" for none.
        **dataset_kwargs: passed to ``reasoning_gym.create_dataset`` (override the level's).

    Raises:
        ValueError: unknown level for the dataset, or reasoning-gym rejects a setting.
    """

    max_turns = 1

    def __init__(
        self,
        dataset: str = "basic_arithmetic",
        level: str | None = "easy",
        size: int = 1000,
        dataset_seed: int = 0,
        system_prompt: str | None = None,
        **dataset_kwargs: Any,
    ):
        kw: dict[str, Any] = {}
        if level is not None:
            try:
                kw.update(LEVELS[dataset][level])
            except KeyError:
                raise ValueError(
                    f"level: {level!r} is not defined for dataset {dataset!r} (have {sorted(LEVELS.get(dataset, {}))})"
                ) from None
        kw.update(dataset_kwargs)
        if size < 1:
            raise ValueError(f"size: must be >= 1, got {size}")
        try:
            self.ds = _dataset(dataset, size, dataset_seed, tuple(sorted(kw.items())))
        except Exception as e:
            raise ValueError(f"dataset: reasoning-gym could not build {dataset!r} with {kw}: {e}") from e
        self.size = size
        self.system_prompt = SYSTEM if system_prompt is None else system_prompt
        self.entry: dict[str, Any] | None = None

    def reset(self, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self.entry = self.ds[seed % self.size]
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        msgs.append({"role": "user", "content": self.entry["question"]})
        return msgs, {"answer": self.entry["answer"], "index": seed % self.size}

    def step(self, action: str) -> tuple[list[dict[str, Any]], float, bool, dict[str, Any]]:
        if self.entry is None:
            raise RuntimeError("step() before reset()")
        got = extract_answer(action)
        score = float(self.ds.score_answer(got, self.entry)) if got else 0.0
        return [], score, True, {"extracted": got, "answer": self.entry["answer"]}
