"""llama.cpp's `llama-server` and `llama-batched-bench`, built from source by moebench, and the
bundled model as a GGUF file.

The source is the registry's `llama-cpp-python` source distribution, which vendors the whole
llama.cpp tree (server included) under `vendor/llama.cpp`; pip fetches it, cmake builds only the
`llama-server` and `llama-batched-bench` targets. The binaries are cached per llama.cpp version
and per CPU: `GGML_NATIVE=ON` compiles ggml's CPU backend with `-march=native` and no run-time dispatch (dispatch needs
`GGML_BACKEND_DL` with `GGML_CPU_ALL_VARIANTS`, a build of every variant), so a binary built on
an AVX-512 machine would die of an illegal instruction on an AVX2-only one. The cache key holds
a digest of the CPU's feature flags; a machine with other flags builds its own copy.

Cache root: `$MOEBENCH_CACHE`, else `$XDG_CACHE_HOME/moebench`, else `~/.cache/moebench`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from moebench.errors import MoebenchError

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
VENDORED_TREE = "vendor/llama.cpp"
# Only the targets below, statically linked so the cached binary needs nothing from the build tree; no
# web UI (its prebuilt assets would be fetched from the network), no TLS (loopback only).
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_CCACHE=OFF",
)
# Built together by one `cmake --build`: the server (bench-engine's HTTP yardstick, serve) and
# llama.cpp's own batched decode benchmark (bench-engine's in-process yardstick).
LLAMA_TARGETS = ("llama-server", "llama-batched-bench")
BINARY_OVERRIDES = {"llama-server": "MOEBENCH_LLAMA_SERVER", "llama-batched-bench": "MOEBENCH_LLAMA_BATCHED_BENCH"}
BUILD_JOBS = 2
# about 10 CPU-minutes of compiling (measured, docs/engines.md): the wall time depends on the load
BUILD_ESTIMATE = "about 10 CPU-minutes: ~5-6 min on 2 idle cores, 20-35 min on a busy shared 2-core VM"


def cache_root() -> Path:
    if os.environ.get("MOEBENCH_CACHE"):
        return Path(os.environ["MOEBENCH_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moebench"


def cpu_features() -> list[str]:
    """The CPU's instruction-set flags (Linux /proc/cpuinfo; elsewhere the platform's description)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return sorted(set(value.split()))
    except OSError:
        pass
    return [platform.machine(), platform.processor()]


def build_key() -> str:
    digest = hashlib.sha256(" ".join([platform.machine(), *cpu_features()]).encode()).hexdigest()[:12]
    return f"{LLAMA_CPP_PYTHON_VERSION}-{platform.machine()}-{digest}"


def build_dir() -> Path:
    return cache_root() / "llama.cpp" / build_key()


def _say(message: str) -> None:
    print(f"moebench: {message}", file=sys.stderr, flush=True)


@contextmanager
def _file_lock(path: Path, waiting_message: str):
    """An exclusive lock on `path` across processes; says so while it waits for another holder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(waiting_message)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _toolchain() -> dict[str, str]:
    found = {"cmake": shutil.which("cmake"),
             "C compiler": os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang"),
             "C++ compiler": os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")}
    missing = [name for name, path in found.items() if not path]
    if missing:
        raise MoebenchError(f"building llama.cpp's server needs {' and '.join(missing)}, not found on PATH "
                            "(install them, e.g. `apt-get install cmake g++`)")
    return found


def _run_logged(argv: list[str], log: Path, what: str, cwd: Path | None = None) -> None:
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(argv)}\n")
        out.flush()
        result = subprocess.run(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
        raise MoebenchError(f"{what} failed (exit {result.returncode}): {tail[0] if tail else ''} (full log: {log})")


def _extract_vendored_tree(sdist: Path, dest: Path) -> Path:
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if f"/{VENDORED_TREE}/" in m.name or m.name.endswith(f"/{VENDORED_TREE}")]
        if not members:
            raise MoebenchError(f"{sdist}: no {VENDORED_TREE} in the source distribution")
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4: refuse links and paths leaving `dest`
            archive.extractall(dest, members=members, filter="data")
        else:
            unsafe = [m.name for m in members if m.issym() or m.islnk() or m.name.startswith("/") or ".." in m.name.split("/")]
            if unsafe:
                raise MoebenchError(f"{sdist}: unexpected links or paths in the archive ({unsafe[0]})")
            archive.extractall(dest, members=members)
    top = members[0].name.split("/", 1)[0]
    return dest / top / VENDORED_TREE


def build_llama_binaries(dest: Path, targets: tuple[str, ...] = LLAMA_TARGETS) -> dict[str, Path]:
    """Fetch the source distribution, build `targets` with one `cmake --build` into `dest/bin`,
    record how in `dest/build.json` (one entry per target, so a later build of a missing target
    keeps the record of the earlier ones)."""
    tools = _toolchain()
    dest.mkdir(parents=True, exist_ok=True)
    log = dest / "build.log"
    with open(log, "a") as out:
        out.write(f"\n# building {' '.join(targets)}\n")
    _say(f"building llama.cpp's {' and '.join(targets)} from llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}'s "
         f"source distribution, once for this CPU ({BUILD_ESTIMATE}); cached in {dest}; log: {log}")
    started = time.monotonic()
    built_paths: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(prefix="build-", dir=dest.parent) as work:
        work = Path(work)
        _run_logged([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                     f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(work)], log,
                    "downloading the llama-cpp-python source distribution")
        sdists = sorted(work.glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            raise MoebenchError(f"pip download left no llama_cpp_python-*.tar.gz in {work} (full log: {log})")
        source = _extract_vendored_tree(sdists[0], work / "src")
        build = work / "build"
        _run_logged([tools["cmake"], "-S", str(source), "-B", str(build), *CMAKE_OPTIONS,
                     f"-DCMAKE_C_COMPILER={tools['C compiler']}", f"-DCMAKE_CXX_COMPILER={tools['C++ compiler']}"],
                    log, "configuring llama.cpp with cmake")
        target_args = [arg for name in targets for arg in ("--target", name)]
        _run_logged([tools["cmake"], "--build", str(build), *target_args, "-j", str(BUILD_JOBS)],
                    log, f"building {' and '.join(targets)}")
        (dest / "bin").mkdir(exist_ok=True)
        for name in targets:
            built = build / "bin" / name
            if not built.is_file():
                raise MoebenchError(f"the build finished without {built} (full log: {log})")
            target = dest / "bin" / name
            staging = target.with_name(f".{name}.tmp")
            shutil.copy2(built, staging)
            os.replace(staging, target)
            built_paths[name] = target
    minutes = (time.monotonic() - started) / 60
    record = {"llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "cmake_options": list(CMAKE_OPTIONS),
              "jobs": BUILD_JOBS, "minutes": round(minutes, 1), "built_with": list(targets),
              "machine": platform.machine(), "cpu_flags": cpu_features(),
              "compilers": {k: v for k, v in tools.items() if k != "cmake"}}
    records = _build_records(dest)
    records.update({name: record for name in targets})
    (dest / "build.json").write_text(json.dumps(records, indent=1) + "\n")
    _say(f"{' and '.join(targets)} built in {minutes:.1f} min: {dest / 'bin'}")
    return built_paths


def _build_records(dest: Path) -> dict:
    """`dest/build.json` as {target: record}; a cache from before the per-target records (one flat
    record, for the server alone) reads as the server's."""
    try:
        records = json.loads((dest / "build.json").read_text())
    except (OSError, ValueError):
        return {}
    return {"llama-server": records} if "llama_cpp_python" in records else records


def llama_binary_path(name: str, build: bool = True) -> Path:
    """The cached llama.cpp binary `name` (one of LLAMA_TARGETS) for this CPU. When it is missing,
    every missing target is built in one go, under a lock; targets already cached are not rebuilt.
    The environment variable in BINARY_OVERRIDES names a binary to use instead (one you built)."""
    if name not in LLAMA_TARGETS:
        raise ValueError(f"unknown llama.cpp binary {name!r}; known: {', '.join(LLAMA_TARGETS)}")
    override = BINARY_OVERRIDES[name]
    if os.environ.get(override):
        given = Path(os.environ[override])
        if not (given.is_file() and os.access(given, os.X_OK)):
            raise MoebenchError(f"{override}={given}: not an executable file")
        return given
    dest = build_dir()
    binary = dest / "bin" / name
    if binary.is_file():
        return binary
    if not build:
        raise MoebenchError(f"no {name} built for this CPU in {dest} (run `moebench engines build-llamacpp`)")
    with _file_lock(dest.parent / f"{dest.name}.lock",
                    f"another moebench process is building llama.cpp into {dest}; waiting for it"):
        missing = tuple(t for t in LLAMA_TARGETS if not (dest / "bin" / t).is_file())
        if missing:  # else the other process finished it
            build_llama_binaries(dest, missing)
        return binary


def llama_server_path(build: bool = True) -> Path:
    """The cached `llama-server` for this CPU (`MOEBENCH_LLAMA_SERVER` overrides)."""
    return llama_binary_path("llama-server", build)


def llama_batched_bench_path(build: bool = True) -> Path:
    """The cached `llama-batched-bench` for this CPU (`MOEBENCH_LLAMA_BATCHED_BENCH` overrides)."""
    return llama_binary_path("llama-batched-bench", build)


def checkpoint_digest(model_dir: Path) -> str:
    """sha256 over the files an export reads (config, tokenizer, weights), plus the exporter's version."""
    from moebench.models.export_gguf import EXPORT_FORMAT_VERSION

    digest = hashlib.sha256(f"export-format-{EXPORT_FORMAT_VERSION}".encode())
    files = sorted(p for p in model_dir.iterdir()
                   if p.suffix == ".safetensors" or p.name in ("config.json", "tokenizer.json", "tokenizer_config.json")
                   or p.name.endswith(".safetensors.index.json"))
    for f in files:
        digest.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def gguf_path(model_dir: Path, dtype: str = "f32") -> Path:
    """`model_dir` exported to GGUF, cached by the checkpoint's digest (exported on first use)."""
    from moebench.models.export_gguf import export_gguf

    model_dir = Path(model_dir)
    target = cache_root() / "gguf" / f"{model_dir.name}-{checkpoint_digest(model_dir)}-{dtype}.gguf"
    if not target.is_file():
        with _file_lock(target.with_name(target.name + ".lock"), f"waiting for another process exporting {target}"):
            if not target.is_file():
                export_gguf(model_dir, target, dtype)
    return target


def bundled_gguf_path(dtype: str = "f32") -> Path:
    from moebench.models.bundled import bundled_model_path

    return gguf_path(bundled_model_path(), dtype)
