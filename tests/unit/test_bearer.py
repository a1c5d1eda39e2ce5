"""The one bearer-token parser of the HTTP servers (gateway and status API), on hand-made headers."""

from __future__ import annotations

import pytest

from rollout.httpserve import bearer_token, token_matches


@pytest.mark.parametrize(
    "header, token",
    [
        (None, None),  # no header
        ("Basic dXNlcjpwdw==", None),  # another scheme
        ("bearer abc", None),  # the scheme is matched as written, "Bearer "
        ("Bearer", None),  # no space: not the scheme's prefix
        ("Bearer ", ""),  # the scheme with an empty token
        ("Bearer abc def", "abc def"),  # everything after "Bearer " (7 characters)
    ],
)
def test_bearer_token_of_a_header(header, token):
    assert bearer_token(header) == token


def test_token_matches_only_a_non_empty_equal_token():
    assert token_matches("s3cret-token-0123", "s3cret-token-0123")
    assert not token_matches("s3cret-token-0124", "s3cret-token-0123")
    assert not token_matches("", "")  # an empty token never matches, even an empty expectation
    assert not token_matches(None, "s3cret-token-0123")
