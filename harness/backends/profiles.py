"""Server profiles: one server program and named configurations of it, as data (TOML).

A configuration counts only with evidence seen from the server itself: regexes over its own log
and fields read from its own endpoints. The format is documented in docs/engines.md.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from moebench.errors import MoebenchError

CONDITIONS = ("equals", "matches", "at_least", "above")
WHEN = ("start", "end")


@dataclass(frozen=True)
class EndpointCheck:
    path: str
    field: str | None  # dotted path into a JSON body
    metric: str | None  # a sample name in Prometheus text format
    condition: str  # one of CONDITIONS
    expected: object
    when: str = "start"
    shared: bool = False  # holds for the baseline too, on purpose (not counted as proof)

    @property
    def label(self) -> str:
        what = self.field if self.field is not None else self.metric
        return f"{self.path} {what} {self.condition} {self.expected!r}"


@dataclass(frozen=True)
class Evidence:
    log_must: tuple[str, ...] = ()
    log_must_not: tuple[str, ...] = ()
    endpoints: tuple[EndpointCheck, ...] = ()
    log_shared: frozenset = frozenset()  # log_must patterns marked shared = true

    @property
    def empty(self) -> bool:
        return not (self.log_must or self.log_must_not or self.endpoints)


@dataclass(frozen=True)
class Profile:
    """One named configuration of the server: what a switch is to the bundled runtime."""

    name: str
    command: tuple[str, ...]  # the server's command with this configuration's arguments
    args: tuple[str, ...] = ()  # this configuration's own arguments (what sets it apart)
    env: dict = field(default_factory=dict, hash=False)
    evidence: Evidence = Evidence()
    approximate: bool = False

    def to_dict(self) -> dict:
        d = {"name": self.name, "engine": "openai", "command": list(self.command), "args": list(self.args),
             "env": dict(self.env), "kernel": None, "scheduler": None, "prefetch": None,
             "evidence": {"log_must": list(self.evidence.log_must),
                          "log_must_not": list(self.evidence.log_must_not),
                          "endpoints": [c.label for c in self.evidence.endpoints],
                          "shared": sorted(self.evidence.log_shared) + [c.label for c in self.evidence.endpoints
                                                                        if c.shared]}}
        if self.approximate:
            d["approximate"] = True
        return d


@dataclass
class ProfileFile:
    path: Path
    description: str
    server: dict
    profiles: list[Profile]  # the baseline first
    sha256: str
    checked: dict = field(default_factory=dict)  # [checked]: the engine version, recorded lines

    @property
    def baseline(self) -> Profile:
        return self.profiles[0]

    @property
    def recorded_dir(self) -> Path | None:
        """The recorded log lines and endpoint payloads the profile was checked against."""
        recorded = self.checked.get("recorded")
        return (self.path.parent / recorded).resolve() if recorded else None

    @property
    def health(self) -> str:
        return self.server.get("health", "/health")

    @property
    def startup_timeout_s(self) -> float:
        return float(self.server.get("startup_timeout_s", 300))

    @property
    def keep_running(self) -> bool:
        return bool(self.server.get("keep_running", False))

    def select(self, names: list[str]) -> None:
        """Keep only the named profiles (the baseline stays first)."""
        known = {p.name for p in self.profiles}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise MoebenchError(f"{self.path}: no profile named {', '.join(map(repr, unknown))} "
                                f"(the file has: {', '.join(sorted(known))})")
        self.profiles = [p for p in self.profiles if p.name in names]


def _fail(path: Path, message: str):
    raise MoebenchError(f"{path}: {message}")


def _strings(path: Path, where: str, value, default=()) -> tuple[str, ...]:
    if value is None:
        return tuple(default)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        _fail(path, f"{where} must be a list of strings")
    return tuple(value)


def _env(path: Path, where: str, value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        _fail(path, f"{where} must be a table of strings")
    return {str(k): str(v) for k, v in value.items()}


def _endpoint(path: Path, where: str, raw) -> EndpointCheck:
    if not isinstance(raw, dict) or not isinstance(raw.get("path"), str):
        _fail(path, f"{where}: each endpoint check needs a 'path'")
    has_field, has_metric = "field" in raw, "metric" in raw
    if has_field == has_metric:
        _fail(path, f"{where}: give exactly one of 'field' (JSON) or 'metric' (Prometheus)")
    conditions = [c for c in CONDITIONS if c in raw]
    if len(conditions) != 1:
        _fail(path, f"{where}: give exactly one of {', '.join(CONDITIONS)}")
    cond = conditions[0]
    if cond == "matches":
        try:
            re.compile(str(raw[cond]))
        except re.error as e:
            _fail(path, f"{where}: bad regex {raw[cond]!r} ({e})")
    when = raw.get("when", "start")
    if when not in WHEN:
        _fail(path, f"{where}: when must be one of {', '.join(WHEN)}")
    unknown = set(raw) - {"path", "field", "metric", "when", "shared", *CONDITIONS}
    if unknown:
        _fail(path, f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    if cond in ("at_least", "above") and not isinstance(raw[cond], (int, float)):
        _fail(path, f"{where}: {cond} needs a number")
    return EndpointCheck(raw["path"], raw.get("field"), raw.get("metric"), cond, raw[cond], when,
                         _shared(path, where, raw))


def _shared(path: Path, where: str, raw: dict) -> bool:
    shared = raw.get("shared", False)
    if not isinstance(shared, bool):
        _fail(path, f"{where}: shared must be true or false")
    return shared


def _log_must(path: Path, where: str, value) -> tuple[tuple[str, ...], frozenset]:
    """log_must entries: a regex, or a table { pattern = '...', shared = true } for a line that
    the baseline prints too and that is required on purpose (a readiness line, say)."""
    if value is None:
        return (), frozenset()
    if not isinstance(value, list):
        _fail(path, f"{where} must be a list of regexes or {{ pattern = '...', shared = true }} tables")
    patterns, shared = [], set()
    for i, entry in enumerate(value):
        if isinstance(entry, dict):
            unknown = set(entry) - {"pattern", "shared"}
            if unknown or not isinstance(entry.get("pattern"), str):
                _fail(path, f"{where}[{i}]: a table entry needs 'pattern' (and optionally 'shared')")
            patterns.append(entry["pattern"])
            if _shared(path, f"{where}[{i}]", entry):
                shared.add(entry["pattern"])
        elif isinstance(entry, str):
            patterns.append(entry)
        else:
            _fail(path, f"{where}[{i}] must be a regex or a {{ pattern = '...' }} table")
    return tuple(patterns), frozenset(shared)


def _evidence(path: Path, where: str, raw) -> Evidence:
    if raw is None:
        return Evidence()
    if not isinstance(raw, dict):
        _fail(path, f"{where} must be a table")
    unknown = set(raw) - {"log_must", "log_must_not", "endpoint"}
    if unknown:
        _fail(path, f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    log_must, log_shared = _log_must(path, f"{where}.log_must", raw.get("log_must"))
    log_must_not = _strings(path, f"{where}.log_must_not", raw.get("log_must_not"))
    for pattern in log_must + log_must_not:
        try:
            re.compile(pattern)
        except re.error as e:
            _fail(path, f"{where}: bad regex {pattern!r} ({e})")
    endpoints = raw.get("endpoint", [])
    if not isinstance(endpoints, list):
        _fail(path, f"{where}.endpoint must be an array of tables ([[profile.evidence.endpoint]])")
    checks = tuple(_endpoint(path, f"{where}.endpoint[{i}]", e) for i, e in enumerate(endpoints))
    return Evidence(log_must, log_must_not, checks, log_shared)


def load_profiles(path: Path) -> ProfileFile:
    """Parse and check a profile file; every problem is one line naming the file."""
    path = Path(path)
    if not path.is_file():
        raise MoebenchError(f"{path}: no such profile file")
    data = path.read_bytes()
    try:
        raw = tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise MoebenchError(f"{path}: not valid TOML ({e})") from None
    server = raw.get("server")
    if not isinstance(server, dict):
        _fail(path, "missing the [server] table")
    command = _strings(path, "server.command", server.get("command"))
    if not command:
        _fail(path, "server.command must be a non-empty list (the server's argv)")
    server_env = _env(path, "server.env", server.get("env"))
    entries = raw.get("profile")
    if not isinstance(entries, list) or not entries:
        _fail(path, "no [[profile]] entries")
    profiles, baseline = [], None
    for i, entry in enumerate(entries):
        where = f"profile[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
            _fail(path, f"{where}: needs a 'name'")
        name = entry["name"]
        if not re.fullmatch(r"[A-Za-z0-9_.+-]+", name):
            _fail(path, f"{where}: name {name!r} may hold only letters, digits and _ . + -")
        unknown = set(entry) - {"name", "args", "env", "evidence", "approximate", "baseline", "description"}
        if unknown:
            _fail(path, f"{where} ({name}): unknown key(s) {', '.join(sorted(unknown))}")
        args = _strings(path, f"{where}.args", entry.get("args"))
        env = {**server_env, **_env(path, f"{where}.env", entry.get("env"))}
        evidence = _evidence(path, f"{where}.evidence", entry.get("evidence"))
        profile = Profile(name, command + args, args, env, evidence, bool(entry.get("approximate", False)))
        if entry.get("baseline"):
            if baseline is not None:
                _fail(path, f"two profiles say baseline = true ({baseline.name}, {name})")
            baseline = profile
        profiles.append(profile)
    names = [p.name for p in profiles]
    if len(set(names)) != len(names):
        _fail(path, "duplicate profile names")
    baseline = baseline or profiles[0]
    if baseline.approximate:
        _fail(path, f"the baseline profile {baseline.name!r} cannot be approximate")
    profiles.remove(baseline)
    checked = raw.get("checked", {})
    if not isinstance(checked, dict) or set(checked) - {"engine", "recorded"} or \
            not all(isinstance(v, str) for v in checked.values()):
        _fail(path, "[checked] takes engine = 'name version' and recorded = 'a folder of recorded lines'")
    return ProfileFile(path, str(raw.get("description", "")), server, [baseline] + profiles,
                       hashlib.sha256(data).hexdigest(), dict(checked))
