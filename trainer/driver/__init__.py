"""The job driver: the job and its loop, the old-logit routes, the rollout worker pool, the
trajectory buffer, the config, the HTTP status server, the metrics log, the agent runner, the
environment defaults and the loopback guard (``netguard``).

Invariants: the only part that runs the loop and owns the Ray cluster; the HTTP server never
blocks on it (requests are recorded and applied between iterations); imports
:mod:`trainer.algorithm` and :mod:`trainer.learner`, and neither imports it.
"""
