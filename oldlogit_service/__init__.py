"""vintage oldlogit_service."""
