"""vintage rollout."""
