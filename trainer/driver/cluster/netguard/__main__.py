"""``python -m trainer.driver.cluster.netguard COMMAND [ARGS...]``: run COMMAND with the loopback bind
interposer loaded (:func:`trainer.driver.cluster.netguard.loopback_env`), so every socket COMMAND's
process tree binds to a wildcard address listens on loopback instead. ``make test`` runs pytest so:
the test session's own Ray driver port is then on loopback like its cluster's."""

from __future__ import annotations

import os
import sys

from trainer.driver.cluster.netguard import loopback_env

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m trainer.driver.cluster.netguard COMMAND [ARGS...]")
    os.execvpe(sys.argv[1], sys.argv[1:], loopback_env())
