"""Sessions of the gateway: calls stitched token-in/token-out into trajectories.

A session is one episode of an outside agent. Each call contributes the prompt ids the gateway
rendered and the ids the worker sampled, with their behaviour log-probs (mu, nats) and the policy
version of every sampled token. Stitching rule (:meth:`Session.stitch`):

* when a call's prompt ids start with the current segment's ids (the previous prompt + completion
  + whatever came after), the call extends that segment: the new prompt tokens are context
  (``loss_mask`` 0, version -1) and the sampled tokens are appended as sampled (mask 1, their own
  versions and mu). Sampled ids are never decoded and re-encoded;
* otherwise (template drift, an edited history) the call starts a new segment whose prompt is the
  whole rendered prompt; the split is counted. Every segment becomes one
  :class:`protocol.Trajectory` and all segments of a session share the session's reward.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocol import Trajectory
from rollout.agent import TokenTrace


@dataclass
class Completion:
    """What one call sampled, per sampled token: ids, mu (nats) and versions; the finish reason,
    the worker's policy version, pi_old when the worker attached it, and the fingerprint of the
    weights the worker served at that version (``Trajectory.served_fingerprint``)."""

    ids: list[int]
    behav_logprobs: list[float]
    versions: list[int]
    finish_reason: str
    policy_version: int
    old_logprobs: list[float] | None = None
    served_fingerprint: str | None = None

    def head(self, k: int, finish_reason: str) -> Completion:
        """The first ``k`` sampled tokens, ended for ``finish_reason`` (a stop string cut)."""
        old = self.old_logprobs[:k] if self.old_logprobs else self.old_logprobs
        return Completion(
            self.ids[:k], self.behav_logprobs[:k], self.versions[:k], finish_reason, self.policy_version, old,
            self.served_fingerprint,
        )  # fmt: skip


@dataclass
class CallRecord:
    """One served call: the prompt ids as rendered, the sampled ids, mu and versions per sampled token."""

    call_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    behav_logprobs: list[float]
    versions: list[int]
    finish_reason: str
    segment: int
    """Index of the segment (trajectory) of the session this call belongs to."""
    old_logprobs: list[float] | None = None
    """Exact pi_old of the sampled tokens when the worker attached it (interrupt_sync route)."""


@dataclass
class Segment(TokenTrace):
    """Token state of one trajectory of a session (:class:`rollout.agent.TokenTrace`), plus pi_old
    per token (NaN where none), the ids of its calls, the newest version it holds and the served
    fingerprint of that version (from the call that reached it; None when no call did)."""

    old_logprobs: list[float] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    finish_reason: str = "stop"
    policy_version: int = 0
    served_fingerprint: str | None = None

    def extends(self, prompt_ids: list[int]) -> bool:
        """True when ``prompt_ids`` starts with every id of this segment (and the segment is not empty)."""
        n = len(self.token_ids)
        return n > 0 and len(prompt_ids) >= n and prompt_ids[:n] == self.token_ids

    def add_context(self, ids: list[int]) -> None:
        """Append context tokens (:meth:`rollout.agent.TokenTrace.add_context`), pi_old NaN."""
        super().add_context(ids)
        self.old_logprobs += [math.nan] * len(ids)

    def add_completion(self, call_id: str, c: Completion) -> None:
        """Append one call's sampled tokens as one model turn (checked as in
        :meth:`rollout.agent.TokenTrace.append_sampled`)."""
        start = len(self.token_ids)
        self.append_sampled(c.ids, c.behav_logprobs, c.versions)
        self.old_logprobs += list(c.old_logprobs) if c.old_logprobs is not None else [math.nan] * len(c.ids)
        self.turn_boundaries.append((start, len(self.token_ids)))
        self.calls.append(call_id)
        self.finish_reason = c.finish_reason
        self.truncated = self.truncated or c.finish_reason == "length"
        version = max([self.policy_version, c.policy_version, *c.versions])
        if c.policy_version == version:
            self.served_fingerprint = c.served_fingerprint
        elif version != self.policy_version:  # reached by a token, not by a worker's report: unknown
            self.served_fingerprint = None
        self.policy_version = version


@dataclass
class Session:
    """One episode of an outside agent (see the module docstring)."""

    session_id: str
    key: str
    group_id: str
    train: bool = True
    admitted_version: int = 0
    created: float = field(default_factory=time.time)
    state: str = "open"
    """``open`` or ``ended``."""
    segments: list[Segment] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    history: list[tuple] | None = None
    """Normalised chat messages the current segment holds (prompt + the reply as returned)."""
    reward: float = 0.0
    call_rewards: dict[str, float] = field(default_factory=dict)
    splits: int = 0
    truncated: bool = False
    """True when ``max_session_tokens`` cut the session short."""
    info: dict[str, Any] = field(default_factory=dict)
    last_ids: list[int] = field(default_factory=list)
    """Sampled ids of the session's last call (their template close is appended before new messages)."""
    last_finish: str = "stop"
    last_active: float = 0.0
    """When the session last had a request (its table's clock, seconds): for ``idle_s``."""

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def add_call(
        self,
        call_id: str,
        prompt_ids: list[int],
        completion_ids: list[int],
        behav_logprobs: list[float],
        versions: list[int],
        finish_reason: str,
        policy_version: int,
        old_logprobs: list[float] | None = None,
    ) -> CallRecord:
        """:meth:`stitch` of a call given field by field."""
        c = Completion(
            list(completion_ids), list(behav_logprobs), list(versions), finish_reason, policy_version, old_logprobs
        )
        return self.stitch(call_id, prompt_ids, c)

    def stitch(self, call_id: str, prompt_ids: list[int], c: Completion) -> CallRecord:
        """Stitch one call into the session (extend the current segment or start a new one).

        Raises:
            ValueError: the per-token lists differ in length, or a sampled version is older than
                an earlier one in the same segment (versions never decrease within a trajectory);
                the session is left as it was.
        """
        n = len(c.ids)
        if len(c.behav_logprobs) != n or len(c.versions) != n:
            raise ValueError(f"completion: {n} ids, {len(c.behav_logprobs)} logprobs, {len(c.versions)} versions")
        seg = self.current
        if seg is not None and seg.extends(prompt_ids):
            last = seg.last_version()
            if c.versions and min(c.versions) < last:
                raise ValueError(f"versions: {min(c.versions)} is older than an earlier token's version {last}")
            seg.add_context(prompt_ids[len(seg.token_ids) :])
        else:
            if seg is not None:
                self.splits += 1
            seg = Segment()
            seg.add_context(list(prompt_ids))
            seg.prompt_len = len(prompt_ids)
            self.segments.append(seg)
        seg.add_completion(call_id, c)
        rec = CallRecord(
            call_id, list(prompt_ids), list(c.ids), list(c.behav_logprobs), list(c.versions), c.finish_reason,
            len(self.segments) - 1, c.old_logprobs,
        )  # fmt: skip
        self.calls.append(rec)
        return rec

    def total_reward(self) -> float:
        """The session scalar reward plus every per-call reward."""
        return float(self.reward + sum(self.call_rewards.values()))

    def to_trajectories(self, worker_id: str = "gateway") -> list[Trajectory]:
        """One :class:`protocol.Trajectory` per segment; every segment gets the session's total reward.

        ``turn_rewards`` holds the per-call rewards of the segment's calls (0.0 where none was given);
        ``info`` names the session, the segment index and count, and the session's split count.

        Raises:
            pydantic.ValidationError: a segment breaks the trajectory contract (an internal bug).
        """
        out = []
        reward = self.total_reward()
        for k, seg in enumerate(self.segments):
            old = np.asarray(seg.old_logprobs, np.float32)
            out.append(
                Trajectory(
                    trajectory_id=self.session_id if len(self.segments) == 1 else f"{self.session_id}/{k}",
                    group_id=self.group_id,
                    worker_id=worker_id,
                    policy_version=seg.policy_version,
                    served_fingerprint=seg.served_fingerprint,
                    finish_reason=seg.finish_reason if seg.finish_reason in ("stop", "length", "abort") else "stop",
                    reward=reward,
                    turn_rewards=[float(self.call_rewards.get(c, 0.0)) for c in seg.calls],
                    **{**seg.trajectory_fields(), "truncated": seg.truncated or self.truncated},
                    old_logprobs=old if np.isfinite(old).any() else None,
                    info={
                        "session_id": self.session_id,
                        "segment": k,
                        "segments": len(self.segments),
                        "splits": self.splits,
                        "turns": len(seg.calls),
                        "admitted_version": self.admitted_version,
                        **self.info,
                    },
                )
            )
        return out
