"""The two plots a reviewer reads first: per config, the paired accuracy difference and the paired
speedup against the baseline, each with the interval the verdict and the gate decide on and the
lines they decide against (0 and -margin; 1x and the gate's threshold). Per-config bars of
absolute values show trial drift that pairing cancels; these show the estimator that decides."""

from __future__ import annotations

from pathlib import Path

from moebench.results.canvas import figure as _figure
from moebench.results.canvas import save as _save

ACCURACY_FILE, SPEEDUP_FILE = "accuracy_forest.png", "speedup_forest.png"
ACCURACY_CAPTION = "Paired accuracy difference vs the baseline (95% CI, clustered by item) and the verdict"
SPEEDUP_CAPTION = "Paired decode speedup vs the baseline (95% CI over per-trial ratios) and the gate's threshold"
VERDICT_COLOURS = {"identical": "#4C72B0", "non-inferior": "#55A868", "regression": "#C44E52",
                   "inconclusive": "#DD8452"}


def _rows(summary: dict, pick) -> list[tuple[str, float, list[float], str]]:
    rows = []
    for c in summary["configs"]:
        vb = c.get("vs_baseline")
        if not vb:
            continue
        got = pick(c, vb)
        if got is not None and got[0] is not None and got[1]:
            rows.append((c["name"], *got))
    return rows


def _forest(rows, path: Path, xlabel: str, title: str, lines: list[tuple[float, str, str]]) -> Path:
    fig, ax = _figure(7.0, 1.7 + 0.5 * len(rows))
    for y, (name, centre, ci, label) in enumerate(reversed(rows)):
        colour = VERDICT_COLOURS.get(label.split(",")[0], "#333333")
        ax.errorbar(centre, y, xerr=[[centre - ci[0]], [ci[1] - centre]], fmt="o", color=colour, capsize=4)
        ax.annotate(label, (ci[1], y), xytext=(6, 0), textcoords="offset points", va="center", fontsize=8)
    for x, style, text in lines:
        ax.axvline(x, color="#555555", linestyle=style, linewidth=1, label=text)
    ax.set_yticks(range(len(rows)), [name for name, *_ in reversed(rows)])
    ax.set_ylim(-0.7, len(rows) - 0.3)
    left, right = ax.get_xlim()
    ax.set_xlim(left, right + 0.35 * (right - left))  # room for the labels
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=len(lines), fontsize=7, frameon=False)
    return _save(fig, path)


def accuracy_forest(summary: dict, path: Path) -> Path | None:
    def pick(c, vb):
        diff, v = vb.get("accuracy_difference") or {}, vb.get("accuracy_verdict") or {}
        return diff.get("points"), diff.get("ci95"), v.get("verdict") or "n/a"
    rows = _rows(summary, pick)
    if not rows:
        return None
    margins = {(c.get("vs_baseline") or {}).get("accuracy_verdict", {}).get("margin") for c in summary["configs"]}
    margin = next((m for m in margins if m), None)
    lines = [(0.0, "-", "no change")] + ([(-margin, "--", f"-margin ({margin:g} pt)")] if margin else [])
    return _forest(rows, path, "accuracy difference, points (config - baseline)",
                   "Accuracy against the baseline: the verdict's interval", lines)


def speedup_forest(summary: dict, path: Path, threshold: float) -> Path | None:
    def pick(c, vb):
        sp = vb.get("speedup") or {}
        med, ci = sp.get("median"), sp.get("ci95")
        return med, ci, (f"{med:.2f}x [{ci[0]:.2f}, {ci[1]:.2f}]" if med is not None and ci else "")
    rows = _rows(summary, pick)
    if not rows:
        return None
    lines = [(1.0, "-", "no change (1x)"), (threshold, "--", f"gate threshold ({threshold:g}x, default policy)")]
    return _forest(rows, path, "decode speedup (per-trial paired ratios, geometric mean)",
                   "Speed against the baseline: the gate's interval", lines)
