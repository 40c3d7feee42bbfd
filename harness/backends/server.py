"""Server processes that moebench starts: a free loopback port, the server's own log kept beside
the results, health before use, evidence read from the server itself, and no orphans (its own
process group, killed with the group; the kernel kills it too if moebench dies first)."""

from __future__ import annotations

import atexit
import functools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from moebench.backends.evidence import Observation, evaluate, json_field, prometheus_value  # noqa: F401
from moebench.backends.profiles import Evidence, Profile
from moebench.errors import MoebenchError
from moebench.processes import die_with_parent

_LIVE: set["ServerProcess"] = set()
LOG_TAIL_LINES = 12


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def stop_all_servers() -> None:
    for server in list(_LIVE):
        server.stop()


atexit.register(stop_all_servers)


class Placeholders:
    """Values for the braces in a profile's argv; the costly ones (a llama.cpp build, a GGUF
    export) are made only when a command names them."""

    def __init__(self, host: str, model: str | None, served_model: str | None, threads: int | None):
        self.fixed = {"host": host, "python": sys.executable,
                      "threads": str(threads or 1)}
        if model:
            self.fixed["model"] = model
        if served_model:
            self.fixed["served_model"] = served_model

    def _lazy(self, name: str) -> str | None:
        if name == "llama_server":
            from moebench.backends.llamacpp import llama_server_path

            return str(llama_server_path())
        if name == "bundled_gguf":
            from moebench.backends.llamacpp import bundled_gguf_path

            return str(bundled_gguf_path())
        if name == "bundled_model":
            from moebench.models.bundled import bundled_model_path

            return str(bundled_model_path())
        return None

    def fill(self, text: str, port: int | None = None) -> str:
        def value(match: re.Match) -> str:
            name = match.group(1)
            if name == "port" and port is not None:
                return str(port)
            if name in self.fixed:
                return self.fixed[name]
            lazy = self._lazy(name)
            if lazy is None:
                hint = " (give --model)" if name == "model" else ""
                raise MoebenchError(f"profile placeholder {{{name}}} has no value{hint}")
            self.fixed[name] = lazy
            return lazy

        return re.sub(r"\{([a-z_]+)\}", value, text)


class ServerProcess:
    def __init__(self, profile: Profile, placeholders: Placeholders, log_path: Path, health: str,
                 startup_timeout_s: float, host: str = "127.0.0.1"):
        self.profile = profile
        self.host = host
        self.port = free_port(host)
        self.argv = [placeholders.fill(a, self.port) for a in profile.command]
        self.env = {k: placeholders.fill(v, self.port) for k, v in profile.env.items()}
        self.log_path = log_path
        self.health = health
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.started_s: float | None = None
        self.observe: dict[str, set[str]] = {}  # extra endpoint paths to read, per moment
        self.observed = Observation("", source=str(log_path))

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"# moebench: {' '.join(self.argv)}\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(
                    self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env={**os.environ, **self.env}, start_new_session=True,
                    preexec_fn=functools.partial(die_with_parent, os.getpid(), signal.SIGKILL))
            except OSError as e:
                raise MoebenchError(f"profile {self.profile.name}: cannot start {self.argv[0]} ({e.strerror})") from None
        _LIVE.add(self)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        import httpx

        start = time.monotonic()
        deadline = start + self.startup_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                self.stop()
                raise MoebenchError(f"profile {self.profile.name}: the server exited with code {code} before it was "
                                    f"healthy; its log {self.log_path} ends: {self.log_tail(3)}")
            try:
                if httpx.get(self.base_url + self.health, timeout=2.0).status_code == 200:
                    self.started_s = time.monotonic() - start
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise MoebenchError(f"profile {self.profile.name}: {self.base_url + self.health} not healthy after "
                                    f"{self.startup_timeout_s:.0f} s (log: {self.log_path})")
            time.sleep(0.25)

    @property
    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return " | ".join(self.log_text().strip().splitlines()[-lines:])

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after `grace_s`."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever the server left in its group (workers, tokenizer processes)
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        _LIVE.discard(self)

    # ------------------------------------------------------------ evidence

    def evidence(self, when: str) -> tuple[dict, list[str]]:
        """Check the profile's evidence against the server itself: at "start" (healthy) its
        endpoints marked start; at "end" (the work done) the log regexes and the endpoints marked
        end. Returns what was seen and the failures (none when the configuration counts). The
        bodies read are kept in `observed`, with those of the paths in `observe[when]` (what
        other configurations' evidence reads, when this server is the baseline)."""
        ev: Evidence = self.profile.evidence
        paths = {c.path for c in ev.endpoints if c.when == when} | set(self.observe.get(when, ()))
        for path in sorted(paths):
            self._fetch(when, path)
        if when == "end":
            self.observed.log = self.log_text()
        return evaluate(ev, when, self.observed)

    def _fetch(self, when: str, path: str) -> None:
        import httpx

        self.observed.payloads.setdefault(when, {})[path] = None
        try:
            response = httpx.get(self.base_url + path, timeout=10.0)
        except httpx.HTTPError as e:
            self.observed.unanswered[(when, path)] = f"no answer ({type(e).__name__})"
            return
        if response.status_code != 200:
            self.observed.unanswered[(when, path)] = f"HTTP {response.status_code}"
            return
        self.observed.payloads[when][path] = response.text
