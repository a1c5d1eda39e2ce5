"""The console every ``vintage`` command prints to."""

from __future__ import annotations

from rich.console import Console

console = Console(soft_wrap=True)  # one line per step at any width, terminal or not
