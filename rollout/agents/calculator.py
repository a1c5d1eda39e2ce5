"""A calculator agent whose tool takes time (an example for ``[agent] path``; the latency benchmark's agent).

``run(task, client)`` plays one episode: add up ``task["numbers"]`` with a ``calculator`` tool, one
addition per round, then answer. Each round sends the conversation (with the tool's schema) to
``client.chat.completions`` and runs one tool call:

* the calls the model made (``tool_calls`` of the reply), run together, each answered by a ``tool``
  message linked to its call id;
* when the reply holds none (an untrained model writes none), the agent's own plan: the next
  addition, ``"<running sum> + <next number>"``, answered as a user message.

So an episode of ``k`` numbers after the first makes ``k`` rounds of at least one tool call each,
plus one final call for the answer: ``k + 1`` model calls. The reward is 1.0 when the final reply
holds the true sum, else 0.0.

The tool waits ``task["tool_latency_s"]`` seconds with ``asyncio.sleep`` (no CPU, like a remote tool
or an environment), then evaluates the expression: integers and floats with ``+ - * /`` and
parentheses, nothing else. ``asyncio.sleep`` rather than ``time.sleep``: every episode of a job runs
on one event loop, and a blocking sleep would stop all of them.

Task fields: ``numbers`` (at least two numbers), optional ``tool_latency_s`` (default 0), ``model``
(default ``"vintage"``), ``max_tokens``.
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
from typing import Any

TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (numbers, + - * /, parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 + 7"}},
            "required": ["expression"],
        },
    },
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_EXPRESSION = 200
"""Longest expression the tool evaluates, characters."""


def evaluate(expression: str) -> float | int:
    """The value of an arithmetic expression: numbers, ``+ - * /``, unary minus, parentheses.

    Raises:
        ValueError: anything else (names, calls, powers, a syntax error, division by zero, an expression
            longer than :data:`MAX_EXPRESSION` characters); the message says what.
    """
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression ({e.msg})") from None

    def value(node: ast.AST) -> float | int:
        if isinstance(node, ast.Constant):
            if type(node.value) not in (int, float):
                raise ValueError(f"constant {node.value!r} is not a number")
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp):
            op = _OPS.get(type(node.op))
            if op is None:
                raise ValueError(f"operator {type(node.op).__name__} is not allowed")
            try:
                return op(value(node.left), value(node.right))
            except ZeroDivisionError:
                raise ValueError("division by zero") from None
        raise ValueError(f"{type(node).__name__} is not allowed")

    return value(tree)


async def calculator(expression: str, latency_s: float) -> str:
    """The tool: wait ``latency_s`` seconds (``asyncio.sleep``), then the value of ``expression`` as text
    (or ``"error: ..."``)."""
    await asyncio.sleep(latency_s)
    try:
        return str(evaluate(expression))
    except ValueError as e:
        return f"error: {e}"


def _expression(call: Any) -> str:
    """The ``expression`` argument of one OpenAI tool call (``""`` when the arguments do not hold one)."""
    try:
        args = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError:
        return ""
    return str(args.get("expression", "")) if isinstance(args, dict) else ""


async def _round(reply: Any, planned: str, latency_s: float) -> list[dict[str, Any]]:
    """The messages one round adds after the model's reply: the reply as returned, then the tool results."""
    msg = reply.choices[0].message
    calls = [c for c in msg.tool_calls or [] if c.type == "function"]
    assistant: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
    if not calls:
        result = await calculator(planned, latency_s)
        return [assistant, {"role": "user", "content": f"calculator({planned}) = {result}"}]
    assistant["tool_calls"] = [
        {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for c in calls
    ]
    results = await asyncio.gather(*(calculator(_expression(c), latency_s) for c in calls))
    return [assistant] + [
        {"role": "tool", "tool_call_id": c.id, "content": r} for c, r in zip(calls, results, strict=True)
    ]


async def run(task: dict[str, Any], client) -> dict[str, Any]:
    """One episode through ``client`` (an ``openai.AsyncOpenAI``); returns ``{"reward", "model_calls"}``.

    Raises:
        ValueError: ``task["numbers"]`` holds fewer than two numbers.
    """
    numbers = list(task.get("numbers", []))
    if len(numbers) < 2:
        raise ValueError(f"task.numbers: need at least two numbers, got {numbers!r}")
    latency_s = float(task.get("tool_latency_s", 0.0))
    extra = {"max_tokens": int(task["max_tokens"])} if task.get("max_tokens") is not None else {}
    model = task.get("model", "vintage")
    question = f"Add up {', '.join(map(str, numbers))} with the calculator, one addition per call, then give the sum."
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    running = numbers[0]
    for x in numbers[1:]:
        reply = await client.chat.completions.create(model=model, messages=messages, tools=[TOOL], **extra)
        messages += await _round(reply, f"{running} + {x}", latency_s)
        running += x
    messages.append({"role": "user", "content": "What is the sum?"})
    final = await client.chat.completions.create(model=model, messages=messages, tools=[TOOL], **extra)
    solved = str(running) in (final.choices[0].message.content or "")
    return {"reward": float(solved), "model_calls": len(numbers)}
