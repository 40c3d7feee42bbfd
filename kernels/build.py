"""Building the C++ extensions: at first use, once, with one clear warning where they cannot build.

Each extension is named after a digest of its sources and flags (`extension_name`): torch caches a
build by name, and two checkouts or versions building one name in turn would load each other's
library, or rebuild it under each other's feet.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import warnings
from pathlib import Path
from typing import Callable


def extension_name(base: str, sources: list[Path], flags: list[str]) -> str:
    """`base` plus a digest of the sources and flags."""
    digest = hashlib.sha256("\0".join(flags).encode())
    for source in sources:
        digest.update(source.read_bytes())
    return f"{base}_{digest.hexdigest()[:12]}"


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


class LazyExtension:
    """An extension built by `build()` on the first `get()`; None from then on where it failed.

    The environment variable `env` chooses: "auto" (build, warn once and fall back on failure),
    `strict` (fail loudly), `off` (never build).
    """

    def __init__(self, what: str, env: str, strict: str, off: str, build: Callable, fallback: str):
        self.what, self.env, self.strict, self.off = what, env, strict, off
        self.build, self.fallback = build, fallback
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.module = None
        self.tried = False
        self.failure: str | None = None

    def mode(self) -> str:
        mode = os.environ.get(self.env, "auto").strip().lower() or "auto"
        if mode not in ("auto", self.strict, self.off):
            raise ValueError(f"{self.env}={mode!r}: expected auto, {self.strict} or {self.off}")
        return mode

    def get(self):
        if self.tried:
            return self.module
        with self._lock:
            if self.tried:
                return self.module
            mode = self.mode()
            if mode == self.off:
                self.failure = f"disabled by {self.env}={self.off}"
            else:
                try:
                    self.module = self.build()
                except Exception as e:  # no compiler, no ninja, no AVX2, read-only cache...
                    text = str(e).strip()
                    self.failure = f"{type(e).__name__}: {text.splitlines()[-1] if text else ''}"
                    if mode == self.strict:
                        self.tried = True
                        raise RuntimeError(f"moebench: cannot build {self.what}: {self.failure}") from e
                    warnings.warn(f"moebench: {self.what} unavailable ({self.failure}); {self.fallback}",
                                  RuntimeWarning, stacklevel=4)
            self.tried = True
            return self.module
