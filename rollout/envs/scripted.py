"""A scripted multi-turn environment with a known answer: the contract example and a test double.

``ScriptedEnv(turns=k)`` asks for ``k`` model turns. After each turn but the last it answers with
one tool message (``tool_text``); the last turn ends the episode with ``final_reward``. Rewards of
earlier turns are 0. Deterministic, model-independent: the agent loop's masks and lengths can be
checked exactly on it.
"""

from __future__ import annotations

from typing import Any


class ScriptedEnv:
    """See the module docstring. Raises ValueError when ``turns`` < 1."""

    def __init__(self, turns: int = 2, tool_text: str = "ok", final_reward: float = 1.0, prompt: str = "Say hi."):
        if turns < 1:
            raise ValueError(f"turns: must be >= 1, got {turns}")
        self.max_turns = turns
        self.tool_text, self.final_reward, self.prompt = tool_text, float(final_reward), prompt
        self.turn = 0
        self.actions: list[str] = []

    def reset(self, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self.turn, self.actions = 0, []
        return [{"role": "user", "content": self.prompt}], {"seed": seed}

    def step(self, action: str) -> tuple[list[dict[str, Any]], float, bool, dict[str, Any]]:
        self.turn += 1
        self.actions.append(action)
        if self.turn >= self.max_turns:
            return [], self.final_reward, True, {"turn": self.turn}
        return [{"role": "tool", "content": self.tool_text}], 0.0, False, {"turn": self.turn}
