"""One text format for tool schemas, tool calls and tool results, for chat templates without tools.

SmolLM2's ChatML template renders only ``role`` and ``content``: ``tools``, an assistant message's
``tool_calls`` and the link between a ``tool`` message and its call would vanish. The gateway
therefore renders them into plain ``content`` before the template runs, and parses the model's
calls back out of the sampled text, always in this format:

* **tool schemas** are appended to the first system message (one is created when the conversation
  has none), one OpenAI function schema per line between ``<tools>`` and ``</tools>``::

      # Tools
      You may call the functions below. Each line is one function's JSON schema.
      <tools>
      {"type": "function", "function": {"name": "get_order", ...}}
      </tools>
      To call a function, reply with a JSON object holding its name and arguments between
      <tool_call> and </tool_call>, one call per pair of tags:
      <tool_call>
      {"name": "<function name>", "arguments": {<arguments as JSON>}}
      </tool_call>

* an **assistant message with tool calls** renders as its content (if any) followed by one block
  per call, ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, joined by newlines;
* a **tool result** renders as a ``tool`` turn whose content is the result text, unchanged.

:func:`parse_tool_calls` is the inverse of :func:`render_tool_calls`: a block whose JSON parses to
an object with a string ``name`` naming one of the offered tools and object ``arguments`` becomes an
OpenAI ``tool_calls`` entry and leaves the content; anything else (bad JSON, unknown name, an
unclosed tag) stays in the content and is counted as unparsed, with one line saying why.

* a **tool-call error note** (the gateway's answer to a reply holding a call that did not parse)
  follows the reply's text in the assistant ``content`` the agent receives::

      <the sampled text>

      <tool_call_error>
      None of the tool calls in this reply was run: tool call 1: not JSON (...). Write each call as ...
      </tool_call_error>

  An assistant message whose content ends with such a block renders as the reply's text followed
  by a ``tool`` turn holding the note (:func:`render_message`): the model reads the error where it
  reads every tool result, and the sampled tokens of the reply stay as they were sampled.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
ERROR_OPEN, ERROR_CLOSE = "<tool_call_error>", "</tool_call_error>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

TOOLS_HEADER = "# Tools\nYou may call the functions below. Each line is one function's JSON schema.\n<tools>\n"
TOOLS_FOOTER = (
    "\n</tools>\nTo call a function, reply with a JSON object holding its name and arguments between "
    "<tool_call> and </tool_call>, one call per pair of tags:\n"
    '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>'
)


def canonical_arguments(arguments: str | dict[str, Any]) -> str:
    """``arguments`` (a JSON text or an object) as compact JSON with sorted keys.

    Raises:
        ValueError: the text is not JSON, or not a JSON object.
    """
    obj = json.loads(arguments) if isinstance(arguments, str) else arguments
    if not isinstance(obj, dict):
        raise ValueError(f"arguments must be a JSON object, got {type(obj).__name__}")
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def tools_text(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any] | None = None) -> str:
    """The block describing ``tools`` (OpenAI ``tools`` entries) that goes into the system message.

    ``tool_choice="required"`` adds "You must call at least one function."; a named choice
    ``{"type": "function", "function": {"name": N}}`` adds "You must call the function N.".
    """
    lines = "\n".join(json.dumps(t, sort_keys=True) for t in tools)
    text = TOOLS_HEADER + lines + TOOLS_FOOTER
    if tool_choice == "required":
        text += "\nYou must call at least one function."
    elif isinstance(tool_choice, dict):
        text += f"\nYou must call the function {tool_choice['function']['name']}."
    return text


def render_tool_calls(content: str, tool_calls: list[dict[str, Any]]) -> str:
    """Assistant ``content`` followed by one ``<tool_call>`` block per OpenAI tool call.

    ``tool_calls`` entries are ``{"function": {"name": str, "arguments": str | dict}}``.

    Raises:
        ValueError: a call's arguments are not a JSON object.
    """
    blocks = []
    for c in tool_calls:
        fn = c["function"]
        args = json.loads(canonical_arguments(fn["arguments"]))
        blocks.append(f"{TOOL_OPEN}\n{json.dumps({'name': fn['name'], 'arguments': args})}\n{TOOL_CLOSE}")
    return "\n".join(([content] if content else []) + blocks)


@dataclass
class ParsedReply:
    """What :func:`parse_tool_calls` found in one sampled reply."""

    content: str
    """The text left after removing the parsed calls (stripped)."""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """OpenAI ``tool_calls`` entries: ``{"id", "type": "function", "function": {"name", "arguments"}}``."""
    errors: list[str] = field(default_factory=list)
    """One line per block (or unclosed opening tag) that looked like a call but did not parse, in
    order: ``"tool call <k>: <why>"``, ``k`` counting every block from 1; the block stays in ``content``."""

    @property
    def unparsed(self) -> int:
        """Blocks that did not parse (``len(errors)``)."""
        return len(self.errors)


def parse_tool_calls(text: str, tool_names: set[str] | None, id_prefix: str = "call") -> ParsedReply:
    """Split sampled ``text`` into content and tool calls (the inverse of :func:`render_tool_calls`).

    ``tool_names`` are the offered functions; ``None`` accepts any name. Call ids are
    ``f"{id_prefix}_{i}"`` in order of appearance. Why a block did not parse is in
    :attr:`ParsedReply.errors`.
    """
    calls: list[dict[str, Any]] = []
    errors: list[str] = []
    kept: list[str] = []
    pos = k = 0
    for k, m in enumerate(_BLOCK.finditer(text), 1):
        call = _as_call(m.group(1), tool_names)
        if isinstance(call, str):
            errors.append(f"tool call {k}: {call}")
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        name, args = call
        calls.append(
            {
                "id": f"{id_prefix}_{len(calls)}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
        )
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    tail = text[text.rfind(TOOL_CLOSE) + len(TOOL_CLOSE) :] if TOOL_CLOSE in text else text
    if TOOL_OPEN in tail:  # an opened call that never closed (cut by the token budget)
        errors.append(f"tool call {k + 1}: {TOOL_OPEN} is not closed by {TOOL_CLOSE}")
    return ParsedReply(content=content, tool_calls=calls, errors=errors)


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number"}


def _json_type(v: Any) -> str:
    return "null" if v is None else _JSON_TYPES.get(type(v), "a number")


def _as_call(body: str, tool_names: set[str] | None) -> tuple[str, dict[str, Any]] | str:
    """``(name, arguments)`` of one block's JSON, or why it is not a call (one line)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg} at position {e.pos})"
    if not isinstance(obj, dict):
        return f'expected a JSON object with "name" and "arguments", got {_json_type(obj)}'
    if not isinstance(obj.get("name"), str):
        return f'"name" must be a string, got {_json_type(obj.get("name"))}'
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return f'"arguments" of {obj["name"]!r}: not JSON ({e.msg} at position {e.pos})'
    if not isinstance(args, dict):
        return f'"arguments" of {obj["name"]!r} must be a JSON object, got {_json_type(args)}'
    if tool_names is not None and obj["name"] not in tool_names:
        return f"unknown function {obj['name']!r} (offered: {', '.join(sorted(tool_names)) or 'none'})"
    return obj["name"], args


def tool_error_text(errors: list[str]) -> str:
    """The note answering a reply whose tool calls did not all parse (``errors`` from :func:`parse_tool_calls`)."""
    return (
        f"None of the tool calls in this reply was run: {'; '.join(errors)}. Write each call as "
        f'{TOOL_OPEN}{{"name": <function name>, "arguments": {{<arguments as JSON>}}}}{TOOL_CLOSE}.'
    )


def with_error_note(text: str, note: str) -> str:
    """Assistant content: the reply's ``text``, a blank line, then ``note`` between the error tags."""
    return f"{text}\n\n{ERROR_OPEN}\n{note}\n{ERROR_CLOSE}"


def split_error_note(content: str) -> tuple[str, str | None]:
    """``(text, note)`` of assistant content made by :func:`with_error_note`; ``(content, None)`` for any other."""
    opening = f"\n\n{ERROR_OPEN}\n"
    i = content.rfind(opening)
    if i < 0 or not content.endswith(f"\n{ERROR_CLOSE}"):
        return content, None
    return content[:i], content[i + len(opening) : -len(ERROR_CLOSE) - 1]


def content_text(content: Any, where: str) -> str:
    """OpenAI message ``content`` (None, a string, or a list of ``{"type": "text", "text"}`` parts) as text.

    Raises:
        ValueError: a part is not text (images and audio cannot be rendered); names ``where``.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{where}[{i}]: only text parts are supported, got {kind!r}")
        out.append(part["text"])
    return "".join(out)


def render_message(m: dict[str, Any], i: int) -> list[dict[str, str]]:
    """One OpenAI chat message (``messages[i]``) as ``[{"role", "content"}]`` for the template.

    ``developer`` becomes ``system``; assistant tool calls are rendered with
    :func:`render_tool_calls`; ``tool`` results keep their text. An assistant message carrying a
    tool-call error note (:func:`with_error_note`) gives two: the reply's text, then a ``tool``
    turn holding the note.

    Raises:
        ValueError: a content part is not text, or tool call arguments are not a JSON object; the
            message names the field (``messages[2].tool_calls[0].function.arguments``).
    """
    role = "system" if m["role"] == "developer" else m["role"]
    text = content_text(m.get("content"), f"messages[{i}].content")
    note = None
    if role == "assistant":
        text, note = split_error_note(text)
    calls = m.get("tool_calls") or []
    if calls:
        for j, c in enumerate(calls):
            try:
                canonical_arguments(c["function"]["arguments"])
            except (ValueError, TypeError) as e:
                raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments: {e}") from None
        text = render_tool_calls(text, calls)
    out = [{"role": role, "content": text}]
    if note is not None:
        out.append({"role": "tool", "content": note})
    return out


def with_tools(
    rendered: list[dict[str, str]], tools: list[dict[str, Any]] | None, tool_choice: Any = None
) -> list[dict[str, str]]:
    """``rendered`` messages with the tool schemas in the first system message (one is created
    when the conversation has none; see the module docstring), unless ``tool_choice == "none"``."""
    out = list(rendered)
    if tools and tool_choice != "none":
        block = tools_text(tools, tool_choice)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def render_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, tool_choice: Any = None
) -> list[dict[str, str]]:
    """OpenAI chat messages -> ``[{"role", "content"}]`` the chat template can render: each message
    by :func:`render_message`, the tool schemas added by :func:`with_tools`.

    Raises:
        ValueError: as :func:`render_message`.
    """
    return with_tools([x for i, m in enumerate(messages) for x in render_message(m, i)], tools, tool_choice)


def normalized(message: dict[str, Any]) -> tuple:
    """A hashable form of one chat message for history matching (tool call ids and key order ignored)."""
    calls = tuple(
        (c["function"]["name"], canonical_arguments(c["function"]["arguments"]))
        for c in message.get("tool_calls") or []
    )
    role = "system" if message["role"] == "developer" else message["role"]
    return (role, content_text(message.get("content"), "content"), calls)
