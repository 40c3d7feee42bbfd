"""The gate's policy: thresholds from a TOML file, overridable by command-line flags.

`Policy`'s field defaults are the one source of the built-in thresholds: the gate's --help quotes
them (`DEFAULTS`), the root gate.toml restates none of them, and .ci/gate.toml names only what CI
sets differently. `load_policy` records where a policy came from (`Policy.source`), and the gate
prints it, so a ./gate.toml picked up from the working directory is never applied silently.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from moebench.errors import MoebenchError

DEFAULT_POLICY_FILE = Path("gate.toml")
BUILT_IN = "built-in defaults"
# The throughput a speedup is computed from (summary.json): whole-run output tok/s, as
# `vllm bench serve` reports it, or decode tok/s (decode steps only, prefill steps left out).
METRICS = ("output", "decode")


ON_INCONCLUSIVE = ("fail", "warn", "pass")


@dataclass(frozen=True)
class Policy:
    config: str | None = None        # the config whose speedup is gated; None: "all" or the last stacked
    metric: str = "output"           # which speedup is gated: "output" (whole run) or "decode"
    min_speedup: float = 1.2         # lower 95% bound of the speedup must reach this
    min_identical: float = 0.99      # share of outputs identical to the baseline's (exact configs)
    max_slowdown: float = 0.05       # allowed fall of the speedup against a committed baseline (docs/gate.md)
    baseline: str | None = None      # committed summary.json to compare the speedup with
    approximate: tuple[str, ...] = field(default_factory=tuple)  # exempt from the identity rule
    margin: float = 1.0              # accuracy points a config may lose: the one accuracy knob
    on_inconclusive: str = "fail"    # a rule the run is too small to judge: fail (exit 3), warn or pass (exit 0)
    # with offered loads (--request-rate): the gated config's P99 TTFT over the baseline's, at every load,
    # may rise by at most this fraction (its 95% CI upper end counts); None: no latency rule
    max_ttft_rise: float | None = None
    source: str = field(default=BUILT_IN, compare=False)  # where the policy came from (not a key)

    def __post_init__(self):
        if self.metric not in METRICS:
            raise MoebenchError(f"policy metric {self.metric!r}: choose from {', '.join(METRICS)}")
        if not 0 < self.margin < 100:
            raise MoebenchError(f"policy margin {self.margin!r}: give accuracy points between 0 and 100")
        if self.max_ttft_rise is not None and not self.max_ttft_rise >= 0:
            raise MoebenchError(f"policy max_ttft_rise {self.max_ttft_rise!r}: give a fraction >= 0 "
                                "(0.1: P99 TTFT at most 10% above the baseline's)")
        if self.on_inconclusive not in ON_INCONCLUSIVE:
            raise MoebenchError(f"policy on_inconclusive {self.on_inconclusive!r}: choose from "
                                f"{', '.join(ON_INCONCLUSIVE)}")


# Keys of older policies, refused with what replaces them: a gate must not keep running on a rule
# that no longer means what its file says.
RETIRED = {
    "max_accuracy_drop": "the accuracy verdict has one knob now, margin (points a config may lose): "
                         "set margin = {value:g} to keep that tolerance",
    "mcnemar_alpha": "trial 0's McNemar test no longer decides the gate (the report still shows it); "
                     "remove the key",
    "require_power": "an inconclusive rule is now decided by on_inconclusive = \"fail\" | \"warn\" | "
                     "\"pass\" (default \"fail\"); write on_inconclusive = \"{replacement}\"",
}


DEFAULTS = Policy()
_KEYS = {f.name for f in fields(Policy)} - {"source"}
_NUMBERS = {"min_speedup", "min_identical", "max_slowdown", "margin", "max_ttft_rise"}


def load_policy(path: Path | None) -> Policy:
    """Policy from a TOML file ([gate] table or top level); the built-in defaults when path is None
    and ./gate.toml does not exist. Keys the file does not set keep their defaults."""
    if path is None:
        if not DEFAULT_POLICY_FILE.is_file():
            return Policy()
        path = DEFAULT_POLICY_FILE
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MoebenchError(f"{path}: policy file missing") from None
    except IsADirectoryError:
        raise MoebenchError(f"{path}: is a directory, not a policy file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise MoebenchError(f"{path}: not valid TOML ({e})") from None
    table = data.get("gate", data)
    for key in sorted(set(table) & set(RETIRED)):
        value = table[key]
        replacement = "fail" if value is True else "warn"
        raise MoebenchError(f"{path}: policy key {key} is retired: " + RETIRED[key].format(
            value=value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0,
            replacement=replacement))
    unknown = sorted(set(table) - _KEYS)
    if unknown:
        raise MoebenchError(f"{path}: unknown policy keys {unknown} (known: {sorted(_KEYS)})")
    values = {}
    for key, value in table.items():
        if key in _NUMBERS:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise MoebenchError(f"{path}: {key} must be a number, got {value!r}")
            values[key] = float(value)
        elif key == "on_inconclusive":
            if value not in ON_INCONCLUSIVE:
                raise MoebenchError(f"{path}: on_inconclusive must be one of {', '.join(ON_INCONCLUSIVE)}, "
                                    f"got {value!r}")
            values[key] = value
        elif key == "approximate":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise MoebenchError(f"{path}: approximate must be a list of config names")
            values[key] = tuple(value)
        else:
            if not isinstance(value, str):
                raise MoebenchError(f"{path}: {key} must be a string, got {value!r}")
            values[key] = value or None  # an empty string means "not set"
    if values.get("metric") is None:
        values.pop("metric", None)
    if values.get("baseline"):
        # Relative to the policy file, so the gate works from any working directory.
        values["baseline"] = str(path.parent / values["baseline"])
    return Policy(**values, source=str(path))


def with_overrides(policy: Policy, **flags) -> Policy:
    """The policy with every flag that was given (not None) replacing its value; the source then
    says that flags changed it."""
    given = {k: v for k, v in flags.items() if v is not None}
    if not given:
        return policy
    return replace(policy, **given, source=f"{policy.source} + flags {', '.join('--' + k.replace('_', '-') for k in given)}")
