"""The scripts of benchmarks/ (outside the package) loaded as modules, or run as processes of their own
(a script that wraps the engine's methods for the whole process), for their tests."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module."""
    path = BENCHMARKS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_benchmark(name: str, *args: str) -> str:
    """benchmarks/<name>.py run with `args` in a process of its own; its standard output. Fails the test
    with the end of its standard error where it exits other than 0."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *args],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
