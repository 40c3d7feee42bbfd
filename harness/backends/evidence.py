"""A profile's evidence judged against what a server showed: its log text and the bodies its
endpoints answered. Pure functions over an `Observation`, so that the same judgement runs on a
live server (moebench.backends.server), on the baseline's observation when a configuration's
evidence is checked for discrimination, and on recorded lines (`moebench profiles check`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from moebench.backends.log_readers import READERS, log_number
from moebench.backends.profiles import EndpointCheck, Evidence, LogValue


@dataclass
class Observation:
    """What one server showed. `payloads[when][path]` is the body it answered at that moment
    ("start": healthy; "end": after the work), or None where it gave no 200 answer."""

    log: str
    payloads: dict = field(default_factory=lambda: {"start": {}, "end": {}})
    source: str = ""  # where it came from, for messages (a log path, a recorded folder)
    unanswered: dict = field(default_factory=dict)  # (when, path) -> why there is no body
    not_exercised: list = field(default_factory=list)  # items the workload gave no chance (at the end)

    def body(self, when: str, path: str):
        return self.payloads.get(when, {}).get(path)

    def why_none(self, when: str, path: str) -> str:
        return self.unanswered.get((when, path), "no answer")


@dataclass(frozen=True)
class MustItem:
    """One piece of must-match evidence: a log regex, a number read from the log, or an endpoint
    check; `kind` says whether it shows the optimization ran ("runtime") or only that the server
    repeats its arguments ("echo")."""

    label: str
    shared: bool
    pattern: str | None = None
    check: EndpointCheck | None = None
    value: LogValue | None = None
    kind: str = "echo"
    proves: str | None = None  # the optimization it proves, where the profile names it


def must_items(evidence: Evidence) -> list[MustItem]:
    proves = dict(evidence.log_proves)
    items = [MustItem(f"log ~ {p!r}", p in evidence.log_shared, pattern=p,
                      kind="runtime" if p in evidence.log_runtime else "echo", proves=proves.get(p))
             for p in evidence.log_must]
    items += [MustItem(v.label, v.shared, value=v, kind=v.kind, proves=v.proves) for v in evidence.log_values]
    items += [MustItem(f"{c.label} ({c.when})", c.shared, check=c, kind=c.kind, proves=c.proves)
              for c in evidence.endpoints]
    return items


def log_match(pattern: str, log: str) -> str | None:
    match = re.search(pattern, log, re.MULTILINE)
    return match.group(0).strip()[:200] if match else None


def read_check(check: EndpointCheck, obs: Observation) -> tuple[object, str | None]:
    """The value a check reads from an endpoint's body (JSON text or object, or Prometheus
    text), and the problem where there is none."""
    body = obs.body(check.when, check.path)
    if body is None:
        return None, f"{check.path}: {obs.why_none(check.when, check.path)}"
    if check.metric is not None:
        text = body if isinstance(body, str) else json.dumps(body)
        value = prometheus_value(text, check.metric)
        return value, None if value is not None else f"{check.path}: no sample {check.metric!r}"
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except json.JSONDecodeError:
            return None, f"{check.path}: not JSON"
    try:
        return json_field(body, check.field), None
    except (KeyError, IndexError, TypeError, ValueError):
        return None, f"{check.path}: no field {check.field!r}"


def check_failure(check: EndpointCheck, obs: Observation) -> tuple[object, str | None]:
    """(the value read, why the check fails or None where it holds)."""
    value, problem = read_check(check, obs)
    if problem:
        return value, problem
    if not holds(check, value):
        return value, (f"{check.path}: {check.field or check.metric} is {value!r}, expected "
                       f"{check.condition} {check.expected!r}")
    return value, None


def read_log_value(value: LogValue, log: str) -> float | None:
    if value.reader is not None:
        return READERS[value.reader](log)
    return log_number(value.pattern, log)


def log_value_failure(value: LogValue, obs: Observation) -> tuple[object, str | None]:
    """(the number read, why the item fails or None). A reader that saw no chance for the
    optimization to show itself fails it too: judged against another configuration, "not
    exercised" never counts as holding; `idle_log_values` says which of a configuration's own
    items that was, so it is reported as not exercised instead of failed."""
    number = read_log_value(value, obs.log)
    if number is None:
        what = value.pattern if value.reader is None else f"reader {value.reader}"
        return None, (f"server log has no number for {value.pattern!r}" if value.reader is None
                      else f"{value.label}: not exercised (the workload gave {what} nothing to read)")
    check = EndpointCheck("log", None, value.reader or value.pattern, value.condition, value.expected)
    if not holds(check, number):
        return number, f"{value.label}: read {number:g}"
    return number, None


def idle_log_values(evidence: Evidence, obs: Observation) -> list[str]:
    """The configuration's reader items that its workload gave no chance: continuous batching
    with every request arriving together, say. Not failures, and never proof."""
    return [f"{v.label}: not exercised" for v in evidence.log_values
            if v.reader is not None and read_log_value(v, obs.log) is None]


def item_holds(item: MustItem, obs: Observation) -> tuple[bool, object]:
    """Whether one must-match item holds for an observation, and what it saw there."""
    if item.pattern is not None:
        seen = log_match(item.pattern, obs.log)
        return seen is not None, seen
    if item.value is not None:
        number, problem = log_value_failure(item.value, obs)
        return problem is None, number
    value, problem = check_failure(item.check, obs)
    return problem is None, value if problem is None else problem


def evaluate(evidence: Evidence, when: str, obs: Observation) -> tuple[dict, list[str]]:
    """The evidence of one moment: at "start" the endpoint checks marked start; at "end" every
    log regex (the log is whole only once the work is done) and the checks marked end."""
    seen: dict = {}
    errors: list[str] = []
    where = f" ({obs.source})" if obs.source else ""
    if when == "end":
        for pattern in evidence.log_must:
            seen[f"log ~ {pattern}"] = log_match(pattern, obs.log)
            if seen[f"log ~ {pattern}"] is None:
                errors.append(f"server log has no match for {pattern!r}{where}")
        for pattern in evidence.log_must_not:
            match = log_match(pattern, obs.log)
            seen[f"log !~ {pattern}"] = match
            if match is not None:
                errors.append(f"server log matches the forbidden {pattern!r}: {match[:120]!r}")
        idle = idle_log_values(evidence, obs)
        obs.not_exercised = idle
        for value in evidence.log_values:
            seen[value.label], problem = log_value_failure(value, obs)
            if problem and f"{value.label}: not exercised" not in idle:
                errors.append(problem + where)
            elif problem:
                seen[value.label] = "not exercised"
    for check in evidence.endpoints:
        if check.when != when:
            continue
        value, problem = check_failure(check, obs)
        seen[check.label] = value
        if problem:
            errors.append(problem)
    return seen, errors


def json_field(body, dotted: str):
    value = body
    for part in dotted.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value


def prometheus_value(text: str, name: str) -> float | None:
    """The sum of the samples named `name` (any labels) in Prometheus text format."""
    total, found = 0.0, False
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)", re.MULTILINE)
    for match in pattern.finditer(text):
        try:
            total += float(match.group(1))
            found = True
        except ValueError:
            pass
    return total if found else None


def holds(check: EndpointCheck, value) -> bool:
    if check.condition == "equals":
        return value == check.expected or str(value) == str(check.expected)
    if check.condition == "matches":
        return value is not None and re.search(str(check.expected), str(value)) is not None
    try:
        if check.condition == "above":
            return float(value) > float(check.expected)
        return float(value) >= float(check.expected)
    except (TypeError, ValueError):
        return False
