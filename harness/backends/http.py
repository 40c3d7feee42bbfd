"""An OpenAI-compatible server as an engine backend: one already running (`--base-url`), or one
that moebench starts for each configuration of a profile file (`--profiles`)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from moebench.backends.openai import ClientOptions, OpenAIEngine
from moebench.backends.profiles import ProfileFile
from moebench.backends.server import Placeholders, ServerProcess
from moebench.errors import MoebenchError


@dataclass(frozen=True)
class ExternalServer:
    """The one configuration of a server moebench did not start: nothing to prove it by."""

    name: str = "server"
    approximate: bool = False

    def to_dict(self) -> dict:
        return {"name": self.name, "engine": "openai", "kernel": None, "scheduler": None, "prefetch": None}


class HttpBackend:
    def __init__(self, options: ClientOptions, run_dir: Path, profiles: ProfileFile | None = None,
                 base_url: str | None = None, served_model: str | None = None, tokenizer=None,
                 placeholders: Placeholders | None = None, warmup_requests=()):
        if (profiles is None) == (base_url is None):
            raise MoebenchError("--engine openai needs exactly one of --base-url or --profiles")
        self.options = options
        self.run_dir = run_dir
        self.profiles = profiles
        self.base_url = base_url
        self.served_model = served_model or (profiles.server.get("served_model") if profiles else None)
        self.tokenizer = tokenizer
        self.placeholders = placeholders
        self.warmup_requests = list(warmup_requests)
        self.configs = list(profiles.profiles) if profiles else [ExternalServer()]
        self.running: dict[str, ServerProcess] = {}  # keep_running: one server per profile, for the run
        self.startup_s: dict[str, list[float]] = {}

    def _start(self, profile, label: str) -> ServerProcess:
        log = self.run_dir / "servers" / f"{profile.name}-{label}.log"
        server = ServerProcess(profile, self.placeholders, log, self.profiles.health,
                               self.profiles.startup_timeout_s)
        server.start()
        self.startup_s.setdefault(profile.name, []).append(server.started_s)
        return server

    def _engine(self, base_url: str, server=None, start_evidence=({}, [])) -> OpenAIEngine:
        return OpenAIEngine(base_url, self.options, self.served_model, self.tokenizer, server, start_evidence)

    @contextmanager
    def session(self, cfg, label: str = "", observe: dict | None = None):
        """`observe`: endpoint paths per moment to read besides the configuration's own (the
        baseline's answers to what the other configurations' evidence reads)."""
        if self.profiles is None:
            yield self._engine(self.base_url)
            return
        keep = self.profiles.keep_running
        server = self.running.get(cfg.name) if keep else None
        fresh = server is None
        if fresh:
            server = self._start(cfg, "run" if keep else label)
            if keep:
                self.running[cfg.name] = server
        if observe:
            server.observe = observe
        try:
            start_evidence = server.evidence("start")
            engine = self._engine(server.base_url, server, start_evidence)
            if fresh and self.warmup_requests and label != "warmup":
                # a fresh server's first requests pay one-time costs; they are not measured
                engine.generate(self.warmup_requests)
            yield engine
        finally:
            if not keep:
                server.stop()

    def warm_up(self, suite, n_items: int) -> None:
        """Start each configuration once and prove its evidence before any trial is measured. The
        baseline first: its own output must fail every other configuration's evidence before any
        other server starts; once all have run, each configuration's evidence is judged against
        every configuration that lacks what it enables (moebench.backends.discrimination)."""
        from moebench.backends.discrimination import observed_paths, refuse_non_discriminating
        from moebench.errors import ActivationError

        # every server also answers what the others' evidence reads, so each configuration's
        # evidence can be judged against every other one's server
        observe = observed_paths(self.configs) if self.profiles is not None else None
        observations = {}
        for i, cfg in enumerate(self.configs):
            with self.session(cfg, "warmup", observe) as engine:
                result = engine.generate(self.warmup_requests)
                observed = engine.server.observed if engine.server is not None else None
            if result.failed_requests:
                first = next(c.error for c in result.completions if c.error)
                raise MoebenchError(f"config '{cfg.name}': {result.failed_requests} warm-up requests failed ({first})")
            if result.activation_errors:
                raise ActivationError(f"config '{cfg.name}': " + "; ".join(result.activation_errors))
            if observe is None:
                continue
            if cfg.name in self.running:  # keep_running: the trials need only its own evidence
                self.running[cfg.name].observe = {}
            observations[cfg.name] = observed
            if i == 0:
                refuse_non_discriminating(self.profiles.path, cfg, self.configs[1:], observations)
        if observe is not None and len(self.configs) > 1:
            refuse_non_discriminating(self.profiles.path, self.configs[0], self.configs[1:], observations)

    def describe(self) -> dict:
        d = {"engine": "openai", "options": vars(self.options), "served_model": self.served_model,
             "prompt_as": "chat" if self.options.chat else ("token_ids" if self.tokenizer else "text")}
        if self.profiles is not None:
            d.update(profiles=str(self.profiles.path), profiles_sha256=self.profiles.sha256,
                     server=self.profiles.server, keep_running=self.profiles.keep_running)
        else:
            d["base_url"] = self.base_url
        return d

    def close(self) -> None:
        for server in self.running.values():
            server.stop()
        self.running.clear()
