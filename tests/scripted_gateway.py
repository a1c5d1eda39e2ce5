"""Stand-ins for the gateway's model side, for tests that need no model and no Ray.

* :class:`CharTokenizer` - an HF-tokenizer stand-in with a ChatML template and one id per
  character (``ord``), ``<|im_start|>`` = 1 and ``<|im_end|>`` = 2, so expected ids are worked
  out by hand from strings; :func:`chat_format` wraps it in the real
  :class:`rollout.agent.TemplateChatFormat`.
* :class:`ScriptedPool` - ``submit`` / ``poll`` of a ``trainer.driver.workers.pool.WorkerPool``: each taken
  request gets the next scripted reply, sampled at version 0 with mu = -0.5 per token.
* :class:`FakeClock` - seconds that move only when a test moves them.
"""

from __future__ import annotations

import re
import threading

import numpy as np

from protocol import RolloutRequest, Trajectory
from rollout.agent import TemplateChatFormat

IM_START, IM_END = 1, 2
_SPECIAL = {"<|im_start|>": IM_START, "<|im_end|>": IM_END}
_SPLIT = re.compile(r"(<\|im_start\|>|<\|im_end\|>)")


class CharTokenizer:
    """ChatML, one id per character; the two ChatML tags are one id each (see the module docstring)."""

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        ids: list[int] = []
        for part in _SPLIT.split(text):
            ids += [_SPECIAL[part]] if part in _SPECIAL else [ord(c) for c in part]
        return ids

    def decode(self, ids, skip_special_tokens=True):
        names = {v: k for k, v in _SPECIAL.items()}
        return "".join(("" if skip_special_tokens else names[i]) if i in names else chr(i) for i in ids)


def chat_format() -> TemplateChatFormat:
    return TemplateChatFormat(CharTokenizer())


def reply(text: str) -> list[int]:
    """Sampled ids of a reply that ends by sampling ``<|im_end|>`` (finish reason ``stop``)."""
    return CharTokenizer().encode(text) + [IM_END]


class FakeClock:
    """``clock()`` returns :attr:`t`, seconds; only the test (or the pool) moves it."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class ScriptedPool:
    """``submit`` / ``poll`` over scripted replies (see the module docstring).

    ``late_submits``: the first that many submissions are taken by no worker (``submit`` returns 0,
    as the pool does while every worker is late). ``held``: indices (in order of taking) of requests
    whose trajectory is not delivered until :meth:`release`. ``clock`` and ``durations``: delivering
    request ``k`` moves the clock by ``durations[k]`` seconds (generation time).
    """

    def __init__(self, replies, late_submits=0, held=(), clock=None, durations=None):
        self.replies = list(replies)
        self.late_submits = late_submits
        self.held = set(held)
        self.clock, self.durations = clock, dict(durations or {})
        self.taken: list[RolloutRequest] = []
        self.submits = self.polls = 0
        self._queue: list[tuple[int, RolloutRequest, list[int]]] = []
        self._lost: list[str] = []
        self._lock = threading.Lock()

    def submit(self, requests: list[RolloutRequest]) -> int:
        with self._lock:
            self.submits += 1
            if self.late_submits > 0:
                self.late_submits -= 1
                return 0
            for r in requests:
                self._queue.append((len(self.taken), r, self.replies.pop(0)))
                self.taken.append(r)
            return sum(r.sampling.n for r in requests)

    def poll(self) -> list[Trajectory]:
        with self._lock:
            self.polls += 1
            now = [x for x in self._queue if x[0] not in self.held]
            self._queue = [x for x in self._queue if x[0] in self.held]
            out = []
            for k, r, ids in now:
                if self.clock is not None:
                    self.clock.t += self.durations.get(k, 0.0)
                out.append(trajectory(r, ids))
            return out

    def release(self, k: int) -> None:
        """Deliver request ``k``'s trajectory at the next poll."""
        with self._lock:
            self.held.discard(k)

    def lose(self, k: int) -> None:
        """The worker holding request ``k`` dies: its trajectory never comes, and :meth:`lost`
        names its id (as ``WorkerPool.take_lost_requests`` does)."""
        with self._lock:
            self._queue = [x for x in self._queue if x[0] != k]
            self._lost.append(self.taken[k].request_id)

    def lost(self) -> list[str]:
        with self._lock:
            out, self._lost = self._lost, []
            return out


def trajectory(r: RolloutRequest, ids: list[int], version: int = 0) -> Trajectory:
    """The worker's one-turn trajectory for prompt-ids request ``r`` that sampled ``ids``."""
    p, n = len(r.prompt_ids), len(ids)
    finish = "stop" if ids and ids[-1] == IM_END else "length"
    return Trajectory(
        trajectory_id=r.request_id,
        group_id=r.group_id,
        token_ids=np.asarray(list(r.prompt_ids) + ids, np.int32),
        loss_mask=np.asarray([0] * p + [1] * n, np.int8),
        behav_logprobs=np.asarray([0.0] * p + [-0.5] * n, np.float32),
        versions=np.asarray([-1] * p + [version] * n, np.int32),
        policy_version=version,
        prompt_len=p,
        finish_reason=finish,
        served_fingerprint=f"{version:016x}",  # the worker's read-back of version ``version``
    )
