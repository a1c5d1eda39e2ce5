"""The job driver, in rooms that import only downward (bottom first)::

    config       the job's settings (``schema``: pydantic models, validation, the resolved file;
                 ``reference``: the generated configuration reference)
    cluster      the cluster session: the private local Ray head and what it owns (``session``,
                 ``owned``), the process environment defaults, the HTTP status server, the loopback
                 bind guard (``netguard``)
    records      what a run keeps: the ledger of trajectory ids, the metrics log and trackers,
                 samples, held-out evaluations and the best version (``heldout``, ``keeper``),
                 exports of a run
    workers      rollout worker supervision (``pool``: start, scale, replace, fingerprints)
    sources      where trajectories come from: the buffer and its admission rule, the env and agent
                 sources (``source``), the gateway's agent runner, saved trajectories on resume
    publication  versions reaching their consumers: the old-logit routes, the publisher (one
                 publication applied at a time), the fingerprints every consumer must serve and
                 their check
    loop         the job itself: ``job`` (run_job, the loop read top to bottom), ``assembly`` (starts
                 the parts), ``parts`` (``Job``: one iteration's operations), ``report`` (a step's
                 metrics, the status and the summary), ``eval_env`` (``vintage eval env``)

``config`` and ``cluster`` import nothing above them, ``records`` only ``config``; ``loop`` may import
every room and no room imports ``loop``.

Invariants: the only part that runs the loop and owns the Ray cluster; the HTTP server never
blocks on it (requests are recorded and applied between iterations); imports
:mod:`trainer.algorithm` and :mod:`trainer.learner`, and neither imports it.
"""
