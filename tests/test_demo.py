"""``kvstore demo`` runs end to end: two spawned replicas, the second loads what the first stored."""

from __future__ import annotations

import os
import subprocess
import sys


def test_demo_runs_and_outputs_match():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "demo", "--model", "tiny", "--tokens", "300", "--new-tokens", "4"],
        capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "replica-1: loaded     0 tokens, computed   300" in out
    assert "replica-2: loaded   300 tokens, computed     0" in out
    assert "output identical: True" in out and "demo: OK" in out
