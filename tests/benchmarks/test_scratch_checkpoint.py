"""The benchmark scripts' scratch checkpoints (measuring/bench_models.py: scratch_checkpoint) leave nothing
behind: a random-0.89b folder is 1.8-3.4 GB, and `timeout`'s SIGTERM ends a script before any cleanup of
its own would run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

CHILD = """
import sys, time
from moebench.measuring.bench_models import scratch_checkpoint
scratch_checkpoint("bundled")
print("loaded", flush=True)
if sys.argv[1] == "wait":
    time.sleep(60)
"""


def _child(tmp_path, mode):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    return subprocess.Popen([sys.executable, "-c", CHILD, mode], env=env, stdout=subprocess.PIPE, text=True)


def _left(tmp_path):
    return [p.name for p in tmp_path.iterdir() if p.name.startswith("moebench-checkpoint-")]


@pytest.mark.parametrize("mode", ["exit", "wait"])
def test_the_scratch_folder_is_gone_after_a_normal_exit_and_after_sigterm(tmp_path, mode):
    proc = _child(tmp_path, mode)
    assert proc.stdout.readline().strip() == "loaded"
    assert _left(tmp_path) or mode == "exit"  # while it runs, the folder is there
    if mode == "wait":
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == (0 if mode == "exit" else 128 + signal.SIGTERM)
    assert _left(tmp_path) == []
