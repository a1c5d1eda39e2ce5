"""The gateway's session table: open, look up, reward and end sessions; the counts of ``/v1/status``.

Thread-safe (one lock): used by the HTTP routes and, in-process, by the agent runner. A session
is found by its id (the base URL ``/sessions/{id}/v1``) or by its key (the API key of a call).
An ended session is remembered (``GET /v1/sessions/{id}``, a 409 for a call with its key) until
``ended_kept`` newer ones have ended, then forgotten (404, and 401 for its key), so the table does
not grow with the sessions a long job has run. Ending a training session turns it into trajectories; they are held by GRPO group
(:class:`rollout.gateway.groups.GroupGate`) and handed to :meth:`SessionTable.take_ended` when their
group fills or has waited ``group_wait_s`` (then with a stated baseline); a dropped session is
handed over at once.

A session whose agent is gone (its process died mid-episode) would stay open for ever, holding
its place under the staleness admission rule: once ``(max_staleness + 1) * batch`` such sessions
exist, no session is admitted again and training stops. So a session with no call running and
no request (open, call, reward) for ``idle_s`` seconds is ended by :meth:`SessionTable.take_ended`
without trajectories, dropped as :data:`IDLE` (an episode without its end has no reward to train
on); a later request for it is answered 409, as for any ended session.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol import Trajectory
from rollout.gateway.bodies import finite
from rollout.gateway.errors import ApiError, ended
from rollout.gateway.groups import GroupGate
from rollout.gateway.session import Session
from rollout.httpserve import token_matches

ENDED_KEPT = 16384
"""Ended sessions remembered (the oldest are forgotten first)."""

IDLE = "idle"
"""Drop reason of a session ended for want of any request in ``idle_s`` seconds."""


@dataclass
class EndedSession:
    """A training session handed over at its end: its trajectories, or why it gave none."""

    session_id: str
    group_id: str
    trajectories: list[Trajectory]
    dropped: str | None = None
    reward: float = 0.0


@dataclass
class GatewayStats:
    """Running counts of the gateway (reported by :meth:`SessionTable.status`); times in seconds."""

    opened: int = 0
    ended: int = 0
    emitted: int = 0
    dropped: Counter = field(default_factory=Counter)
    refused: int = 0
    trajectories: int = 0
    calls: int = 0
    untracked: int = 0
    tokens: int = 0
    splits: int = 0
    parsed: int = 0
    unparsed: int = 0
    tool_errors: int = 0
    truncated: int = 0
    abandoned: int = 0
    errors: Counter = field(default_factory=Counter)
    unavailable: Counter = field(default_factory=Counter)
    overhead_s: float = 0.0
    turn_wait_s: float = 0.0


class SessionTable:
    """Sessions by id and by key, their accounting, and the admin token.

    Args:
        version: the serving policy version (stamped on a new session as ``admitted_version``).
        admin_token: bearer token of the session endpoints; ``None`` generates one.
        admission: ``admit(n) -> bool``, the staleness admission rule for ``n`` new sessions
            (``None`` admits everything); it must record what it admits.
        retry_after_s: ``Retry-After`` seconds sent with a 429 or a 503.
        group_size: sessions of a full GRPO group (``rollout.sampling.n``).
        group_wait_s: longest wait for a group to fill after its first session ended, seconds.
        clock: seconds (monotonic), for ``group_wait_s`` and ``idle_s``.
        ended_kept: ended sessions remembered (the oldest forgotten first, see the module docstring).
        idle_s: end an open session after this many seconds with no call running and no request
            for it, dropped as :data:`IDLE` (see the module docstring); ``None``: never.

    Raises:
        ValueError: an ``admin_token`` shorter than 16 characters (names ``gateway.token``), a
            ``group_size`` below 1, a ``group_wait_s`` or an ``idle_s`` that is not a positive number.
    """

    def __init__(
        self,
        version: Callable[[], int],
        admin_token: str | None = None,
        admission: Callable[[int], bool] | None = None,
        retry_after_s: int = 1,
        group_size: int = 1,
        group_wait_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
        ended_kept: int = ENDED_KEPT,
        idle_s: float | None = None,
    ):
        if admin_token is not None and len(admin_token) < 16:
            raise ValueError(f"gateway.token: {len(admin_token)} characters, at least 16 required")
        if idle_s is not None and not (isinstance(idle_s, int | float) and 0 < idle_s < float("inf")):
            raise ValueError(f"gateway.session_idle_s: expected a positive number of seconds, got {idle_s!r}")
        self.idle_s, self._clock = idle_s, clock
        self.admin_token = admin_token or secrets.token_urlsafe(24)
        self._version, self.admission, self.retry_after_s = version, admission, retry_after_s
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._by_key: dict[str, str] = {}
        self._ended_keys: set[str] = set()
        self._ended_order: deque[str] = deque()
        self.ended_kept = ended_kept
        self._call_locks: dict[str, asyncio.Lock] = {}
        self._ended: list[EndedSession] = []
        self.groups = GroupGate(group_size, group_wait_s, clock)
        self.stats = GatewayStats()

    # --- sessions ------------------------------------------------------------------------------

    def open_session(self, group_id: str | None = None, train: bool = True, admit: bool = True) -> Session:
        """Open a session; ``admit=False`` skips the admission rule (the caller already applied it).

        Raises:
            ApiError: 429 when the admission rule refuses a new session now.
        """
        if admit and train and self.admission is not None and not self.admission(1):
            with self._lock:
                self.stats.refused += 1  # errors["429"] is counted where the answer is sent
            raise ApiError(
                429,
                "sessions: the staleness admission rule admits no new session now; retry later",
                None,
                {"Retry-After": str(self.retry_after_s)},
            )
        sid = f"s-{uuid.uuid4().hex[:16]}"
        s = Session(
            session_id=sid,
            key=f"sk-vintage-{secrets.token_urlsafe(24)}",
            group_id=group_id or sid,
            train=train,
            admitted_version=self._version(),
        )
        s.last_active = self._clock()
        with self._lock:
            self._sessions[sid] = s
            self._by_key[s.key] = sid
            self.stats.opened += 1
        return s

    def session(self, sid: str) -> Session:
        """The session ``sid`` (open or ended). Raises ApiError 404 when unknown."""
        with self._lock:
            s = self._sessions.get(sid)
        if s is None:
            raise ApiError(404, f"session_id: {sid!r} does not exist", "session_id")
        return s

    def is_admin(self, key: str | None) -> bool:
        """True when ``key`` is the admin token (constant-time compare)."""
        return token_matches(key, self.admin_token)

    def call_session(self, key: str | None, sid: str | None) -> Session | None:
        """The open session a call belongs to: by ``sid`` (then ``key`` must be its key or the admin
        token) or by ``key``; None for an untracked call with the admin token and no ``sid``.

        Raises:
            ApiError: 401 a wrong or unknown key, 404 an unknown session, 409 an ended one.
        """
        admin = self.is_admin(key)
        if sid is not None:
            s = self.session(sid)
            if not (admin or token_matches(key, s.key)):
                raise ApiError(401, "api_key: not the key of this session", "api_key")
        elif admin:
            return None
        else:
            with self._lock:
                found = self._by_key.get(key or "")
                s = self._sessions.get(found) if found else None
                gone = (key or "") in self._ended_keys
            if s is None:
                if gone:
                    raise ApiError(409, "session_id: the session of this key has ended", "session_id")
                raise ApiError(401, "api_key: unknown key (use a session key or the admin token)", "api_key")
        if s.state != "open":
            raise ended(s.session_id)
        s.last_active = self._clock()
        return s

    def set_reward(self, sid: str, reward: float | None = None, rewards: Any = None) -> Session:
        """Set the session's scalar reward and/or per-call rewards (``{call_id: r}`` or a list by call index).

        Raises:
            ApiError: 404 unknown session, 409 ended, 400 a non-finite reward or an unknown call.
        """
        s = self.session(sid)
        with self._lock:
            if s.state != "open":
                raise ended(sid)
            per = _call_rewards(s, rewards) if rewards is not None else {}
            if reward is not None and not finite(reward):
                raise ApiError(400, f"reward: non-finite value {reward!r}", "reward")
            if reward is not None:
                s.reward = float(reward)
            s.call_rewards.update(per)
            s.last_active = self._clock()
        return s

    def end_session(self, sid: str, reward: float | None = None, dropped: str | None = None) -> EndedSession:
        """End a session; training sessions become trajectories (queued for :meth:`take_ended`).

        ``dropped`` ends it without trajectories, for that reason (e.g. ``agent_error``).

        Raises:
            ApiError: 404 unknown session, 409 already ended, 400 non-finite reward.
        """
        if reward is not None:
            self.set_reward(sid, reward)
        s = self.session(sid)
        with self._lock:
            if s.state != "open":
                raise ended(sid)
            s.state = "ended"
            self._by_key.pop(s.key, None)
            self._ended_keys.add(s.key)
            self.stats.ended += 1
            out = self._hand_over(s, dropped)
            # free the token state of the session; its counts stay for GET /v1/sessions/{id}
            s.info["calls"], s.segments, s.history, s.calls, s.last_ids = len(s.calls), [], None, [], []
            self._call_locks.pop(s.session_id, None)
            self._ended_order.append(s.session_id)
            while len(self._ended_order) > self.ended_kept:
                old = self._sessions.pop(self._ended_order.popleft())
                self._ended_keys.discard(old.key)
        return out

    def _hand_over(self, s: Session, dropped: str | None) -> EndedSession:
        """The ended session's trajectories (or why none), counted and queued if it trains (lock held)."""
        trajs: list[Trajectory] = []
        if dropped is None and not s.calls:
            dropped = "no_calls"
        if dropped is None and s.train:
            try:
                trajs = s.to_trajectories()
            except ValueError as e:  # an internal bug: say so, do not train on it
                dropped = f"invalid: {e}"[:200]
        if dropped is None:
            self.stats.emitted += 1
            self.stats.trajectories += len(trajs)
        else:
            self.stats.dropped[dropped] += 1
        out = EndedSession(s.session_id, s.group_id, trajs, dropped, s.total_reward())
        if s.train and dropped is not None:
            self._ended.append(out)
        elif s.train:  # a session opened without a group_id is its own group: nothing can join it
            self._ended += self.groups.add(out, alone=s.group_id == s.session_id)
        return out

    def held_sessions(self) -> list[EndedSession]:
        """Ended training sessions held now, waiting for their group (saved with a checkpoint)."""
        with self._lock:
            return list(self.groups.held())

    def restore_held(self, trajectories: list[Trajectory]) -> int:
        """Hand the trajectories of sessions held at a checkpoint to the next :meth:`take_ended`,
        released at once (:meth:`rollout.gateway.groups.GroupGate.release_restored`); returns the
        number of sessions. A session is its trajectories with one session id: the id itself, or
        ``<session_id>/<k>`` for the segments of a split session (in order); its reward is theirs."""
        sessions: dict[str, EndedSession] = {}
        for t in trajectories:
            sid = t.trajectory_id.split("/", 1)[0]
            e = sessions.setdefault(sid, EndedSession(sid, t.group_id, [], reward=float(t.reward)))
            e.trajectories.append(t)
        with self._lock:
            self._ended += self.groups.release_restored(list(sessions.values()))
        return len(sessions)

    def take_ended(self) -> list[EndedSession]:
        """Training sessions handed over since the last call, oldest first: dropped ones (the idle
        ones ended here first, see the module docstring), and those of groups that filled or waited
        ``group_wait_s`` (see :mod:`rollout.gateway.groups`)."""
        for sid in self.idle_sessions():
            with contextlib.suppress(ApiError):  # ended meanwhile by its agent
                self.end_session(sid, dropped=IDLE)
        with self._lock:
            out, self._ended = self._ended + self.groups.due(), []
        return out

    def idle_sessions(self) -> list[str]:
        """Ids of the open sessions with no call running and no request for ``idle_s`` seconds."""
        if self.idle_s is None:
            return []
        now = self._clock()
        with self._lock:
            open_ = [self._sessions[sid] for sid in self._by_key.values()]
            busy = {sid for sid, lock in self._call_locks.items() if lock.locked()}
        return [s.session_id for s in open_ if s.session_id not in busy and now - s.last_active >= self.idle_s]

    def touch(self, s: Session | None) -> None:
        """Note a request of session ``s`` now (a call that just finished)."""
        if s is not None:
            s.last_active = self._clock()

    # --- per-call state and counts ---------------------------------------------------------------

    def call_lock(self, s: Session | None) -> asyncio.Lock:
        """The lock serialising the calls of session ``s`` (a fresh one for an untracked call)."""
        if s is None:
            return asyncio.Lock()
        lock = self._call_locks.get(s.session_id)
        if lock is None:
            lock = self._call_locks[s.session_id] = asyncio.Lock()
        return lock

    def truncate(self, s: Session | None) -> None:
        """Mark ``s`` cut by ``max_session_tokens`` (counted once per session)."""
        if s is not None and not s.truncated:
            s.truncated = True
            with self._lock:
                self.stats.truncated += 1

    def unavailable(self, reason: str, message: str) -> ApiError:
        """A 503 naming why no worker serves the call (counted by ``reason``), with ``Retry-After``."""
        with self._lock:
            self.stats.unavailable[reason] += 1
        return ApiError(503, message, None, {"Retry-After": str(self.retry_after_s)})

    def count_error(self, e: ApiError) -> None:
        """Count a refused request by its HTTP status (``errors`` of the status)."""
        with self._lock:
            self.stats.errors[str(e.status)] += 1

    def refusal(self, status: int, message: str) -> dict:
        """The OpenAI-shaped body of a request refused before it reached a route (a body too large
        or too slow, :class:`rollout.httpserve.BodyLimit`), counted in ``errors``."""
        with self._lock:
            self.stats.errors[str(status)] += 1
        return ApiError(status, message, "body").body()

    def session_counts(self) -> dict[str, Any]:
        """The :class:`protocol.GatewayStatus` fields the session table counts."""
        st = self.stats
        with self._lock:
            n_open = sum(1 for s in self._sessions.values() if s.state == "open")
            return dict(
                sessions_opened=st.opened,
                sessions_open=n_open,
                sessions_ended=st.ended,
                sessions_emitted=st.emitted,
                sessions_dropped=dict(st.dropped),
                sessions_refused=st.refused,
                trajectories_emitted=st.trajectories,
                calls=st.calls,
                untracked_calls=st.untracked,
                tokens_sampled=st.tokens,
                splits=st.splits,
                tool_calls_parsed=st.parsed,
                unparsed_tool_calls=st.unparsed,
                tool_call_errors=st.tool_errors,
                truncated_sessions=st.truncated,
                abandoned_calls=st.abandoned,
                errors=dict(st.errors),
                unavailable=dict(st.unavailable),
                sessions_waiting_for_group=self.groups.waiting,
                groups_partial=self.groups.groups_partial,
                sessions_in_partial_groups=self.groups.sessions_partial,
                overhead_ms_mean=1e3 * st.overhead_s / st.calls if st.calls else 0.0,
                turn_wait_ms_mean=1e3 * st.turn_wait_s / st.calls if st.calls else 0.0,
            )


def _call_rewards(s: Session, rewards: Any) -> dict[str, float]:
    """``{call_id: reward}`` of a ``rewards`` body (a dict by call id or index, or a list by index).

    Raises:
        ApiError: 400 an unknown call or a non-finite value.
    """
    per: dict[str, float] = {}
    items = rewards.items() if isinstance(rewards, dict) else enumerate(rewards)
    ids = [c.call_id for c in s.calls]
    for k, v in items:
        cid = ids[k] if isinstance(k, int) and 0 <= k < len(ids) else k
        if cid not in ids:
            raise ApiError(400, f"rewards: no call {k!r} in session {s.session_id!r}", "rewards")
        if not finite(v):
            raise ApiError(400, f"rewards[{k!r}]: non-finite value {v!r}", "rewards")
        per[cid] = float(v)
    return per
