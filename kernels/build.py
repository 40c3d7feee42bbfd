"""Building the C++ extensions: once per environment, at first use, announced, interruptible.

Where a library lives. Each extension gets a folder of its own under the extensions cache
(`extensions_root()`), named after a digest of everything its library depends on: the sources and
flags, the torch build, the Python ABI and the interpreter prefix, i.e. the virtual environment
(`environment()`). Two environments, checkouts or torch versions never share a folder, so none
rebuilds another's library or loads one built for a different torch. A stamp written next to the
library after a successful build says what it was built for and holds the library's digest; a
library whose stamp does not match the running environment is rebuilt, never loaded.

How a build runs. In a worker process with a process group of its own (torch's `load` runs ninja,
ninja the compilers), into a staging folder; the finished library is moved into place by one
rename and only then stamped, so an interrupted build leaves nothing half-written where a library
is looked for. SIGTERM during a build is handled as Ctrl-C: the worker's process group is stopped
(ninja passes the signal on to the compilers) and KeyboardInterrupt raised. If this process is
killed outright (SIGKILL), the kernel sends the worker SIGTERM (PR_SET_PDEATHSIG) and the worker
stops its group itself.

Who builds. One process per folder at a time, holding an flock on the folder's `lock` file. The
kernel drops an flock when its holder dies, so a killed build never blocks a later one: the next
builder finds the dead holder's record in the lock file, says so, clears its staging folder and
builds. Waiting for a live holder is bounded (MOEBENCH_BUILD_WAIT_S, default 600 s, about twice
the slowest build seen), then a one-line error names the lock file.

The compiler (`CXX`) is not part of the digest: it changes how a library was made, not what it
links against.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

from moebench.errors import MoebenchError
from moebench.processes import die_with_parent

STAMP_SCHEMA = "moebench.extension/1"
ROOT_ENV = "MOEBENCH_EXTENSIONS_DIR"
WAIT_ENV = "MOEBENCH_BUILD_WAIT_S"
DEFAULT_WAIT_S = 600.0
LOCK_POLL_S = 0.25
STOP_GRACE_S = 10.0  # after SIGTERM, how long the worker's group gets before SIGKILL


class BuildError(RuntimeError):
    """A build that ran and failed (compiler error, missing toolchain); the message is one line."""


class BuildWaitTimeout(MoebenchError):
    """Another live process held the build lock for longer than the bound."""


@dataclass(frozen=True)
class Extension:
    """One C++ extension: `base` names it (a valid identifier), `what` is how messages call it,
    `estimate` how long a first build takes here."""

    base: str
    what: str
    sources: tuple[Path, ...]
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    estimate: str = ""
    headers: tuple[Path, ...] = ()  # included by the sources: part of what the library depends on

    def name(self, env: dict[str, str] | None = None) -> str:
        """`base` plus a digest of the sources and headers, the flags and the environment."""
        digest = hashlib.sha256(
            json.dumps({"cflags": self.cflags, "ldflags": self.ldflags, "environment": env or environment()},
                       sort_keys=True).encode()
        )
        for source in (*self.sources, *self.headers):
            digest.update(b"\0" + source.name.encode() + b"\0")  # object files are named after sources
            digest.update(source.read_bytes())
        return f"{self.base}_{digest.hexdigest()[:16]}"

    def folder(self, env: dict[str, str] | None = None) -> Path:
        return extensions_root() / self.name(env)

    def library(self, env: dict[str, str] | None = None) -> Path:
        """Where this environment's library is (or will be)."""
        name = self.name(env)
        return extensions_root() / name / f"{name}.so"


def environment() -> dict[str, str]:
    """What a library must have been built for to be loaded here: the torch build, the Python ABI,
    the interpreter prefix (a virtual environment's own folder), the machine."""
    import torch

    return {
        "torch": torch.__version__,
        "torch_git": str(torch.version.git_version),
        "torch_path": os.path.realpath(os.path.dirname(torch.__file__)),
        "cxx11_abi": str(torch._C._GLIBCXX_USE_CXX11_ABI),
        "python": platform.python_version(),
        "python_abi": str(sysconfig.get_config_var("EXT_SUFFIX") or sys.implementation.cache_tag),
        "prefix": os.path.realpath(sys.prefix),
        "machine": platform.machine(),
    }


def extensions_root() -> Path:
    """MOEBENCH_EXTENSIONS_DIR, else `moebench` under TORCH_EXTENSIONS_DIR, else
    ~/.cache/moebench/extensions (XDG_CACHE_HOME respected)."""
    if os.environ.get(ROOT_ENV):
        return Path(os.environ[ROOT_ENV]).expanduser()
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"]).expanduser() / "moebench"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "moebench" / "extensions"


def wait_limit_s() -> float:
    text = os.environ.get(WAIT_ENV, "").strip()
    if not text:
        return DEFAULT_WAIT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise MoebenchError(f"{WAIT_ENV}={text!r}: expected a number of seconds above 0")
    return value


def find_ninja() -> str | None:
    """The ninja binary torch's extension builder will run; a pip-installed ninja lives next to
    the interpreter (or in the `ninja` package), which may not be on PATH when the virtual
    environment is not activated: that directory is then added to PATH."""
    found = shutil.which("ninja")
    if found:
        return found
    candidates = [os.path.dirname(sys.executable)]
    try:
        import ninja  # the PyPI package

        candidates.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    for directory in candidates:
        path = os.path.join(directory, "ninja")
        if os.access(path, os.X_OK):
            os.environ["PATH"] = directory + os.pathsep + os.environ.get("PATH", "")
            return path
    return None


def build_extension(ext: Extension) -> ModuleType:
    """The extension's module for this environment: its library loaded if one was built and
    stamped for this environment, else built first (announced, under the folder's lock)."""
    env = environment()
    name = ext.name(env)
    if name in sys.modules:
        return sys.modules[name]
    folder = extensions_root() / name
    library = folder / f"{name}.so"
    module, problem = _load_if_stamped(library, name, env)
    if module is not None:
        return module
    if find_ninja() is None:
        raise BuildError("ninja not found (pip install ninja)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuildError(f"cannot create {folder}: {e.strerror} (set {ROOT_ENV} to a writable folder)") from e
    with _sigterm_as_interrupt(), _BuildLock(folder / "lock", ext.what) as lock:
        if lock.interrupted is not None:
            _say(f"an earlier build of {ext.what} (pid {lock.interrupted.get('pid', '?')}) was interrupted and its "
                 f"process is gone; building again")
        _remove_dead_staging(folder)
        module, problem = _load_if_stamped(library, name, env)  # built by the process waited for?
        if module is not None:
            return module
        if problem != _NOT_BUILT:
            _say(f"not loading {library} ({problem}); rebuilding it")
        _compile(ext, name, env, folder, library)
        module, failure = _try_import(name, library)
        if module is None:
            raise BuildError(f"{ext.what} built but does not load: {failure}")
    return module


def _load_if_stamped(library: Path, name: str, env: dict[str, str]) -> tuple[ModuleType | None, str | None]:
    """(module, None) where the library's stamp matches this environment and it loads, else (None, why not)."""
    problem = _stamp_problem(library, name, env)
    if problem is not None:
        return None, problem
    return _try_import(name, library)


_NOT_BUILT = "not built yet"


def _stamp_problem(library: Path, name: str, env: dict[str, str]) -> str | None:
    """None if `library` exists and its stamp says it was built here, else what is wrong."""
    if not library.exists():
        return _NOT_BUILT
    try:
        stamp = json.loads(_stamp_path(library).read_text())
    except (OSError, ValueError):
        return "no readable stamp beside it (an interrupted build?)"
    if not isinstance(stamp, dict) or stamp.get("schema") != STAMP_SCHEMA or stamp.get("name") != name:
        return "its stamp is not for this extension"
    built_for = stamp.get("environment")
    if built_for != env:
        differences = [f"{key} {(built_for or {}).get(key)!r}, running {env[key]!r}" for key in env
                       if (built_for or {}).get(key) != env[key]]
        return "built for " + "; ".join(differences or ["another environment"])
    if stamp.get("library_sha256") != _file_sha256(library):
        return "the library is not the one its stamp describes"
    return None


def _try_import(name: str, library: Path) -> tuple[ModuleType | None, str | None]:
    if name in sys.modules:
        return sys.modules[name], None
    try:
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as e:
        return None, f"{type(e).__name__}: {e}"
    sys.modules[name] = module
    return module, None


def _stamp_path(library: Path) -> Path:
    return library.with_name(library.stem + ".stamp.json")


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _say(text: str) -> None:
    print(f"moebench: {text}", file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def _compile(ext: Extension, name: str, env: dict[str, str], folder: Path, library: Path) -> None:
    """Build in a worker process into a staging folder, then rename the library into place and stamp it."""
    staging = Path(tempfile.mkdtemp(prefix=f"build-{os.getpid()}-", dir=folder))
    log_path = folder / "build.log"
    job = {"parent": os.getpid(), "name": name, "sources": [str(s) for s in ext.sources],
           "cflags": list(ext.cflags), "ldflags": list(ext.ldflags), "staging": str(staging)}
    estimate = f"; {ext.estimate}" if ext.estimate else ""
    _say(f"compiling {ext.what} for this environment (torch {env['torch']}, {env['prefix']}){estimate}...")
    started = time.monotonic()
    try:
        with open(staging / "build.log", "wb") as log:
            worker = subprocess.Popen(
                [sys.executable, "-c", "from moebench.kernels.build import _worker_main; _worker_main()",
                 json.dumps(job)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=staging, start_new_session=True,
            )
        try:
            returncode = worker.wait()
        except BaseException:  # KeyboardInterrupt (Ctrl-C, or SIGTERM turned into it), or anything else
            _stop_group(worker)
            _say(f"compiling {ext.what} interrupted; nothing was installed")
            raise
        os.replace(staging / "build.log", log_path)
        if returncode != 0:
            raise BuildError(f"compiling {ext.what} failed ({_first_error(log_path)}); full log: {log_path}")
        os.replace(staging / f"{name}.so", library)
        _write_atomically(_stamp_path(library), json.dumps({
            "schema": STAMP_SCHEMA, "name": name, "environment": env,
            "sources": {str(s): _file_sha256(s) for s in (*ext.sources, *ext.headers)},
            "cflags": list(ext.cflags), "ldflags": list(ext.ldflags),
            "library_sha256": _file_sha256(library), "build_seconds": round(time.monotonic() - started, 1),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }, indent=2) + "\n")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _say(f"compiled {ext.what} in {_duration(time.monotonic() - started)}: {library}")


def _first_error(log_path: Path) -> str:
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    for line in lines:
        if re.search(r"\berror\b", line, re.IGNORECASE) and not line.startswith("FAILED:"):
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def _stop_group(worker: subprocess.Popen) -> None:
    """SIGTERM to the worker's process group (ninja forwards it to the compilers), SIGKILL after a grace."""
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, sig)
        try:
            worker.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_dead_staging(folder: Path) -> None:
    """Staging folders of builders that are gone (a killed build leaves its own behind)."""
    for staging in folder.glob("build-*"):
        match = re.fullmatch(r"build-(\d+)-.*", staging.name)
        if staging.is_dir() and match and not _pid_alive(int(match.group(1))):
            shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM raises KeyboardInterrupt while this is active, so a build stops and cleans up as on
    Ctrl-C. Only in the main thread, and only where SIGTERM still has its default action (a handler
    the program installed itself is left alone)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class _BuildLock:
    """An exclusive flock on `path`, waited for within `wait_limit_s()`. The holder writes a record
    (pid, what, since) into the file and empties it on release; a record found on taking the lock
    was left by a holder that died mid-build (`interrupted`)."""

    def __init__(self, path: Path, what: str):
        self.path, self.what = path, what
        self.fd: int | None = None
        self.interrupted: dict | None = None
        self.waited = False

    def __enter__(self) -> "_BuildLock":
        limit = wait_limit_s()
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + limit
        try:
            while True:
                try:
                    fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    pass
                except OSError as e:  # a filesystem without flock: building unlocked is only wasted work
                    if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                        raise
                    warnings.warn(f"moebench: cannot lock {self.path} ({e.strerror}); building {self.what} without "
                                  f"the lock (a concurrent build of it would be repeated work, not harm)",
                                  RuntimeWarning, stacklevel=3)
                    os.close(self.fd)
                    self.fd = None
                    return self
                holder = self._record()
                who = f"pid {holder.get('pid', '?')}"
                if not self.waited:
                    self.waited = True
                    _say(f"waiting for {who} to finish compiling {self.what} (lock {self.path}; "
                         f"giving up after {limit:.0f} s)")
                if time.monotonic() >= deadline:
                    raise BuildWaitTimeout(
                        f"gave up after {limit:.0f} s waiting for {who} to finish compiling {self.what}; lock file "
                        f"{self.path} (stop that process, or set {WAIT_ENV} to wait longer)")
                time.sleep(LOCK_POLL_S)
            left = self._record()
            if left:
                self.interrupted = left
            record = json.dumps({"pid": os.getpid(), "what": self.what, "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, record.encode(), 0)
        except BaseException:
            self._close()
            raise
        return self

    def _record(self) -> dict:
        try:
            text = os.pread(self.fd, 4096, 0).decode(errors="replace").strip()
            record = json.loads(text) if text else {}
        except (OSError, ValueError):
            return {"pid": "?"}
        return record if isinstance(record, dict) else {"pid": "?"}

    def _close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # drops the flock
            self.fd = None

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)  # released cleanly: no record left to read as an interrupted build
            self._close()


def _worker_main() -> None:
    """The build worker (see the module docstring); sys.argv[1] is the job as JSON."""
    job = json.loads(sys.argv[1])
    die_with_parent(job["parent"], signal.SIGTERM)

    def stop_group(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.killpg(os.getpgrp(), signal.SIGTERM)  # ninja passes it on to the compilers' groups

    signal.signal(signal.SIGTERM, stop_group)
    from torch.utils.cpp_extension import load

    load(name=job["name"], sources=job["sources"], extra_cflags=job["cflags"], extra_ldflags=job["ldflags"],
         build_directory=job["staging"], verbose=True)


class LazyExtension:
    """An extension built by `build()` on the first `get()`; None from then on where it failed (a
    warning says so once, and which slower path runs instead). A bounded wait for another process's
    build that runs out is an error (the build is busy, not broken); so is an interrupt. Which ops
    use the extension is the overrides' choice (engine/overrides.py), made where each op runs."""

    def __init__(self, what: str, build: Callable, fallback: str):
        self.what = what
        self.build, self.fallback = build, fallback
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.module = None
        self.tried = False
        self.failure: str | None = None

    def get(self):
        if self.tried:
            return self.module
        with self._lock:
            if self.tried:
                return self.module
            try:
                self.module = self.build()
            except BuildWaitTimeout:
                raise
            except Exception as e:  # no compiler, no ninja, no AVX2, read-only cache...
                text = str(e).strip()
                self.failure = f"{type(e).__name__}: {text.splitlines()[-1] if text else ''}"
                warnings.warn(f"moebench: {self.what} unavailable ({self.failure}); {self.fallback}",
                              RuntimeWarning, stacklevel=4)
            self.tried = True
            return self.module
