"""PNG plots for the report, drawn with matplotlib's Agg canvas (no display needed).

Each function takes the summary (and, where it needs them, samples or steps), writes one PNG
and returns its path, or None when the run has no data for it (e.g. no steps.parquet).
Figures are built with the object API instead of pyplot so nothing global is touched.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from moebench.results.canvas import figure as _figure
from moebench.results.canvas import save as _save

# Stacking order of the waterfall: (label, config) pairs, each adding one optimization.
STACK = (("baseline", None), ("+kernel", "kernel"), ("+scheduler", "kernel+scheduler"),
         ("+prefetch", "all"))


def _names(summary: dict) -> list[str]:
    return [c["name"] for c in summary["configs"]]


def merge_identical(series: dict[str, np.ndarray]) -> list[tuple[list[str], np.ndarray]]:
    """Configs whose curves are identical, grouped: drawn as one line with all their names, since
    identical lines would hide one another and leave legend entries with nothing visible."""
    groups: list[tuple[list[str], np.ndarray]] = []
    for name, values in series.items():
        values = np.asarray(values, dtype=float)
        for names, ref in groups:
            if ref.shape == values.shape and np.array_equal(ref, values, equal_nan=True):
                names.append(name)
                break
        else:
            groups.append(([name], values))
    return groups


def _group_label(names: list[str]) -> str:
    return names[0] if len(names) == 1 else " = ".join(names) + " (identical)"


def _bar_with_ci(ax, labels: list[str], values: list[float | None], cis: list[list[float] | None],
                 color: str) -> None:
    x = np.arange(len(labels))
    vals = np.array([np.nan if v is None else v for v in values], dtype=float)
    err = np.zeros((2, len(labels)))
    for i, (v, ci) in enumerate(zip(vals, cis)):
        if ci is not None and np.isfinite(v):
            err[:, i] = [max(v - ci[0], 0), max(ci[1] - v, 0)]
    ax.bar(x, np.nan_to_num(vals), yerr=err, capsize=4, color=color, edgecolor="black", linewidth=0.5)
    ax.set_xticks(x, labels, rotation=20, ha="right")


def decode_throughput(summary: dict, path: Path) -> Path | None:
    blocks = [c["decode_tokens_per_s"] for c in summary["configs"]]
    if all(b["median"] is None for b in blocks):
        return None
    fig, ax = _figure()
    _bar_with_ci(ax, _names(summary), [b["median"] for b in blocks], [b["ci95"] for b in blocks], "#4C72B0")
    ax.set_ylabel("decode tokens/s (median, 95% CI)")
    ax.set_title("Decode throughput per configuration")
    return _save(fig, path)


def stacking_chain(summary: dict) -> list[tuple[str, dict]]:
    """(label, config) steps for the waterfall: the stacked configs, else every config."""
    by_name = {c["name"]: c for c in summary["configs"]}
    base = by_name[summary["baseline"]]
    chain = [(label, by_name[name]) for label, name in STACK[1:] if name in by_name]
    if chain:
        return [("baseline", base), *chain]
    return [(c["name"], c) for c in summary["configs"]]


def waterfall(summary: dict, path: Path) -> Path | None:
    """Each stacked config's bar is the baseline's median tok/s times that config's paired speedup
    (the estimator the tables, verdict and gate use), labelled with it and its interval."""
    steps = stacking_chain(summary)
    base = steps[0][1]["decode_tokens_per_s"]["median"]
    chain = [(steps[0][0], base, None)]
    for label, c in steps[1:]:
        sp = (c.get("vs_baseline") or {}).get("speedup") or {}
        if sp.get("median") is not None:
            chain.append((label, base * sp["median"], sp))
    if base is None or len(chain) < 2:
        return None
    fig, ax = _figure()
    prev = 0.0
    for i, (label, v, sp) in enumerate(chain):
        if sp is None:
            ax.bar(i, v, color="#8C8C8C", edgecolor="black", linewidth=0.5)
            ax.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
        else:
            gain = v - prev
            ax.bar(i, gain, bottom=prev, color="#55A868" if gain >= 0 else "#C44E52",
                   edgecolor="black", linewidth=0.5)
            ci = sp.get("ci95")
            span = f"\n[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
            ax.text(i, max(v, prev), f"{sp['median']:.2f}x{span}", ha="center", va="bottom", fontsize=8)
        prev = v
    ax.set_xticks(range(len(chain)), [label for label, *_ in chain])
    ax.set_ylim(0, 1.2 * max(v for _, v, _ in chain))  # room for the value labels under the title
    ax.set_ylabel("decode tok/s: baseline median x paired speedup")
    ax.set_title("Stacking the optimizations (paired speedups, 95% CI)")
    return _save(fig, path)


def accuracy(summary: dict, path: Path) -> Path | None:
    acc = [c["accuracy"] for c in summary["configs"]]
    if all(a["value"] is None for a in acc):
        return None
    fig, ax = _figure()
    _bar_with_ci(ax, _names(summary), [None if a["value"] is None else 100 * a["value"] for a in acc],
                 [None if a["ci95"] is None else [100 * v for v in a["ci95"]] for a in acc], "#DD8452")
    lows = [100 * a["ci95"][0] for a in acc if a["ci95"]]
    if lows:
        ax.set_ylim(max(0.0, min(lows) - 5), 100)  # the interesting range, not 0-100
    ax.set_ylabel("accuracy % (Wilson 95% CI)")
    ax.set_title("Accuracy per configuration")
    return _save(fig, path)


def latency_cdfs(summary: dict, samples: pd.DataFrame, path: Path) -> Path | None:
    cols = [c for c in ("ttft_s", "tpot_s") if c in samples]
    if not cols:
        return None
    fig, axes = _figure(10, 4, ncols=2)
    drawn = False
    for ax, col, title in zip(axes, ("ttft_s", "tpot_s"), ("TTFT", "TPOT")):
        for name in _names(summary):
            if col not in samples:
                continue
            x = np.sort(pd.to_numeric(samples.loc[samples["config"] == name, col], errors="coerce").dropna())
            if x.size:
                ax.step(x, np.arange(1, x.size + 1) / x.size, where="post", label=name)
                drawn = True
        ax.set_xlabel(f"{title} (s)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"{title} CDF")
        ax.grid(alpha=0.3)
    if not drawn:
        return None
    axes[0].legend(fontsize=8)
    return _save(fig, path)


def output_lengths(summary: dict, samples: pd.DataFrame, path: Path) -> Path | None:
    if "output_tokens" not in samples:
        return None
    first = samples.sort_values("trial").drop_duplicates(["config", "item_id"])
    lengths = {n: pd.to_numeric(first.loc[first["config"] == n, "output_tokens"], errors="coerce").dropna()
               for n in _names(summary)}
    lengths = {n: v for n, v in lengths.items() if len(v)}
    if not lengths:
        return None
    fig, ax = _figure()
    allv = np.concatenate([v.to_numpy() for v in lengths.values()])
    bins = np.histogram_bin_edges(allv, bins=min(40, max(5, len(np.unique(allv)))))
    counts = {n: np.histogram(v, bins=bins)[0] for n, v in lengths.items()}
    for names, hist in merge_identical(counts):
        ax.stairs(hist, bins, linewidth=1.5, label=_group_label(names))
    ax.set_xlabel("output tokens per answer")
    ax.set_ylabel("answers")
    ax.set_title("Output length")
    ax.legend(fontsize=8)
    return _save(fig, path)


def expert_load(summary: dict, path: Path) -> Path | None:
    """Tokens routed to each expert in each layer (trial 0); routing is config-independent."""
    entry = next((c for c in summary["configs"] if c["name"] == summary["baseline"] and c["expert_load"]),
                 next((c for c in summary["configs"] if c["expert_load"]), None))
    if entry is None:
        return None
    load = np.asarray(entry["expert_load"], dtype=float)
    if load.ndim != 2 or load.size == 0:
        return None
    fig, ax = _figure(max(6.0, min(14.0, load.shape[1] / 8)), max(3.0, min(8.0, load.shape[0] / 3)))
    im = ax.imshow(load, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(im, ax=ax, label="tokens")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(f"Expert load ({entry['name']}, trial 0)")
    return _save(fig, path)


def distinct_experts(summary: dict, steps: pd.DataFrame | None, path: Path) -> Path | None:
    if steps is None or "distinct_experts" not in steps:
        return None
    series = {}
    for name in _names(summary):
        s = steps[(steps["config"] == name) & (steps["trial"] == steps["trial"].min())]
        if "phase" in s:
            s = s[s["phase"] != "prefill"]
        if not s.empty:
            series[name] = pd.to_numeric(s["distinct_experts"], errors="coerce").to_numpy()
    if not series:
        return None
    fig, ax = _figure()
    for names, values in merge_identical(series):
        ax.plot(np.arange(len(values)), values, label=_group_label(names), linewidth=1)
    ax.set_xlabel("decode step (first trial)")
    ax.set_ylabel("distinct experts per layer (mean)")
    ax.set_title("Distinct experts touched per decode step")
    ax.legend(fontsize=8)
    return _save(fig, path)


def expert_store(summary: dict, path: Path) -> Path | None:
    stores = [c["expert_store"] for c in summary["configs"]]
    if all(s["hit_rate"] is None and s["stall_s"] is None for s in stores):
        return None
    names = _names(summary)
    fig, (ax1, ax2) = _figure(10, 4, ncols=2)
    x = np.arange(len(names))
    hit = [np.nan if s["hit_rate"] is None else 100 * s["hit_rate"] for s in stores]
    prec = [np.nan if s["prefetch_precision"] is None else 100 * s["prefetch_precision"] for s in stores]
    ax1.bar(x - 0.2, np.nan_to_num(hit), 0.4, label="expert-store hit rate", color="#4C72B0")
    ax1.bar(x + 0.2, np.nan_to_num(prec), 0.4, label="prefetch precision", color="#55A868")
    ax1.set_xticks(x, names, rotation=20, ha="right")
    ax1.set_ylabel("%")
    ax1.set_ylim(0, 100)
    ax1.legend(fontsize=8)
    ax1.set_title("Expert store hits and prefetch")
    ax2.bar(x, [s["stall_s"] or 0 for s in stores], color="#C44E52")
    ax2.set_xticks(x, names, rotation=20, ha="right")
    ax2.set_ylabel("stall s per trial")
    ax2.set_title("Time waiting for experts")
    return _save(fig, path)


def roofline(summary: dict, path: Path) -> Path | None:
    fr = [c["roofline"]["achieved_fraction"] for c in summary["configs"]]
    if all(f is None for f in fr):
        return None
    fig, ax = _figure()
    _bar_with_ci(ax, _names(summary), [None if f is None else 100 * f for f in fr], [None] * len(fr), "#8172B3")
    ax.axhline(100, color="black", linestyle="--", linewidth=0.8)
    ax.set_ylabel("% of the memory-bandwidth limit")
    ax.set_title("Roofline: achieved decode tok/s / bandwidth limit")
    return _save(fig, path)


def speculative_acceptance(summary: dict, path: Path) -> Path | None:
    from moebench.results.plots_speculative import draw_acceptance, speculative_records

    records = speculative_records(summary)
    if not records:
        return None
    fig, (ax1, ax2) = _figure(11, 4, ncols=2)
    draw_acceptance(ax1, ax2, records)
    return _save(fig, path)


def all_plots(summary: dict, samples: pd.DataFrame, steps: pd.DataFrame | None,
              out_dir: Path) -> list[tuple[str, Path]]:
    """Draw every plot that has data; (caption, path) in report order."""
    from moebench.results import plots_forest, plots_serving, plots_speculative
    from moebench.results.policy import DEFAULTS

    out_dir = Path(out_dir)
    jobs = [
        (plots_forest.ACCURACY_CAPTION, plots_forest.ACCURACY_FILE, lambda p: plots_forest.accuracy_forest(summary, p)),
        (plots_forest.SPEEDUP_CAPTION, plots_forest.SPEEDUP_FILE,
         lambda p: plots_forest.speedup_forest(summary, p, DEFAULTS.min_speedup)),
        ("Decode tokens/s per configuration (median, 95% CI)", "decode_tps.png",
         lambda p: decode_throughput(summary, p)),
        ("Stacking waterfall of decode tokens/s", "waterfall.png", lambda p: waterfall(summary, p)),
        ("Accuracy per configuration (Wilson 95% CI)", "accuracy.png", lambda p: accuracy(summary, p)),
        ("TTFT and TPOT distributions", "latency_cdf.png", lambda p: latency_cdfs(summary, samples, p)),
        ("Output length", "output_length.png", lambda p: output_lengths(summary, samples, p)),
        ("Expert load per layer", "expert_load.png", lambda p: expert_load(summary, p)),
        ("Distinct experts per decode step", "distinct_experts.png",
         lambda p: distinct_experts(summary, steps, p)),
        ("Expert store hit rate, prefetch precision and stall time", "expert_store.png",
         lambda p: expert_store(summary, p)),
        ("Roofline: achieved fraction of the bandwidth limit", "roofline.png", lambda p: roofline(summary, p)),
        (plots_speculative.CAPTION, plots_speculative.FILE,
         lambda p: speculative_acceptance(summary, p)),
        (plots_serving.CURVES_CAPTION, plots_serving.CURVES_FILE, lambda p: plots_serving.latency_curves(summary, p)),
        (plots_serving.STABILITY_CAPTION, plots_serving.STABILITY_FILE, lambda p: plots_serving.stability(summary, p)),
    ]
    made = []
    for caption, name, draw in jobs:
        (out_dir / name).unlink(missing_ok=True)  # a plot left from an earlier report would mislead
        path = draw(out_dir / name)
        if path is not None:
            made.append((caption, path))
    return made
