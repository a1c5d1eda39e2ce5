"""vintage deploy."""
