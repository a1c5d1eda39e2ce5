"""The job driver: the loop (``job``), the assembly of a job's parts (``assembly``), the parts and
one iteration's operations (``parts``), the trajectory sources (``sources``), the old-logit routes,
the cluster session (``session``), what a job reports (``report``), the rollout worker pool, the
trajectory buffer, the config, the HTTP status server, the metrics log, the agent runner, the
environment defaults, the export of a run (``export``) and the loopback guard (``netguard``).

Invariants: the only part that runs the loop and owns the Ray cluster; the HTTP server never
blocks on it (requests are recorded and applied between iterations); imports
:mod:`trainer.algorithm` and :mod:`trainer.learner`, and neither imports it.
"""
