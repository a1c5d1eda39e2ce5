"""``python -m trainer.driver.cluster.netguard COMMAND [ARGS...]``: run COMMAND in the environment of
a private loopback-only Ray cluster (:func:`trainer.driver.cluster.netguard.private_cluster_env`), so
the Ray ports of COMMAND itself and of every cluster it starts listen on loopback only, with token
authentication. ``make test`` runs pytest so."""

from __future__ import annotations

import os
import sys

from trainer.driver.cluster.netguard import private_cluster_env

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m trainer.driver.cluster.netguard COMMAND [ARGS...]")
    os.execvpe(sys.argv[1], sys.argv[1:], private_cluster_env())
