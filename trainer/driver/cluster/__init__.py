"""The cluster session: the private local Ray head and the processes it owns (``session``,
``owned``), environment defaults for every process (``environment``), the HTTP status server
(``server``) and the loopback-only bind guard (``netguard``).

Invariants: every server binds 127.0.0.1 unless a cluster config says otherwise; only what this
process started is stopped. Imports only ``config``."""
