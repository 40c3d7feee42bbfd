"""The architecture contracts in pyproject.toml ([tool.importlinter]: layers from the commands down
to the kernels, suites beside the runtime, no import cycles) hold on the package, and would catch a
module that breaks them. lint-imports reads the package laid out as installed: pyproject's
package-dir mapping spreads it over harness/, engine/, kernels/ and suites/."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark_scripts import load_benchmark
from repo_paths import REPO

ROOT = REPO


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    """The package as installed, each module a link to its file in this tree."""
    root = tmp_path_factory.mktemp("installed")
    for module, path in load_benchmark("import_cycles").package_files(ROOT).items():
        parts = module.split(".")
        dest = root.joinpath(*parts, "__init__.py") if path.stem == "__init__" else root.joinpath(*parts[:-1], f"{parts[-1]}.py")
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(path, dest)
    return root


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("import-linter is not installed in CI: the [test] extras were not installed")
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([exe, str(ROOT / "pyproject.toml"), "--no-cache", "--no-logo"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_contracts_hold(layout):
    result = lint_imports(layout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 kept, 0 broken" in result.stdout


def test_an_upward_import_and_a_cycle_are_caught(layout, tmp_path):
    probe = tmp_path / "probe"
    shutil.copytree(layout, probe, symlinks=True)
    (probe / "moebench" / "engine" / "upward.py").write_text("import moebench.measuring.run\n")
    (probe / "moebench" / "cycle_a.py").write_text("import moebench.cycle_b\n")
    (probe / "moebench" / "cycle_b.py").write_text("import moebench.cycle_a\n")
    result = lint_imports(probe)
    assert result.returncode != 0
    assert "moebench.engine.upward -> moebench.measuring.run" in result.stdout
    assert "No import cycles, at any depth BROKEN" in result.stdout
    assert "Suites beside the runtime: they import none of it KEPT" in result.stdout


def test_the_cycle_script_agrees(capsys):
    """benchmarks/import_cycles.py, which counts the same graph without import-linter, finds none."""
    assert load_benchmark("import_cycles").main([]) == 0
    assert " 0 import cycles" in capsys.readouterr().out


MAX_MODULE_LINES = 600


def test_no_module_of_the_package_is_over_600_lines():
    """A module over 600 lines holds more than one job: split it by job, as serve.py and
    bailing_hybrid.py were."""
    long = {f"{module} ({path.relative_to(ROOT)})": n
            for module, path in load_benchmark("import_cycles").package_files(ROOT).items()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
