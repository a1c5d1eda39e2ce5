"""Prompt ids of a call: a chat call rendered whole or appended to its session's ids, a text call as given.

A chat call whose messages repeat the session's previous messages and the reply exactly as
returned is rendered by appending the close of the reply and the new messages to the previous
ids, as the in-process agent loop does (:class:`rollout.agent.TemplateChatFormat`); any other
call is rendered whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rollout.gateway.bodies import ChatRequest, CompletionRequest
from rollout.gateway.errors import ApiError
from rollout.gateway.session import Session
from rollout.gateway.tools import normalized, render_message, with_tools


@dataclass
class ChatPrompt:
    """A chat call's messages as the template renders them.

    ``per`` holds the one or two template messages of each message (a reply with a tool-call
    error note gives two); ``plain`` the whole conversation with the tools block; ``key`` the
    normalised messages (tools first) compared with a session's history; ``names`` the tools the
    reply may call (None: no tool parsing).
    """

    per: list[list[dict[str, Any]]]
    plain: list[dict[str, Any]]
    key: list[tuple]
    names: set[str] | None

    @classmethod
    def of(cls, req: ChatRequest) -> ChatPrompt:
        """Raises ApiError 400 for a ``response_format`` other than text or a message that does not render."""
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise ApiError(400, "response_format: only text is supported", "response_format")
        msgs = [m.model_dump(exclude_none=True) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        for m in msgs:
            for c in m.get("tool_calls", []):
                if isinstance(c["function"]["arguments"], dict):
                    c["function"]["arguments"] = json.dumps(c["function"]["arguments"])
        try:
            per = [render_message(m, i) for i, m in enumerate(msgs)]
            plain = with_tools([x for p in per for x in p], tools, req.tool_choice)
            key = [("tools", json.dumps(tools, sort_keys=True), json.dumps(req.tool_choice, sort_keys=True))]
            key += [normalized(m) for m in msgs]
        except ValueError as e:
            raise ApiError(400, str(e), str(e).split(":")[0]) from None
        names = {t["function"]["name"] for t in tools} if tools and req.tool_choice != "none" else None
        return cls(per, plain, key, names)

    def ids(self, chat: Any, s: Session | None) -> list[int]:
        """Prompt ids in session ``s`` (appended to its current segment when the history matches)."""
        seg = s.current if s is not None else None
        h = s.history if s is not None else None
        key = self.key
        if seg is not None and h is not None and len(key) > len(h) and key[: len(h)] == h:
            try:
                reply = len(h) - 2  # index of the reply as returned: its note, if any, then the new messages
                new = self.per[reply][1:] + [x for p in self.per[reply + 1 :] for x in p]
                return seg.token_ids + chat.close_ids(s.last_ids, s.last_finish) + chat.observation_ids(new)
            except ValueError:
                pass  # the template cannot append here: render whole (the call then splits)
        return chat.prompt_ids(self.plain)


def text_prompt_ids(req: CompletionRequest, chat: Any) -> list[int]:
    """Prompt ids of a text completion (a string, one string in a list, or token ids).

    Raises:
        ApiError: 400 for several prompts, an empty prompt or a negative token id.
    """
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], str):
        if len(p) != 1:
            raise ApiError(400, f"prompt: {len(p)} prompts in one call; send one", "prompt")
        p = p[0]
    if not p:
        raise ApiError(400, "prompt: empty", "prompt")
    if isinstance(p, list) and any(not 0 <= x for x in p):
        raise ApiError(400, "prompt: token ids must be >= 0", "prompt")
    return list(p) if isinstance(p, list) else chat.text_ids(p)
