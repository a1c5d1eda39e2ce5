"""What a run keeps: the ledger of trajectory ids (``ledger``), per-step metrics and trackers
(``metrics_log``, ``trackers``), samples (``samples``), held-out evaluations (``heldout``), the
checkpoints kept and the best version (``keeper``) and exports of a run (``export``).

Invariants: the ledger closes by id (every generated trajectory is consumed, dropped with a reason,
buffered, held or in flight); non-finite numbers are never written as figures. Imports only
``config``."""
