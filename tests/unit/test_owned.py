"""What a process owns is stopped once, latest first, at exit and on SIGTERM / SIGINT / SIGHUP, and the
signal then goes on to the handler that was there before; an ignored signal stops nothing.

Each case runs in a child Python process (signals and exit handlers are process-wide); the owned
"stops" only print, so nothing but the child is signalled. A child starts from the dispositions a
Python process has when nothing is inherited (SIGINT raises KeyboardInterrupt, SIGTERM and SIGHUP take
the default action), whatever this process inherited: a run in the background ignores SIGINT, one
under ``nohup`` ignores SIGHUP. A case that tests another disposition sets it itself.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from trainer.driver.cluster import owned

REPO = Path(__file__).resolve().parents[2]

PRELUDE = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
from trainer.driver.cluster import owned
def say(word):
    return lambda: print(word, flush=True)
"""


def run_child(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + body], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_sigterm_stops_every_owned_once_latest_first_then_takes_the_default_action():
    out = run_child("""
owned.own("head", say("head"))
owned.own("node", say("node"))
owned.own("gone", say("never"))
owned.disown("gone")
os.kill(os.getpid(), signal.SIGTERM)
print("not reached", flush=True)
""")
    # the node joined after the head: stopped first; the disowned stop never runs; the default
    # action of SIGTERM ends the child, so its status is -15 and the exit handler has nothing left
    assert (out.returncode, out.stdout.split()) == (-signal.SIGTERM, ["node", "head"]), out.stderr


def test_a_previous_python_handler_is_called_after_the_stops_and_a_second_signal_stops_nothing():
    out = run_child("""
signal.signal(signal.SIGHUP, lambda s, f: print("previous", signal.Signals(s).name, flush=True))
owned.own("head", say("head"))
os.kill(os.getpid(), signal.SIGHUP)
os.kill(os.getpid(), signal.SIGHUP)  # idempotent: every stop already ran
print("left", owned.owned_keys(), flush=True)
""")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["head", "previous SIGHUP", "previous SIGHUP", "left []"]


def test_sigint_stops_then_raises_keyboard_interrupt_and_a_normal_exit_stops_what_is_left():
    out = run_child("""
owned.own("a", say("a"))
try:
    os.kill(os.getpid(), signal.SIGINT)
except KeyboardInterrupt:
    print("interrupted", flush=True)
owned.own("b", say("b at exit"))
""")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["a", "interrupted", "b at exit"]


def test_an_ignored_signal_stops_nothing():
    out = run_child("""
signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
owned.own("head", say("head at exit"))
os.kill(os.getpid(), signal.SIGHUP)
print("still running", flush=True)
""")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["still running", "head at exit"]


def gone_within(p: psutil.Process, timeout_s: float) -> bool:
    """True once ``p`` has ended (a zombie has) within ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_stop_processes_ends_a_recorded_process_and_its_child_and_skips_one_already_gone():
    # SIGTERM's default action in both, whatever this process inherited (the parent's is set before 'ready')
    dfl = "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_DFL)"
    parent = subprocess.Popen(
        [sys.executable, "-c", f"{dfl}; subprocess.Popen([sys.executable, '-c', {dfl + '; time.sleep(120)'!r}]); "
         "print('ready', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    ended = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        recorded_ended = psutil.Process(ended.pid)
        ended.kill()
        assert ended.wait(timeout=30) == -signal.SIGKILL
        assert parent.stdout.readline() == "ready\n"
        recorded = psutil.Process(parent.pid)
        (child,) = recorded.children()  # not recorded itself: found as a descendant at stop time
        owned.stop_processes([recorded_ended, recorded], timeout_s=10.0)
        assert parent.wait(timeout=30) == -signal.SIGTERM
        assert gone_within(child, 30.0)
    finally:
        for p in (parent, ended):
            if p.poll() is None:
                p.kill()
