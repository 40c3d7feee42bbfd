"""Server profiles: one server program and named configurations of it, as data (TOML).

A configuration counts only with evidence seen from the server itself: regexes over its own log
and fields read from its own endpoints. The format is documented in docs/engines.md.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from moebench.errors import MoebenchError

CONDITIONS = ("equals", "matches", "at_least", "above")
WHEN = ("start", "end")
# Two classes of evidence. "runtime": a counter, a log line or a value that changes only when the
# optimization ran (drafts accepted, a KV cache allocated in the narrower dtype, a prompt decoded
# beside running sequences). "echo": the server repeating the arguments it was given (a resolved
# config dump, /server_info). An echo shows that a flag parsed, never that anything ran, so it is
# the default: an item is runtime only where the profile says so.
KINDS = ("runtime", "echo")


@dataclass(frozen=True)
class EndpointCheck:
    path: str
    field: str | None  # dotted path into a JSON body
    metric: str | None  # a sample name in Prometheus text format
    condition: str  # one of CONDITIONS
    expected: object
    when: str = "start"
    shared: bool = False  # holds for the baseline too, on purpose (not counted as proof)
    kind: str = "echo"
    proves: str | None = None  # the one optimization it proves, where the profile says

    @property
    def label(self) -> str:
        what = self.field if self.field is not None else self.metric
        return f"{self.path} {what} {self.condition} {self.expected!r}"


@dataclass(frozen=True)
class LogValue:
    """A number read from the server's whole log at the end: the largest capture of `pattern`'s
    first group (thousands separators dropped), or what a named reader of
    moebench.backends.log_readers computes (a count of events no single line shows)."""

    pattern: str | None
    reader: str | None
    condition: str  # equals, at_least or above
    expected: float
    kind: str = "echo"
    shared: bool = False
    proves: str | None = None

    @property
    def label(self) -> str:
        what = f"~ {self.pattern!r}" if self.pattern is not None else f"reader {self.reader}"
        return f"log {what} {self.condition} {self.expected!r}"


@dataclass(frozen=True)
class Evidence:
    log_must: tuple[str, ...] = ()
    log_must_not: tuple[str, ...] = ()
    endpoints: tuple[EndpointCheck, ...] = ()
    log_shared: frozenset = frozenset()  # log_must patterns marked shared = true
    log_runtime: frozenset = frozenset()  # log_must patterns marked kind = "runtime"
    log_values: tuple[LogValue, ...] = ()
    log_proves: tuple = ()  # (pattern, optimization) for log_must tables that say proves = "..."

    @property
    def empty(self) -> bool:
        return not (self.log_must or self.log_must_not or self.endpoints or self.log_values)


@dataclass(frozen=True)
class Profile:
    """One named configuration of the server: what a switch is to the bundled runtime."""

    name: str
    command: tuple[str, ...]  # the server's command with this configuration's arguments
    args: tuple[str, ...] = ()  # this configuration's own arguments (what sets it apart)
    env: dict = field(default_factory=dict, hash=False)
    evidence: Evidence = Evidence()
    approximate: bool = False
    # the optimizations this configuration switches on (none for the baseline): its evidence must
    # prove each against every configuration of the file that lacks it
    enables: tuple[str, ...] = ()
    echo_only: str | None = None  # why echo is all the server can show, where the profile says so

    def to_dict(self) -> dict:
        d = {"name": self.name, "engine": "openai", "command": list(self.command), "args": list(self.args),
             "env": dict(self.env), "kernel": None, "scheduler": None, "prefetch": None,
             "evidence": {"log_must": list(self.evidence.log_must),
                          "log_must_not": list(self.evidence.log_must_not),
                          "endpoints": [c.label for c in self.evidence.endpoints],
                          "shared": sorted(self.evidence.log_shared) + [c.label for c in self.evidence.endpoints
                                                                        if c.shared]}}
        if self.evidence.log_values:
            d["evidence"]["log_values"] = [v.label for v in self.evidence.log_values]
        d["enables"] = list(self.enables)
        if self.approximate:
            d["approximate"] = True
        if self.echo_only:
            d["echo_only"] = self.echo_only
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
    unknown = set(raw) - {"path", "field", "metric", "when", "shared", "kind", "proves", *CONDITIONS}
    if unknown:
        _fail(path, f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    if cond in ("at_least", "above") and not isinstance(raw[cond], (int, float)):
        _fail(path, f"{where}: {cond} needs a number")
    return EndpointCheck(raw["path"], raw.get("field"), raw.get("metric"), cond, raw[cond], when,
                         _shared(path, where, raw), _kind(path, where, raw), _proves(path, where, raw))


def _proves(path: Path, where: str, raw: dict) -> str | None:
    """Where one item could seem to prove several optimizations of a stacked configuration (a
    configuration's warm-up gave it no chance), the profile names the one it proves."""
    proves = raw.get("proves")
    if proves is not None and (not isinstance(proves, str) or not proves):
        _fail(path, f"{where}: proves must name one optimization")
    return proves


def _kind(path: Path, where: str, raw: dict) -> str:
    kind = raw.get("kind", "echo")
    if kind not in KINDS:
        _fail(path, f"{where}: kind must be one of {', '.join(map(repr, KINDS))}")
    return kind


def _log_value(path: Path, where: str, raw) -> LogValue:
    from moebench.backends.log_readers import READERS

    if not isinstance(raw, dict) or ("pattern" in raw) == ("reader" in raw):
        _fail(path, f"{where}: give exactly one of 'pattern' (a regex with one group) or 'reader'")
    unknown = set(raw) - {"pattern", "reader", "kind", "shared", "proves", "equals", "at_least", "above"}
    if unknown:
        _fail(path, f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    conditions = [c for c in ("equals", "at_least", "above") if c in raw]
    if len(conditions) != 1 or not isinstance(raw[conditions[0]], (int, float)):
        _fail(path, f"{where}: give exactly one of equals, at_least, above, with a number")
    pattern, reader = raw.get("pattern"), raw.get("reader")
    if pattern is not None:
        try:
            groups = re.compile(pattern).groups
        except (re.error, TypeError) as e:
            _fail(path, f"{where}: bad regex {pattern!r} ({e})")
        if groups < 1:
            _fail(path, f"{where}: the pattern needs a group around the number it reads")
    elif reader not in READERS:
        _fail(path, f"{where}: no log reader {reader!r} (known: {', '.join(sorted(READERS))})")
    return LogValue(pattern, reader, conditions[0], raw[conditions[0]], _kind(path, where, raw),
                    _shared(path, where, raw), _proves(path, where, raw))


def _shared(path: Path, where: str, raw: dict) -> bool:
    shared = raw.get("shared", False)
    if not isinstance(shared, bool):
        _fail(path, f"{where}: shared must be true or false")
    return shared


def _log_must(path: Path, where: str, value) -> tuple[tuple[str, ...], frozenset, frozenset, tuple]:
    """log_must entries: a regex (echo), or a table { pattern = '...', kind = "runtime" } for a line
    logged only when the optimization ran, or { pattern = '...', shared = true } for a line that
    the baseline prints too and that is required on purpose (a readiness line, say)."""
    if value is None:
        return (), frozenset(), frozenset(), ()
    if not isinstance(value, list):
        _fail(path, f"{where} must be a list of regexes or {{ pattern = '...', shared = true }} tables")
    patterns, shared, runtime, proves = [], set(), set(), []
    for i, entry in enumerate(value):
        if isinstance(entry, dict):
            unknown = set(entry) - {"pattern", "shared", "kind", "proves"}
            if unknown or not isinstance(entry.get("pattern"), str):
                _fail(path, f"{where}[{i}]: a table entry needs 'pattern' (and optionally 'shared', 'kind', 'proves')")
            if (optimization := _proves(path, f"{where}[{i}]", entry)) is not None:
                proves.append((entry["pattern"], optimization))
            patterns.append(entry["pattern"])
            if _shared(path, f"{where}[{i}]", entry):
                shared.add(entry["pattern"])
            if _kind(path, f"{where}[{i}]", entry) == "runtime":
                runtime.add(entry["pattern"])
        elif isinstance(entry, str):
            patterns.append(entry)
        else:
            _fail(path, f"{where}[{i}] must be a regex or a {{ pattern = '...' }} table")
    return tuple(patterns), frozenset(shared), frozenset(runtime), tuple(proves)


def _evidence(path: Path, where: str, raw) -> Evidence:
    if raw is None:
        return Evidence()
    if not isinstance(raw, dict):
        _fail(path, f"{where} must be a table")
    unknown = set(raw) - {"log_must", "log_must_not", "endpoint", "log_value"}
    if unknown:
        _fail(path, f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    log_must, log_shared, log_runtime, log_proves = _log_must(path, f"{where}.log_must", raw.get("log_must"))
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
    values = raw.get("log_value", [])
    if not isinstance(values, list):
        _fail(path, f"{where}.log_value must be an array of tables ([[profile.evidence.log_value]])")
    log_values = tuple(_log_value(path, f"{where}.log_value[{i}]", v) for i, v in enumerate(values))
    return Evidence(log_must, log_must_not, checks, log_shared, log_runtime, log_values, log_proves)


def _enables(path: Path, where: str, entry: dict, baseline: bool) -> tuple[str, ...]:
    """What a configuration switches on; by default its name split at "+" (a stacked step,
    "cuda-graphs+prefix-cache", switches on both)."""
    raw = entry.get("enables")
    if raw is None:
        return () if baseline else tuple(entry["name"].split("+"))
    names = _strings(path, f"{where}.enables", raw)
    if baseline and names:
        _fail(path, f"{where}: the baseline enables nothing (it is what every optimization is judged against)")
    if not baseline and (not names or not all(names)):
        _fail(path, f"{where}: enables must name at least one optimization")
    return names


def _echo_only(path: Path, where: str, entry: dict, baseline: bool) -> str | None:
    flag, reason = entry.get("echo_only", False), entry.get("echo_only_reason")
    if not isinstance(flag, bool):
        _fail(path, f"{where}: echo_only must be true or false")
    if reason is not None and not flag:
        _fail(path, f"{where}: echo_only_reason without echo_only = true")
    if not flag:
        return None
    if baseline:
        _fail(path, f"{where}: the baseline proves nothing of its own, so it cannot be echo_only")
    if not isinstance(reason, str) or not reason.strip():
        _fail(path, f"{where}: echo_only = true needs echo_only_reason = '...' (why the server shows "
                    f"nothing but its own arguments), which the report prints beside the configuration")
    return reason.strip()


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
    profiles, raw_profiles, baseline = [], [], None
    for i, entry in enumerate(entries):
        where = f"profile[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
            _fail(path, f"{where}: needs a 'name'")
        name = entry["name"]
        if not re.fullmatch(r"[A-Za-z0-9_.+-]+", name):
            _fail(path, f"{where}: name {name!r} may hold only letters, digits and _ . + -")
        unknown = set(entry) - {"name", "args", "env", "evidence", "approximate", "baseline", "description",
                                "enables", "echo_only", "echo_only_reason"}
        if unknown:
            _fail(path, f"{where} ({name}): unknown key(s) {', '.join(sorted(unknown))}")
        args = _strings(path, f"{where}.args", entry.get("args"))
        env = {**server_env, **_env(path, f"{where}.env", entry.get("env"))}
        evidence = _evidence(path, f"{where}.evidence", entry.get("evidence"))
        raw_profiles.append((i, entry, Profile(name, command + args, args, env, evidence,
                                               bool(entry.get("approximate", False)))))
        if entry.get("baseline"):
            if baseline is not None:
                _fail(path, f"two profiles say baseline = true ({baseline}, {name})")
            baseline = name
    baseline = baseline or raw_profiles[0][2].name
    for i, entry, profile in raw_profiles:
        is_base = profile.name == baseline
        where = f"profile[{i}] ({profile.name})"
        profiles.append(replace(profile, enables=_enables(path, where, entry, is_base),
                                echo_only=_echo_only(path, where, entry, is_base)))
        named = [o for _, o in profile.evidence.log_proves] + \
                [c.proves for c in (*profile.evidence.endpoints, *profile.evidence.log_values) if c.proves]
        if unknown := [o for o in named if o not in profiles[-1].enables]:
            _fail(path, f"{where}: proves {unknown[0]!r}, which it does not enable ({', '.join(profiles[-1].enables) or 'nothing'})")
    names = [p.name for p in profiles]
    if len(set(names)) != len(names):
        _fail(path, "duplicate profile names")
    baseline = next(p for p in profiles if p.name == baseline)
    if baseline.approximate:
        _fail(path, f"the baseline profile {baseline.name!r} cannot be approximate")
    profiles.remove(baseline)
    checked = raw.get("checked", {})
    if not isinstance(checked, dict) or set(checked) - {"engine", "recorded"} or \
            not all(isinstance(v, str) for v in checked.values()):
        _fail(path, "[checked] takes engine = 'name version' and recorded = 'a folder of recorded lines'")
    return ProfileFile(path, str(raw.get("description", "")), server, [baseline] + profiles,
                       hashlib.sha256(data).hexdigest(), dict(checked))
