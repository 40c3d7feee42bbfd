"""kernels/build.py: per-environment extension folders, stamps, the build lock, interrupted builds.

The build mechanics run on a tiny extension (a Python C module, no torch headers: it compiles in
about a second) through the same path the real extensions take. Builds that must be interrupted
or watched run in child processes, as a user's runs would.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moebench.errors import MoebenchError
from moebench.kernels import build
from moebench.kernels.build import BuildWaitTimeout, Extension, LazyExtension

TINY_SOURCE = r"""
#include <Python.h>

#define TINY_JOIN2(a, b) a##b
#define TINY_JOIN(a, b) TINY_JOIN2(a, b)
#define TINY_STR2(x) #x
#define TINY_STR(x) TINY_STR2(x)

static PyObject *answer(PyObject *, PyObject *) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, "42"}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, TINY_STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};
PyMODINIT_FUNC TINY_JOIN(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module_def); }
"""

# Builds the tiny extension in this process's environment and says what it loaded.
BUILD_SCRIPT = r"""
import json, sys
from pathlib import Path
from moebench.kernels.build import Extension, build_extension, environment
from moebench.errors import MoebenchError

ext = Extension("moebench_tiny", "the tiny test extension", (Path(sys.argv[1]),), ("-O0",), estimate="a second or two")
try:
    module = build_extension(ext)
except MoebenchError as e:
    print(f"{type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(2)
print(json.dumps({"answer": module.answer(), "file": module.__file__, "prefix": sys.prefix,
                  "name": ext.name(), "environment": environment()}))
"""

COMPILING = "moebench: compiling"  # how a build is announced

# Stands in for the compiler: records its pid, then hangs as a long compile would.
HANGING_CXX = """#!/bin/sh
echo $$ > "$HANG_MARK"
exec sleep 300
"""


def have_toolchain() -> bool:
    return shutil.which("c++") is not None and build.find_ninja() is not None


needs_toolchain = pytest.mark.skipif(not have_toolchain(), reason="no C++ compiler or ninja")


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """The tiny extension's source, the build script and an empty extensions root for this test."""
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY_SOURCE)
    script = tmp_path / "build_tiny.py"
    script.write_text(BUILD_SCRIPT)
    root = tmp_path / "extensions"
    monkeypatch.setenv(build.ROOT_ENV, str(root))
    monkeypatch.delenv(build.WAIT_ENV, raising=False)
    monkeypatch.delenv("CXX", raising=False)
    return source, script, root


def run_build(python: str, script: Path, source: Path, **env) -> subprocess.CompletedProcess:
    """The build script in a child process; a hang fails the test instead of stalling the suite."""
    return subprocess.run([python, str(script), str(source)], capture_output=True, text=True, timeout=240,
                          env={**os.environ, **env})


def loaded(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def library_state(library: Path) -> tuple:
    stat = library.stat()
    return stat.st_ino, stat.st_mtime_ns, library.with_name(library.stem + ".stamp.json").read_text()


def process_gone(pid: int, within_s: float = 20.0) -> bool:
    """True once `pid` no longer runs (a zombie nobody reaps counts as gone)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


def wait_for_file(path: Path, proc: subprocess.Popen, within_s: float = 120.0) -> None:
    deadline = time.monotonic() + within_s
    while not (path.exists() and path.read_text().strip()):
        if proc.poll() is not None:
            raise AssertionError(f"the build ended early:\n{proc.communicate()[1]}")
        assert time.monotonic() < deadline, "the compiler stand-in never started"
        time.sleep(0.1)


# --- naming: every input that makes a library differ makes its folder differ ---------------------


@pytest.mark.parametrize("key", ["torch", "torch_git", "torch_path", "cxx11_abi", "python", "python_abi",
                                 "prefix", "machine"])
def test_every_environment_input_changes_the_name(tmp_path, key):
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY_SOURCE)
    ext = Extension("moebench_tiny", "tiny", (source,), ("-O0",))
    env = build.environment()
    assert set(env) == {"torch", "torch_git", "torch_path", "cxx11_abi", "python", "python_abi", "prefix", "machine"}
    assert ext.name(env) == ext.name(dict(env))
    assert ext.name({**env, key: env[key] + "-other"}) != ext.name(env)


def test_sources_and_flags_change_the_name(tmp_path):
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY_SOURCE)
    env = build.environment()
    base = Extension("moebench_tiny", "tiny", (source,), ("-O0",))
    assert Extension("moebench_tiny", "tiny", (source,), ("-O1",)).name(env) != base.name(env)
    assert Extension("moebench_tiny", "tiny", (source,), ("-O0",), ("-lm",)).name(env) != base.name(env)
    before = base.name(env)
    source.write_text(TINY_SOURCE + "\n// changed\n")
    assert base.name(env) != before
    header = tmp_path / "tiny.h"
    header.write_text("// shared\n")
    with_header = Extension("moebench_tiny", "tiny", (source,), ("-O0",), headers=(header,))
    before = with_header.name(env)
    header.write_text("// shared, changed\n")
    assert with_header.name(env) != before


def test_the_real_extensions_are_keyed_by_environment():
    from moebench.kernels import cpu_moe, expert_loader

    env = build.environment()
    for ext in (cpu_moe.EXTENSION, expert_loader.EXTENSION):
        assert ext.name(env) != ext.name({**env, "prefix": "/some/other/venv"})
        assert ext.library(env).parent.parent == build.extensions_root()
        assert "min" in ext.estimate  # every compile is announced with a time estimate


def test_extensions_root_follows_the_environment_variables(monkeypatch, tmp_path):
    monkeypatch.delenv(build.ROOT_ENV, raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch-ext"))
    assert build.extensions_root() == tmp_path / "torch-ext" / "moebench"
    monkeypatch.setenv(build.ROOT_ENV, str(tmp_path / "mine"))
    assert build.extensions_root() == tmp_path / "mine"


# --- two environments side by side ------------------------------------------------------------------


def venv_over_this_one(venv: Path) -> str:
    """A new virtual environment that sees this environment's packages, not the base interpreter's:
    `--system-site-packages` would reach only the base's, which on a fresh machine has no torch and
    no moebench. A .pth line in the new site-packages adds this one's (its .pth files included, so
    the editable moebench install is found). Returns the new interpreter."""
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    site_b = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                            capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    Path(site_b, "moebench_test_parent_env.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({p!r})" for p in ours) + "\n")
    return python


@needs_toolchain
def test_two_virtual_environments_build_and_keep_their_own_libraries(tiny, tmp_path):
    """A real second environment (its own prefix, this one's torch and moebench): each builds its
    own library once, loads only its own, and neither rebuilds or touches the other's."""
    source, script, root = tiny
    python_b = venv_over_this_one(tmp_path / "venv-b")

    first_a = run_build(sys.executable, script, source)
    first_b = run_build(python_b, script, source)
    a, b = loaded(first_a), loaded(first_b)
    assert a["answer"] == b["answer"] == 42
    assert "compiling the tiny test extension" in first_a.stderr
    assert "compiling the tiny test extension" in first_b.stderr
    assert a["name"] != b["name"] and a["file"] != b["file"]
    assert a["prefix"] != b["prefix"]
    for result in (a, b):  # each loaded the library under its own folder, stamped for its own interpreter
        library = Path(result["file"])
        assert library.parent == root / result["name"]
        stamp = json.loads(library.with_name(library.stem + ".stamp.json").read_text())
        assert stamp["environment"] == result["environment"]
        assert stamp["environment"]["prefix"] == os.path.realpath(result["prefix"])
    states = {name: library_state(Path(r["file"])) for name, r in (("a", a), ("b", b))}

    again_a = run_build(sys.executable, script, source)
    again_b = run_build(python_b, script, source)
    assert loaded(again_a)["file"] == a["file"] and loaded(again_b)["file"] == b["file"]
    assert COMPILING not in again_a.stderr and COMPILING not in again_b.stderr
    assert {name: library_state(Path(r["file"])) for name, r in (("a", a), ("b", b))} == states


@needs_toolchain
def test_a_library_stamped_for_another_torch_is_rebuilt_not_loaded(tiny):
    source, script, root = tiny
    first = loaded(run_build(sys.executable, script, source))
    library = Path(first["file"])
    stamp_path = library.with_name(library.stem + ".stamp.json")
    stamp = json.loads(stamp_path.read_text())
    stamp["environment"]["torch"] = "1.0.0"
    stamp_path.write_text(json.dumps(stamp))

    again = run_build(sys.executable, script, source)
    assert loaded(again)["answer"] == 42
    assert "built for torch '1.0.0'" in again.stderr and "rebuilding" in again.stderr
    assert json.loads(stamp_path.read_text())["environment"] == first["environment"]


def test_what_a_stamp_must_say_before_its_library_is_loaded(tmp_path):
    env = build.environment()
    name = "moebench_tiny_0123456789abcdef"
    library = tmp_path / f"{name}.so"
    stamp_path = tmp_path / f"{name}.stamp.json"
    assert build._stamp_problem(library, name, env) == build._NOT_BUILT
    library.write_bytes(b"a library")
    assert "no readable stamp" in build._stamp_problem(library, name, env)  # stopped between rename and stamp

    def stamp(**changes):
        record = {"schema": build.STAMP_SCHEMA, "name": name, "environment": env,
                  "library_sha256": build._file_sha256(library), **changes}
        stamp_path.write_text(json.dumps(record))
        return build._stamp_problem(library, name, env)

    assert stamp() is None
    assert "torch '1.0.0'" in stamp(environment={**env, "torch": "1.0.0"})
    assert "prefix '/other/venv'" in stamp(environment={**env, "prefix": "/other/venv"})
    assert "not for this extension" in stamp(name="moebench_tiny_ffffffffffffffff")
    assert "not the one its stamp describes" in stamp(library_sha256="0" * 64)


# --- interrupted builds --------------------------------------------------------------------------------


def start_hanging_build(script: Path, source: Path, tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """A build whose compiler hangs; returns the build process and the compiler stand-in's pid once it runs."""
    cxx = tmp_path / "hanging-c++"
    cxx.write_text(HANGING_CXX)
    cxx.chmod(0o755)
    mark = tmp_path / "compiler.pid"
    proc = subprocess.Popen([sys.executable, str(script), str(source)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "CXX": str(cxx), "HANG_MARK": str(mark)})
    wait_for_file(mark, proc)
    return proc, int(mark.read_text())


@needs_toolchain
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_build_killed_midway_stops_its_compiler_and_the_next_build_proceeds(tiny, tmp_path, how):
    source, script, root = tiny
    proc, compiler_pid = start_hanging_build(script, source, tmp_path)
    folder = root / Extension("moebench_tiny", "", (source,), ("-O0",)).name()
    assert list(folder.glob("build-*")), "the build stages in a folder of its own"

    proc.send_signal(how)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert process_gone(compiler_pid), "the compiler outlived the killed build"
    assert not list(folder.glob("*.so")), "nothing installed by an interrupted build"
    if how == signal.SIGTERM:  # handled as Ctrl-C: cleaned up, lock released with no record left
        assert "interrupted; nothing was installed" in stderr
        assert not list(folder.glob("build-*"))
        assert (folder / "lock").read_text() == ""

    after = run_build(sys.executable, script, source)  # the real compiler again; must not wait on a dead owner
    assert loaded(after)["answer"] == 42
    assert "waiting for" not in after.stderr
    if how == signal.SIGKILL:
        assert f"(pid {proc.pid}) was interrupted and its process is gone" in after.stderr
    assert not list(folder.glob("build-*")), "the dead build's staging folder is cleared"


@needs_toolchain
def test_two_builds_at_once_compile_once(tiny, tmp_path):
    """The second process waits for the first's build and loads its library without compiling."""
    source, script, root = tiny
    cxx = tmp_path / "slow-c++"
    cxx.write_text('#!/bin/sh\necho $$ > "$HANG_MARK"\nsleep 3\nexec c++ "$@"\n')
    cxx.chmod(0o755)
    mark = tmp_path / "compiler.pid"
    env = {**os.environ, "CXX": str(cxx), "HANG_MARK": str(mark)}
    first = subprocess.Popen([sys.executable, str(script), str(source)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    wait_for_file(mark, first)
    second = run_build(sys.executable, script, source, CXX=str(cxx), HANG_MARK=str(mark))
    out, err = first.communicate(timeout=120)
    first_result = loaded(subprocess.CompletedProcess(first.args, first.returncode, out, err))
    assert COMPILING in err
    assert loaded(second)["file"] == first_result["file"]
    assert "waiting for pid" in second.stderr and COMPILING not in second.stderr


# --- the bounded wait -------------------------------------------------------------------------------------


def test_waiting_for_a_live_builder_is_bounded_and_names_the_lock(tiny):
    source, script, root = tiny
    folder = root / Extension("moebench_tiny", "", (source,), ("-O0",)).name()
    folder.mkdir(parents=True)
    lock = folder / "lock"
    with open(lock, "w") as held:  # this test process is the live builder
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(json.dumps({"pid": os.getpid()}))
        held.flush()
        result = run_build(sys.executable, script, source, **{build.WAIT_ENV: "1"})
    assert result.returncode == 2
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("BuildWaitTimeout: gave up after 1 s waiting for pid")
    assert str(os.getpid()) in message and str(lock) in message and build.WAIT_ENV in message


def test_a_bad_wait_limit_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv(build.WAIT_ENV, "soon")
    with pytest.raises(MoebenchError, match="MOEBENCH_BUILD_WAIT_S='soon'"):
        build.wait_limit_s()


def test_a_wait_timeout_is_raised_not_turned_into_a_fallback(monkeypatch):
    def busy():
        raise BuildWaitTimeout("gave up after 1 s waiting for pid 1; lock file /x/lock")

    lazy = LazyExtension("the test extension", build=busy, fallback="no fallback")
    with pytest.raises(BuildWaitTimeout):
        lazy.get()
    assert not lazy.tried  # a later call tries again
