"""The gate's policy: thresholds from a TOML file (gate.toml), overridable by command-line flags."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from moebench.errors import MoebenchError

DEFAULT_POLICY_FILE = Path("gate.toml")


@dataclass(frozen=True)
class Policy:
    config: str | None = None        # the config whose speedup is gated; None: "all" or the last stacked
    min_speedup: float = 1.2         # lower 95% bound of the speedup must reach this
    max_accuracy_drop: float = 0.5   # accuracy points a config may lose against the baseline
    min_identical: float = 0.99      # share of outputs identical to the baseline's
    mcnemar_alpha: float = 0.05      # McNemar p below this is a detected accuracy change
    max_slowdown: float = 0.10       # allowed fall of the speedup against a committed baseline
    baseline: str | None = None      # committed summary.json to compare the speedup with
    approximate: tuple[str, ...] = field(default_factory=tuple)  # exempt from the identity rule


_NUMBERS = {"min_speedup", "max_accuracy_drop", "min_identical", "mcnemar_alpha", "max_slowdown"}


def load_policy(path: Path | None) -> Policy:
    """Policy from a TOML file ([gate] table or top level); built-in defaults when path is None
    and ./gate.toml does not exist."""
    if path is None:
        if not DEFAULT_POLICY_FILE.is_file():
            return Policy()
        path = DEFAULT_POLICY_FILE
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MoebenchError(f"{path}: policy file missing") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise MoebenchError(f"{path}: not valid TOML ({e})") from None
    table = data.get("gate", data)
    known = {f.name for f in fields(Policy)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise MoebenchError(f"{path}: unknown policy keys {unknown} (known: {sorted(known)})")
    values = {}
    for key, value in table.items():
        if key in _NUMBERS:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise MoebenchError(f"{path}: {key} must be a number, got {value!r}")
            values[key] = float(value)
        elif key == "approximate":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise MoebenchError(f"{path}: approximate must be a list of config names")
            values[key] = tuple(value)
        else:
            if not isinstance(value, str):
                raise MoebenchError(f"{path}: {key} must be a string, got {value!r}")
            values[key] = value or None  # an empty string means "not set"
    if values.get("baseline"):
        # Relative to the policy file, so the gate works from any working directory.
        values["baseline"] = str(path.parent / values["baseline"])
    return Policy(**values)


def with_overrides(policy: Policy, **flags) -> Policy:
    """The policy with every flag that was given (not None) replacing its value."""
    return replace(policy, **{k: v for k, v in flags.items() if v is not None})
