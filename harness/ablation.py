"""The configuration matrix: which switch settings a run measures, and their names.

The three switches are exact optimizations (outputs must not change). Speculative decoding
(`speculative`, an axis `--axes` may add) is exact too (engine/speculative.py: the emitted tokens
are plain decoding's, greedy or sampled): its configs are named `speculative=ngram` or `speculative=mtp` (the baseline's
switches) and `all+speculative=ngram` (every ablated switch on), and held to the identical-output
claim like the switches. The LM head's precision (`lm-head`, another axis) is approximate: its
configs are named `lm-head=int8` (or `kernel+lm-head=int8` stacked on switches), marked approximate,
and held to no identical-output claim, only to the accuracy verdicts. So is the other weights'
precision (`weights`, --weights int8, docs/int8.md): `weights=int8`, `kernel+weights=int8`.
The decode path (`decode-path`) is exact as well: its point `decode-path=native` is the fused kernel
with every layer of a decode step in one native call, compared with `kernel` (the fused kernel on the
run's chained path) as its reference, so it gets a speedup of its own beside the one against the
baseline."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from moebench.engine.config import parse_budget  # noqa: F401 (--expert-budget's one parser; imported from here)
from moebench.errors import MoebenchError

SWITCHES = ("kernel", "scheduler", "prefetch")
SPECULATIVE_AXIS = "speculative"
LM_HEAD_AXIS = "lm-head"
WEIGHTS_AXIS = "weights"
DECODE_PATH_AXIS = "decode-path"
AXES = SWITCHES + (SPECULATIVE_AXIS, LM_HEAD_AXIS, WEIGHTS_AXIS, DECODE_PATH_AXIS)
FULL_HEAD = "f32"
FULL_WEIGHTS = "f32"  # the checkpoint's own precision
LOW_PRECISION_WEIGHTS = ("int8",)  # what the weights axis ablates
LOW_PRECISION_HEADS = ("bf16", "int8", "fp8")  # what the lm-head axis ablates unless --lm-head names one
OFF = {"kernel": "naive", "scheduler": "static", "prefetch": "off"}
ON = {"kernel": "fused", "scheduler": "continuous", "prefetch": "lookahead"}


@dataclass(frozen=True)
class ConfigPoint:
    name: str
    kernel: str
    scheduler: str
    prefetch: str
    quantize: str = "none"  # "int4" etc.: the approximate negative control, never an exact optimization
    # a reference config's own expert budget (the all-resident point of an offloaded run), else the run's
    expert_budget: str | None = None
    speculative: str | None = None  # a point of the speculative axis: its method (None: the run's setting)
    lm_head: str = FULL_HEAD  # the LM head's weight precision: f32 (as loaded), bf16, int8, fp8
    weights: str = FULL_WEIGHTS  # the other streamed weights' precision: f32 (as loaded), int8
    decode_path: str | None = None  # a point of the decode-path axis: its path (None: the run's)
    reference: str | None = None  # the config its own speedup is measured against (besides the baseline)

    @property
    def approximate(self) -> bool:
        return self.quantize != "none" or self.lm_head != FULL_HEAD or self.weights != FULL_WEIGHTS

    def to_dict(self) -> dict:
        d = {"name": self.name, "kernel": self.kernel, "scheduler": self.scheduler, "prefetch": self.prefetch}
        if self.quantize != "none":
            d.update(quantize=self.quantize)
        if self.lm_head != FULL_HEAD:
            d.update(lm_head=self.lm_head)
        if self.weights != FULL_WEIGHTS:
            d.update(weights=self.weights)
        if self.approximate:
            d.update(approximate=True)
        if self.expert_budget is not None:
            d.update(expert_budget=self.expert_budget)
        if self.speculative is not None:
            d.update(speculative=self.speculative)
        if self.decode_path is not None:
            d.update(decode_path=self.decode_path)
        if self.reference is not None:
            d.update(reference=self.reference)
        return d


RESIDENT = "resident"


def resident_reference() -> ConfigPoint:
    """The baseline's switches with every expert resident (budget 1.0): beside an offloaded run's
    baseline (prefetch=off) and `prefetch` (lookahead) it gives the memory offloading saves, the speed
    it costs, and the share of that cost lookahead wins back."""
    return ConfigPoint(RESIDENT, OFF["kernel"], OFF["scheduler"], OFF["prefetch"], expert_budget="1.0")


def negative_control(scheme: str) -> ConfigPoint:
    """The baseline's switches with RTN-quantized experts: answers should change, and be caught."""
    return ConfigPoint(scheme, OFF["kernel"], OFF["scheduler"], OFF["prefetch"], quantize=scheme)


def config_name(kernel: str, scheduler: str, prefetch: str) -> str:
    values = {"kernel": kernel, "scheduler": scheduler, "prefetch": prefetch}
    on = [s for s in SWITCHES if values[s] != OFF[s]]
    if not on:
        return "baseline"
    if len(on) == len(SWITCHES):
        return "all"
    return "+".join(on)


def point(kernel: str, scheduler: str, prefetch: str, lm_head: str = FULL_HEAD,
          weights: str = FULL_WEIGHTS) -> ConfigPoint:
    name = config_name(kernel, scheduler, prefetch)
    for axis, value, full in ((WEIGHTS_AXIS, weights, FULL_WEIGHTS), (LM_HEAD_AXIS, lm_head, FULL_HEAD)):
        if value != full:
            name = f"{axis}={value}" if name == "baseline" else f"{name}+{axis}={value}"
    return ConfigPoint(name, kernel, scheduler, prefetch, lm_head=lm_head, weights=weights)


def parse_axes(text: str | None) -> tuple[tuple[str, ...], frozenset[str]]:
    """`--axes kernel,speculative,lm-head` -> (the switches to ablate, in SWITCHES order; the other axes
    named: speculative, lm-head, weights). None: the three switches, no other axis."""
    if text is None:
        return SWITCHES, frozenset()
    names = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a not in AXES]
    if unknown or not names:
        raise MoebenchError(f"--axes '{text}': choose a comma-separated list of {', '.join(AXES)}")
    return tuple(s for s in SWITCHES if s in names), frozenset(a for a in names if a not in SWITCHES)


def speculative_points(available: tuple[str, ...], method: str) -> list[ConfigPoint]:
    """The speculative axis: the baseline's switches with `method`, and, where switches are ablated
    too, every one of them on with it (what a user would deploy)."""
    base = point(**OFF)
    points = [replace(base, name=f"{SPECULATIVE_AXIS}={method}", speculative=method)]
    if available:
        on = point(**{s: (ON[s] if s in available else OFF[s]) for s in SWITCHES})
        points.append(replace(on, name=f"{on.name}+{SPECULATIVE_AXIS}={method}", speculative=method))
    return points


def decode_path_points(points: list[ConfigPoint]) -> list[ConfigPoint]:
    """The decode-path axis: the fused kernel with a decode step's layers in one native call
    (`decode-path=native`), measured against `kernel`, the fused kernel on the run's path; `kernel`
    joins the run where the switches did not bring it."""
    fused = point(ON["kernel"], OFF["scheduler"], OFF["prefetch"])
    added = [] if any(p.name == fused.name for p in points) else [fused]
    native = replace(fused, name=f"{DECODE_PATH_AXIS}=native", decode_path="native", reference=fused.name)
    return added + [native]


def ablation_matrix(available: tuple[str, ...] = SWITCHES, factorial: bool = False,
                    speculative: str | None = None, lm_heads: tuple[str, ...] = (),
                    weights: tuple[str, ...] = (), decode_paths: bool = False,
                    approximate_stacked: bool = False) -> list[ConfigPoint]:
    """Baseline, each available optimization alone, all of them stacked; or every combination.

    Stacked prefixes (kernel, kernel+scheduler) are added too, so the report can draw the waterfall.
    `speculative` (a method) adds the speculative axis's points (speculative_points). Each precision
    of `lm_heads` then adds the baseline with that LM head and, where switches are ablated too, every
    available switch on with that LM head (what a user would deploy); each precision of `weights`
    likewise. `decode_paths` adds the decode-path axis's points (decode_path_points).
    `approximate_stacked` keeps only the latter (the approximate precision on every available switch),
    where switches are ablated: they are exact, so the pair is still judged against the baseline.
    """
    def build(on: set[str]) -> ConfigPoint:
        return point(**{s: (ON[s] if s in on else OFF[s]) for s in SWITCHES})

    if factorial:
        combos = [set(c) for r in range(len(available) + 1) for c in itertools.combinations(available, r)]
    else:
        combos = [set()] + [{s} for s in available]
        combos += [set(available[:i]) for i in range(2, len(available) + 1)]
    seen, points = set(), []
    for on in combos:
        p = build(on)
        if p.name not in seen:
            seen.add(p.name)
            points.append(p)
    if speculative is not None:
        points += speculative_points(available, speculative)
    if decode_paths:
        points += decode_path_points(points)
    alone = not (approximate_stacked and available)
    for head in lm_heads:
        if alone:
            points.append(point(OFF["kernel"], OFF["scheduler"], OFF["prefetch"], lm_head=head))
        if available:
            points.append(point(**{s: (ON[s] if s in available else OFF[s]) for s in SWITCHES}, lm_head=head))
    for precision in weights:
        if alone:
            points.append(point(OFF["kernel"], OFF["scheduler"], OFF["prefetch"], weights=precision))
        if available:
            points.append(point(**{s: (ON[s] if s in available else OFF[s]) for s in SWITCHES}, weights=precision))
    return points


def runtime_for(base, cfg: ConfigPoint):
    """The RuntimeConfig one point of the matrix runs: the run's settings with its switches."""
    rt = replace(base, kernel=cfg.kernel, scheduler=cfg.scheduler, prefetch=cfg.prefetch,
                 lm_head=getattr(cfg, "lm_head", FULL_HEAD), weights=getattr(cfg, "weights", FULL_WEIGHTS))
    if getattr(cfg, "speculative", None) is not None:  # a point of the speculative axis
        rt = replace(rt, speculative=cfg.speculative)
    if getattr(cfg, "decode_path", None) is not None:  # a point of the decode-path axis
        rt = replace(rt, decode_path=cfg.decode_path)
    if getattr(cfg, "expert_budget", None) is not None:  # a reference config's own budget
        rt = replace(rt, expert_budget=parse_budget(cfg.expert_budget))
    return rt
