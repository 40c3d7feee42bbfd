"""The first test run builds llama.cpp for many minutes: pytest must say so when it starts, not
hold the message back as captured output."""

import os
import subprocess
import sys

from repo_paths import REPO


def test_the_llama_cpp_build_is_announced_on_the_terminal(tmp_path):
    # an empty cache and no cmake on PATH: the build is announced, then refused at once (no minutes spent)
    cache = tmp_path / "cache"
    env = {**os.environ, "PATH": str(tmp_path), "MOEBENCH_CACHE": str(cache)}
    for name in ("MOEBENCH_LLAMA_SERVER", "CC", "CXX", "CI"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/backends/test_llamacpp.py::test_random_mixtral_greedy_equals_in_process"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    shown = result.stdout + result.stderr
    assert result.returncode == 0, shown[-3000:]  # skipped where it cannot be built
    notice = next((line for line in shown.splitlines() if "llama-server is not built for this CPU yet" in line), None)
    assert notice is not None, shown[-3000:]
    assert "test_llamacpp" in notice and str(cache / "llama.cpp") in notice and "min" in notice
    assert "LLAMA.CPP TESTS NOT RUN" in shown
