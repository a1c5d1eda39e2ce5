"""Token-in / token-out bookkeeping of one episode (single- or multi-turn).

The learner trains on exactly the ids the engine saw and sampled: model turns are kept as the
sampled ids (never decoded and re-encoded); text only flows *out* to the environment, and the
environment's answer flows *in* as freshly rendered chat-template tokens appended to the context.

Invariants of an :class:`Episode` (checked again by :class:`protocol.Trajectory`):

* ``loss_mask`` is 1 exactly on model-sampled tokens; prompt, tool/user observations and tokens the
  worker appends itself (e.g. the end-of-turn id after a length-truncated turn) have mask 0,
  version ``-1`` and a placeholder ``behav_logprobs`` of 0.0 that is never read;
* ``versions`` of sampled tokens never decrease (the engine's version only grows);
* the generated length of an episode is ``sum(loss_mask)``, not the span of its turns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from protocol import NO_VERSION, RolloutRequest, Trajectory


class ChatFormat(Protocol):
    """Renders chat messages to token ids for the agent loop (a tokenizer's chat template)."""

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """Ids of a whole conversation start, ending with the assistant generation prompt."""

    def close_ids(self, turn_ids: list[int], finish_reason: str) -> list[int]:
        """Ids to append after a model turn so the context is a well-formed conversation again."""

    def observation_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """Ids of new (tool/user) messages after a closed assistant turn, plus the generation prompt."""

    def text_ids(self, text: str) -> list[int]:
        """Ids of raw text (no template, no special tokens added)."""

    def decode(self, ids: list[int]) -> str:
        """Text of sampled ids for the environment (special tokens dropped)."""


class TemplateChatFormat:
    """:class:`ChatFormat` from an HF tokenizer's chat template (ChatML for SmolLM2).

    The text the template puts after an assistant message (``"<|im_end|>\\n"`` for ChatML) and the
    rendering of new messages are found by diffing renders of placeholder conversations, so no
    template-specific strings are hard coded. A turn that ended by sampling the start of that
    closing text keeps it as sampled; only the remainder is appended as context.

    Raises:
        ValueError: the template does not render conversations as prefix-extensions of each other.
    """

    _MARK = "\u2063vintage\u2063"

    def __init__(self, tokenizer):
        self.tok = tokenizer
        base = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
        with_asst = self._render(base + [{"role": "assistant", "content": self._MARK}], gen=False)
        i = with_asst.find(self._MARK)
        if i < 0:
            raise ValueError("chat template: assistant content not found in render")
        self._close_text = with_asst[i + len(self._MARK) :]
        self._close = self.text_ids(self._close_text)
        self._after_asst = with_asst
        self._base = base + [{"role": "assistant", "content": self._MARK}]

    def _render(self, messages, gen: bool) -> str:
        return self.tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        if not messages:
            raise ValueError("messages: empty conversation")
        return self.text_ids(self._render(messages, gen=True))

    def close_ids(self, turn_ids: list[int], finish_reason: str) -> list[int]:
        for k in range(min(len(self._close), len(turn_ids)), 0, -1):
            if turn_ids[-k:] == self._close[:k]:
                return self._close[k:]
        return list(self._close)

    def observation_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        if not messages:
            raise ValueError("messages: no observation to render")
        full = self._render(self._base + list(messages), gen=True)
        if not full.startswith(self._after_asst):
            raise ValueError("chat template: rendering new messages changes earlier text; cannot append tokens")
        return self.text_ids(full[len(self._after_asst) :])

    def text_ids(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def pad_nan(values: np.ndarray, n: int) -> np.ndarray:
    """``values`` (float32, length <= n) extended with NaN to length ``n``."""
    out = np.full(n, np.nan, np.float32)
    out[: len(values)] = values
    return out


@dataclass
class Episode:
    """Mutable token state of one trajectory while it is being generated.

    ``turn_start`` is the offset where the current model turn began; ``turn_budget`` the tokens the
    current turn may still sample in total (decremented as tokens arrive, so a resumed request asks
    the engine only for the remainder).
    """

    trajectory_id: str
    request: RolloutRequest
    seed: int | None = None
    env: Any = None
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    prompt_len: int = 0
    turn_start: int = 0
    turn_budget: int = 0
    turns: int = 0
    turn_boundaries: list[tuple[int, int]] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    truncated: bool = False
    finish_reason: str = ""
    engine_rid: str | None = None
    resumes: int = 0
    old_logprobs: np.ndarray | None = None
    """Exact pi_old attached at interruptions (interrupt_sync route): ``[len so far]``, NaN where unknown."""
    info: dict[str, Any] = field(default_factory=dict)

    def add_context(self, ids: list[int]) -> None:
        """Append tokens the model did not sample (mask 0, version -1, placeholder mu 0.0)."""
        self.token_ids.extend(int(i) for i in ids)
        self.loss_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([NO_VERSION] * len(ids))

    def add_sampled(self, ids: list[int], logprobs: list[float], version: int) -> None:
        """Append model-sampled tokens with their behaviour log-probs (nats) and version.

        Raises:
            ValueError: lengths differ, or ``version`` is older than an earlier sampled token.
        """
        if len(ids) != len(logprobs):
            raise ValueError(f"logprobs: {len(logprobs)} values for {len(ids)} tokens")
        last = max((v for v in self.versions if v >= 0), default=NO_VERSION)
        if ids and version < last:
            raise ValueError(f"version: {version} is older than an earlier token's version {last}")
        self.token_ids.extend(int(i) for i in ids)
        self.loss_mask.extend([1] * len(ids))
        self.logprobs.extend(float(x) for x in logprobs)
        self.versions.extend([int(version)] * len(ids))
        self.turn_budget -= len(ids)

    def start_turn(self, budget: int) -> None:
        self.turn_start = len(self.token_ids)
        self.turn_budget = budget

    @property
    def turn_ids(self) -> list[int]:
        return self.token_ids[self.turn_start :]

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    def to_trajectory(self, worker_id: str, policy_version: int, served_fingerprint: str | None = None) -> Trajectory:
        """Freeze into a :class:`protocol.Trajectory` (raises pydantic ValidationError if inconsistent);
        ``served_fingerprint``: that of the weights the worker serves at ``policy_version``."""
        return Trajectory(
            trajectory_id=self.trajectory_id,
            group_id=self.request.group_id,
            worker_id=worker_id,
            token_ids=np.asarray(self.token_ids, np.int32),
            loss_mask=np.asarray(self.loss_mask, np.int8),
            behav_logprobs=np.asarray(self.logprobs, np.float32),
            versions=np.asarray(self.versions, np.int32),
            policy_version=policy_version,
            served_fingerprint=served_fingerprint,
            prompt_len=self.prompt_len,
            finish_reason=self.finish_reason or "abort",
            reward=float(sum(self.turn_rewards)),
            turn_rewards=list(self.turn_rewards),
            turn_boundaries=list(self.turn_boundaries),
            truncated=self.truncated,
            purpose=self.request.purpose,
            old_logprobs=None if self.old_logprobs is None else pad_nan(self.old_logprobs, len(self.token_ids)),
            info={
                **self.info,
                "turns": self.turns,
                "resumes": self.resumes,
                "admitted_version": self.request.admitted_version,
                "temperature": self.request.sampling.temperature,
            },
        )
