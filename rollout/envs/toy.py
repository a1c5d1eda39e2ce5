"""A procedural single-turn task with a verifiable reward and a known optimum, for fast method comparisons.

``AlphabetEnv``: the model is asked to reply using only the letters of a fixed small alphabet
(default ``a``-``m``). The reward is the fraction of the reply's characters that belong to that
alphabet::

    reward = #{characters c of the reply : c in alphabet} / #{characters of the reply}

(0 for an empty reply). The optimum is 1.0, reached by any reply made only of alphabet letters (the
tokenizer has many such tokens: ``a``, ``be``, ``ed``, ``make`` ...). The prompt is procedural (a few
random words picked by ``seed``) but the reward does not depend on it, so a tiny random model can
learn the task from the reward alone: it only has to move probability mass toward alphabet-only
tokens, whatever the context.

Measured start (``make_tiny_model(0)``, SmolLM2's 49k tokenizer, temperature 1, 16 new tokens): the
random model's replies are English-like word pieces, and ~0.42 of their characters fall in ``a``-``m``
(spread ~0.06 per reply), well above 0 and far from 1.0. Other alphabets give other starts: all
lowercase letters ~0.81, vowels ~0.31.
"""

from __future__ import annotations

import random
import string
from typing import Any

DEFAULT_ALPHABET = "abcdefghijklm"

_WORDS = (
    "river", "stone", "lamp", "cloud", "garden", "violet", "engine", "harbor", "maple", "copper",
    "signal", "winter", "orbit", "paper", "falcon", "meadow", "quartz", "tunnel", "candle", "saddle",
)  # fmt: skip


def alphabet_fraction(text: str, alphabet: str | set[str] = DEFAULT_ALPHABET) -> float:
    """Fraction of the characters of ``text`` that are in ``alphabet``; 0.0 for empty text."""
    if not text:
        return 0.0
    allowed = set(alphabet)
    return sum(c in allowed for c in text) / len(text)


class AlphabetEnv:
    """Single turn: reply with letters of ``alphabet`` only; reward = :func:`alphabet_fraction`.

    Args:
        alphabet: the allowed characters (non-empty); default ``a``-``m``.
        prompt_words: how many random words the procedural prompt carries (0: a fixed prompt).
        strip: score the reply with leading/trailing whitespace removed (default False: every
            character the model produced counts, spaces included).

    Raises:
        ValueError: empty ``alphabet`` or negative ``prompt_words``.
    """

    max_turns = 1

    def __init__(self, alphabet: str = DEFAULT_ALPHABET, prompt_words: int = 3, strip: bool = False):
        if not alphabet:
            raise ValueError("alphabet: must contain at least one character")
        if prompt_words < 0:
            raise ValueError(f"prompt_words: must be >= 0, got {prompt_words}")
        self.alphabet, self.prompt_words, self.strip = alphabet, prompt_words, strip
        self.seed: int | None = None

    def prompt(self, seed: int) -> str:
        """The user message of episode ``seed`` (deterministic)."""
        rng = random.Random(seed)
        words = " ".join(rng.choice(_WORDS) for _ in range(self.prompt_words))
        shown = self.alphabet if len(self.alphabet) <= 16 else f"{self.alphabet[:16]}..."
        topic = f" Topic: {words}." if words else ""
        return f"Reply using only the letters '{shown}'.{topic}"

    def reset(self, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self.seed = seed
        return [{"role": "user", "content": self.prompt(seed)}], {"seed": seed, "alphabet": self.alphabet}

    def step(self, action: str) -> tuple[list[dict[str, Any]], float, bool, dict[str, Any]]:
        if self.seed is None:
            raise RuntimeError("step() before reset()")
        text = action.strip() if self.strip else action
        reward = alphabet_fraction(text, self.alphabet)
        return [], reward, True, {"chars": len(text), "optimum": 1.0}


LOWERCASE = string.ascii_lowercase
"""Convenience alphabet (the random tiny model starts at ~0.81 on it)."""

__all__ = ["DEFAULT_ALPHABET", "LOWERCASE", "AlphabetEnv", "alphabet_fraction"]
