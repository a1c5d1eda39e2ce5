"""What a job prints is the user's business only: library deprecation notices are off in every
process, and a step line is one line at any width, terminal or not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from trainer.driver.cluster.environment import ENV_VARS

REPO = Path(__file__).resolve().parents[2]

WARN = (
    "import warnings; warnings.warn('old api', FutureWarning); warnings.warn('older api', DeprecationWarning); "
    "warnings.warn('yours', UserWarning)"
)


def test_every_process_of_a_job_ignores_library_deprecation_notices():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = str(REPO)
    code = (
        "import os, subprocess, sys; from trainer.driver.cluster.environment import defaults_env; defaults_env(); "
        f"r = subprocess.run([sys.executable, '-c', {WARN!r}], capture_output=True, text=True); "
        "sys.stdout.write(r.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["<string>:1: UserWarning: yours"]  # a child of the job's process
    assert {"PYTHONWARNINGS", "TORCH_CPP_LOG_LEVEL"} <= set(ENV_VARS)  # and Ray's workers get the same settings


def test_a_step_line_is_one_line_at_any_width():
    from vintage_cli.main import console

    line = (
        "step 12->13  reward 0.438  staleness mean 2.00 max 2  exact 1.00  kept 1.00  loss +0.0458  "
        "11 tok/s  train 41.0s  old-logit wait 0.2s  publish 0.3s"
    )
    assert len(line) == 147 and console.width == 80  # not a terminal: rich's default width
    with console.capture() as cap:
        console.print(line)
    assert cap.get() == line + "\n"
