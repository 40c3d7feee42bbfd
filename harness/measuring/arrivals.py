"""Offered load: when each request of a trial is sent (open loop), or all at once (closed loop).

A `Load` is one point of a run's load sweep (`--request-rate 2,4,8,inf`, `--fluctuate`,
`--arrivals FILE`). Its schedule is a list of send offsets in seconds from the start of the
trial, one per request in the suite's order. It is drawn once from the run seed and the load's
label, so every configuration and every trial of a run is offered the same load.

Inter-arrival gaps are gamma-distributed with shape `burstiness` and mean 1/rate, as vLLM's
`bench serve` draws them: burstiness 1 is a Poisson process, below 1 burstier, above 1 steadier.
A fluctuating load alternates a low and a high rate every `period_s` seconds; its arrivals are
the same unit-rate gamma process mapped through the inverse of the cumulative rate (time
rescaling), so the fluctuation changes when requests come, not how bursty they are.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moebench.errors import MoebenchError

CLOSED = "inf"


@dataclass(frozen=True)
class Load:
    label: str  # how samples, trials and the summary name this load
    rate: float  # mean requests/s; math.inf: closed loop (every request queued at the start)
    burstiness: float = 1.0
    low_high_period: tuple[float, float, float] | None = None  # a fluctuating load: (low, high, seconds per phase)
    trace: tuple[float, ...] | None = None  # send offsets read from a file

    @property
    def closed(self) -> bool:
        return math.isinf(self.rate) and self.trace is None

    def offsets(self, n: int, run_seed: int) -> list[float] | None:
        """Send offsets (seconds from the trial's start, non-decreasing) for n requests; None: closed loop."""
        if self.closed:
            return None
        if self.trace is not None:
            if len(self.trace) < n:
                raise MoebenchError(f"--arrivals: the trace has {len(self.trace)} arrival times for {n} requests")
            return list(self.trace[:n])
        seed = int.from_bytes(hashlib.sha256(f"{run_seed}:{self.label}".encode()).digest()[:8], "little")
        rng = np.random.default_rng(seed)
        # unit-rate gaps: gamma(shape k, scale 1/k) has mean 1 and coefficient of variation 1/sqrt(k)
        k = self.burstiness
        unit = np.cumsum(rng.gamma(k, 1.0 / k, size=n))
        unit -= unit[0]  # the first request at the start: no trial begins idle
        if self.low_high_period is None:
            return (unit / self.rate).tolist()
        return _rescale(unit, *self.low_high_period).tolist()

    def to_dict(self) -> dict:
        d = {"label": self.label, "rate": None if math.isinf(self.rate) else self.rate, "burstiness": self.burstiness}
        if self.low_high_period:
            d["fluctuate"] = dict(zip(("low", "high", "period_s"), self.low_high_period))
        if self.trace is not None:
            d["trace_arrivals"] = len(self.trace)
        return d


def _rescale(unit: np.ndarray, low: float, high: float, period: float) -> np.ndarray:
    """Times t with Lambda(t) = unit, for the rate that is `low` for `period` seconds, then `high`, and so on."""
    per_cycle = (low + high) * period
    cycles = np.floor(unit / per_cycle)
    rest = unit - cycles * per_cycle
    in_low = rest < low * period
    t = np.where(in_low, rest / low, period + (rest - low * period) / high)
    return cycles * 2 * period + t


def parse_rates(text: str, burstiness: float = 1.0) -> list[Load]:
    """`--request-rate`: comma-separated requests/s, `inf` for the closed loop (today's behaviour)."""
    if not math.isfinite(burstiness) or burstiness <= 0:
        raise MoebenchError(f"--burstiness must be > 0 (1: Poisson), got {burstiness}")
    loads = []
    for part in (p.strip() for p in text.split(",")):
        try:
            rate = float(part)
        except ValueError:
            raise MoebenchError(f"--request-rate: {part!r} is not a number of requests/s or 'inf'") from None
        if not rate > 0:
            raise MoebenchError(f"--request-rate: {part!r} must be > 0 requests/s (or 'inf')")
        label = CLOSED if math.isinf(rate) else f"{rate:g}/s"
        if not math.isinf(rate) and burstiness != 1.0:
            label += f" b{burstiness:g}"
        loads.append(Load(label, rate, burstiness))
    labels = [ld.label for ld in loads]
    if len(set(labels)) != len(labels):
        raise MoebenchError(f"--request-rate: a rate is given twice ({text})")
    return loads


def parse_fluctuation(text: str, burstiness: float = 1.0) -> Load:
    """`--fluctuate LOW,HIGH,SECONDS`: LOW requests/s for SECONDS, then HIGH, alternating."""
    try:
        low, high, period = (float(x) for x in text.split(","))
    except ValueError:
        raise MoebenchError(f"--fluctuate: expected LOW,HIGH,SECONDS (e.g. 2,8,10), got {text!r}") from None
    if not (0 < low <= high and period > 0 and math.isfinite(high) and math.isfinite(period)):
        raise MoebenchError(f"--fluctuate: need 0 < LOW <= HIGH and SECONDS > 0, got {text!r}")
    return Load(f"{low:g}-{high:g}/s every {period:g}s", (low + high) / 2, burstiness, (low, high, period))


def read_trace(path: str) -> Load:
    """`--arrivals FILE`: one send time per line (seconds; the first is the trial's start), in order."""
    p = Path(path)
    try:
        lines = [ln.strip() for ln in p.read_text().splitlines()]
    except OSError as e:
        raise MoebenchError(f"--arrivals {path}: cannot read ({e.strerror})") from None
    try:
        times = [float(ln) for ln in lines if ln and not ln.startswith("#")]
    except ValueError:
        raise MoebenchError(f"--arrivals {path}: every line must be a number of seconds") from None
    if not times or any(not math.isfinite(t) for t in times) or any(b < a for a, b in zip(times, times[1:])):
        raise MoebenchError(f"--arrivals {path}: need finite send times in non-decreasing order")
    start = times[0]
    span = times[-1] - start
    rate = (len(times) - 1) / span if span > 0 else math.inf
    return Load(f"trace {p.name}", rate, 1.0, trace=tuple(t - start for t in times))


def loads_from_args(request_rate: str | None, burstiness: float, fluctuate: str | None,
                    arrivals: str | None) -> list[Load] | None:
    """The run's load sweep, in the order trials run it; None: the closed loop without load records."""
    if request_rate is None and fluctuate is None and arrivals is None:
        if burstiness != 1.0:
            raise MoebenchError("--burstiness needs --request-rate or --fluctuate")
        return None
    loads = parse_rates(request_rate, burstiness) if request_rate is not None else []
    if fluctuate is not None:
        loads.append(parse_fluctuation(fluctuate, burstiness))
    if arrivals is not None:
        loads.append(read_trace(arrivals))
    return loads


def send_lags(scheduled: list[float], sent: list[float]) -> np.ndarray:
    """Actual minus scheduled send times, seconds: how late the measuring client itself was."""
    return np.asarray(sent, dtype=float) - np.asarray(scheduled, dtype=float)


SLO_METRICS = {"ttft": "ttft_s", "tpot": "tpot_s", "e2e": "latency_s"}


def parse_slos(specs) -> dict[str, float]:
    """`--slo ttft=0.5 --slo tpot=0.05`: the sample column and its limit in seconds."""
    out = {}
    for spec in specs:
        name, _, value = spec.partition("=")
        column = SLO_METRICS.get(name.strip().lower())
        try:
            limit = float(value)
        except ValueError:
            limit = None
        if column is None or limit is None or not limit > 0 or not math.isfinite(limit):
            raise MoebenchError(f"--slo {spec!r}: expected METRIC=SECONDS with METRIC one of "
                                f"{', '.join(SLO_METRICS)} and SECONDS > 0 (e.g. ttft=0.5)")
        if column in out:
            raise MoebenchError(f"--slo: {name} is given twice")
        out[column] = limit
    return out
