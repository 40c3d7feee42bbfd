"""The report's plots of a run with offered loads: latency against achieved throughput per config
(the curve serving papers draw), goodput against offered rate, and a fluctuating load's throughput
per window."""

from __future__ import annotations

import math
from pathlib import Path

from moebench.results.canvas import figure, save

CURVES_FILE = "serving_latency.png"
CURVES_CAPTION = ("Latency against achieved throughput, one point per offered load (P50 open, P99 filled); "
                  "goodput under the run's SLOs with 95% CIs over trials")
STABILITY_FILE = "serving_stability.png"
STABILITY_CAPTION = "Output tokens/s per window of the fluctuating load (every trial), per config"


def _by_rate(points: dict) -> list[tuple[str, dict]]:
    """Points in order of offered rate, the closed loop last."""
    return sorted(points.items(), key=lambda kv: math.inf if kv[1]["offered_rps"] is None else kv[1]["offered_rps"])


def latency_curves(summary: dict, path: Path) -> Path | None:
    serving = summary.get("serving")
    if not serving:
        return None
    has_slo = bool(serving.get("slo"))
    fig, axes = figure(15 if has_slo else 10, 4, ncols=3 if has_slo else 2)
    colours = [f"C{i}" for i in range(10)]
    for colour, (name, points) in zip(colours, serving["configs"].items()):
        ordered = _by_rate(points)
        x = [p["achieved_rps"]["median"] for _, p in ordered]
        for ax, col, title in ((axes[0], "ttft_s", "TTFT"), (axes[1], "latency_s", "end-to-end latency")):
            ax.plot(x, [p[col]["p50"] for _, p in ordered], "o--", mfc="none", color=colour, label=f"{name} P50")
            ax.plot(x, [p[col]["p99"] for _, p in ordered], "o-", color=colour, label=f"{name} P99")
            ax.set_title(title)
            ax.set_xlabel("achieved requests/s")
            ax.set_ylabel("seconds")
            ax.set_yscale("log")
        if has_slo:
            offered = [p["offered_rps"] for _, p in ordered if p["offered_rps"] is not None]
            good = [p["goodput_rps"] for _, p in ordered if p["offered_rps"] is not None]
            means = [g["mean"] for g in good]
            errs = [[max(0.0, g["mean"] - g["ci95"][0]) if g.get("ci95") else 0 for g in good],
                    [max(0.0, g["ci95"][1] - g["mean"]) if g.get("ci95") else 0 for g in good]]
            axes[2].errorbar(offered, means, yerr=errs, fmt="o-", color=colour, capsize=3, label=name)
    axes[0].legend(fontsize=7)
    if has_slo:
        top = max((p["offered_rps"] or 0) for pts in serving["configs"].values() for p in pts.values())
        axes[2].plot([0, top], [0, top], ":", color="grey", label="offered")
        slo = ", ".join(f"{k.removesuffix('_s')} <= {v:g} s" for k, v in serving["slo"].items())
        axes[2].set_title(f"goodput ({slo})")
        axes[2].set_xlabel("offered requests/s")
        axes[2].set_ylabel("requests/s meeting every SLO")
        axes[2].legend(fontsize=7)
    return save(fig, path)


def stability(summary: dict, path: Path) -> Path | None:
    serving = summary.get("serving")
    if not serving:
        return None
    series = [(name, label, p["stability"]) for name, points in serving["configs"].items()
              for label, p in points.items() if (p.get("stability") or {}).get("trials")]
    if not series:
        return None
    fig, ax = figure(8, 4)
    for i, (name, label, st) in enumerate(series):
        for k, trial in enumerate(st["trials"]):
            w = st["window_s"]
            ax.plot([w * (j + 0.5) for j in range(len(trial["windows"]))], trial["windows"], "o-", color=f"C{i}",
                    alpha=1.0 if k == 0 else 0.35,
                    label=f"{name} @ {label}: CV {st['median_cv']:.2f}" if k == 0 and st["median_cv"] is not None else None)
    ax.set_xlabel("seconds into the trial")
    ax.set_ylabel("output tokens/s in the window")
    ax.legend(fontsize=7)
    return save(fig, path)
