"""SIGINT / SIGTERM on a job: the first asks the loop to stop after the step, a second exits at once."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from trainer.driver.cluster.session import StopSignal

REPO = Path(__file__).resolve().parents[2]

# the child starts from Python's own dispositions, whatever this process inherited
TWICE = """
import os, signal
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
from trainer.driver.cluster.session import StopSignal
stop = StopSignal()
with stop.installed():
    os.kill(os.getpid(), signal.SIGTERM)
    print("requested", stop.requested, flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    print("not reached", flush=True)
"""


def test_a_first_signal_asks_to_stop_and_a_second_exits_at_once_with_130():
    out = subprocess.run([sys.executable, "-c", TWICE], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 130
    assert out.stdout == "requested True\n"
    assert out.stderr.strip().splitlines()[-1] == "SIGTERM: stopping after this step (again to exit at once)"


def test_the_handlers_are_the_process_own_again_after_the_job():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stop = StopSignal()
    with stop.installed():
        assert signal.getsignal(signal.SIGTERM) == stop._handle == signal.getsignal(signal.SIGINT)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
