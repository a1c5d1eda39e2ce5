"""The retail store-support task as an agent on the OpenAI chat API (an example for ``[agent] path``).

``run(task, client)`` plays one episode of :class:`rollout.envs.retail.RetailEnv`: it sends the
conversation to ``client.chat.completions``, hands the reply text to the store (which executes the
tool call written in it, e.g. ``cancel_order(W1234)``), appends the reply and the store's answer to
the conversation, and repeats until the store says the episode is over. The reward is 1.0 when the
store's final state is the customer's goal.

The messages are exactly those the in-process agent loop renders for the same environment, so the
gateway records the same token ids, masks and versions as an in-process rollout of the episode.

Task fields: ``seed`` (the episode), ``env.kwargs`` (``RetailEnv`` arguments: ``level``,
``max_turns``, ``few_shot``, ``closing_turn``), optional ``model`` (default ``"vintage"``),
``max_tokens``, ``sampling_seed`` (a per-call sampling seed, for reproducible episodes) and
``tool_latency_s`` (default 0).
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollout.envs.retail import RetailEnv


async def run(task: dict[str, Any], client) -> dict[str, Any]:
    """One retail episode through ``client`` (an ``openai.AsyncOpenAI``); returns ``{"reward", "turns", "solved"}``.

    Raises:
        ValueError: a negative ``task["tool_latency_s"]``.
    """
    env = RetailEnv(**task.get("env", {}).get("kwargs", {}))
    messages, _ = env.reset(int(task["seed"]))
    extra: dict[str, Any] = {}
    if task.get("max_tokens") is not None:
        extra["max_tokens"] = int(task["max_tokens"])
    if task.get("sampling_seed") is not None:
        extra["seed"] = int(task["sampling_seed"])
    latency_s = float(task.get("tool_latency_s", 0.0))
    if latency_s < 0:
        raise ValueError(f"task.tool_latency_s: must be >= 0, got {latency_s}")
    reward, turns, info = 0.0, 0, {}
    while True:
        reply = await client.chat.completions.create(model=task.get("model", "vintage"), messages=messages, **extra)
        text = reply.choices[0].message.content or ""
        obs, r, done, info = env.step(text)
        reward, turns = reward + r, turns + 1
        if done:
            break
        await asyncio.sleep(latency_s)
        messages = messages + [{"role": "assistant", "content": text}] + obs
    return {"reward": reward, "turns": turns, "solved": bool(info.get("solved", False))}
