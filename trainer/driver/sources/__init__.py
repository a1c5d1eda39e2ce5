"""Where trajectories come from: the buffer and its staleness admission rule (``buffer``), the env
and agent sources behind one interface (``source``), the agent runner that drives gateway sessions
(``agent_runner``), and the trajectories saved at a checkpoint (``resume``).

Invariants: nothing is admitted past ``max_staleness``; every submitted sample is accounted for.
Imports ``config``, ``records`` and ``workers``."""
