"""Environments for the agent loop, loaded by import path (``package.module:attr``).

An environment speaks chat messages, in the reset/step style users know from gym:

* ``reset(seed) -> (messages, info)``: the opening conversation (list of ``{"role", "content"}``)
  for the task instance picked by ``seed``;
* ``step(action) -> (observation_messages, reward, done, info)``: ``action`` is the assistant's
  text for one turn (decoded from the sampled ids); ``observation_messages`` are the tool/user
  messages that follow it (empty when ``done``), ``reward`` a float for this turn.

Optional attribute ``max_turns`` (default 1) bounds the number of model turns. The episode reward
recorded in a :class:`protocol.Trajectory` is the sum of its turn rewards.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Env(Protocol):
    """What the agent loop needs from an environment (see the module docstring)."""

    def reset(self, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]: ...

    def step(self, action: str) -> tuple[list[dict[str, Any]], float, bool, dict[str, Any]]: ...


def import_attr(path: str) -> Any:
    """Resolve ``"package.module:attr"``.

    Raises:
        ValueError: ``path`` is not of the form ``module:attr``, the module cannot be imported, or
            it has no such attribute (the message names the path).
    """
    mod, sep, attr = path.partition(":")
    if not sep or not mod or not attr:
        raise ValueError(f"path: {path!r} is not of the form 'package.module:attr'")
    try:
        module = importlib.import_module(mod)
    except ImportError as e:
        raise ValueError(f"path: cannot import module {mod!r} of {path!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"path: module {mod!r} has no attribute {attr!r}") from None


def load_env(path: str, **kwargs: Any) -> Env:
    """Build an environment from its import path and keyword arguments, and check its shape.

    Raises:
        ValueError: bad path (see :func:`import_attr`).
        TypeError: the object built has no callable ``reset`` and ``step``.
    """
    factory = import_attr(path)
    env = factory(**kwargs) if callable(factory) else factory
    for name in ("reset", "step"):
        if not callable(getattr(env, name, None)):
            raise TypeError(f"env {path!r}: built object {type(env).__name__} has no callable {name}()")
    return env


def check_reset(out: Any, path: str = "env") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Validate a ``reset`` result; raises TypeError naming what is wrong."""
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"{path}.reset: must return (messages, info), got {type(out).__name__}")
    msgs, info = out
    _check_messages(msgs, f"{path}.reset messages")
    if not msgs:
        raise TypeError(f"{path}.reset: returned no messages")
    return list(msgs), dict(info or {})


def check_step(out: Any, path: str = "env") -> tuple[list[dict[str, Any]], float, bool, dict[str, Any]]:
    """Validate a ``step`` result; raises TypeError naming what is wrong."""
    if not (isinstance(out, tuple) and len(out) == 4):
        raise TypeError(f"{path}.step: must return (messages, reward, done, info), got {out!r:.80}")
    msgs, reward, done, info = out
    _check_messages(msgs, f"{path}.step messages")
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise TypeError(f"{path}.step: reward must be a number, got {reward!r}") from None
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise TypeError(f"{path}.step: reward is not finite ({reward})")
    return list(msgs), reward, bool(done), dict(info or {})


def _check_messages(msgs: Any, where: str) -> None:
    if not isinstance(msgs, list):
        raise TypeError(f"{where}: must be a list of messages, got {type(msgs).__name__}")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TypeError(f"{where}[{i}]: must be {{'role': str, 'content': str}}, got {m!r:.80}")


__all__ = ["Env", "check_reset", "check_step", "import_attr", "load_env"]
