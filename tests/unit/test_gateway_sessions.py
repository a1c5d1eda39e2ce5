"""The gateway's session table forgets the oldest ended sessions past ``ended_kept``, never an open one."""

from __future__ import annotations

import pytest

from rollout.gateway.errors import ApiError
from rollout.gateway.sessions import SessionTable


def test_the_oldest_ended_sessions_are_forgotten_past_the_bound():
    """Bound 2: ending s1, s2, s3 forgets s1 (404 by id, 401 for its key); s2 and s3 are remembered
    (a call with s2's key is 409: ended); s4, open, stays whatever ends after it."""
    t = SessionTable(version=lambda: 0, ended_kept=2)
    s1, s2, s3, s4 = (t.open_session() for _ in range(4))
    for s in (s1, s2, s3):
        assert t.end_session(s.session_id).dropped == "no_calls"
    with pytest.raises(ApiError) as e:
        t.session(s1.session_id)
    assert (e.value.status, e.value.message) == (404, f"session_id: {s1.session_id!r} does not exist")
    with pytest.raises(ApiError) as e:
        t.call_session(s1.key, None)
    assert e.value.status == 401
    with pytest.raises(ApiError) as e:
        t.call_session(s2.key, None)
    assert (e.value.status, e.value.message) == (409, "session_id: the session of this key has ended")
    assert t.session(s3.session_id).state == "ended" and t.call_session(s4.key, None) is s4
    assert (len(t._sessions), len(t._ended_keys), t.session_counts()["sessions_ended"]) == (3, 2, 3)
