"""The report's speculative-decoding plot: for each config whose activation evidence holds a
speculative record (`activation.evidence.speculative` in summary.json, engine/speculative.py),
the acceptance rate at each draft position and the mean tokens emitted per verifying sequence and
step, of the first trial (the record summary.json keeps). Drawn by
moebench.results.plots.speculative_acceptance only when a config ran with drafts on; a run without
speculation gets no plot and no caption."""

from __future__ import annotations

import numpy as np

FILE = "speculative_acceptance.png"
CAPTION = "Speculative decoding: acceptance by draft position and tokens per verify step"


def speculative_records(summary: dict) -> list[tuple[str, dict]]:
    """(config name, its speculative evidence) for each config that ran with drafts on."""
    records = []
    for c in summary["configs"]:
        spec = ((c.get("activation") or {}).get("evidence") or {}).get("speculative")
        if isinstance(spec, dict) and spec.get("method", "off") != "off" and spec.get("drafted_by_position"):
            records.append((c["name"], spec))
    return records


def _label(name: str, spec: dict) -> str:
    limit = spec.get("max_batch")
    return f"{name} ({spec['method']}, K {spec.get('tokens')}" + (f", max batch {limit})" if limit else ")")


def draw_acceptance(ax1, ax2, records: list[tuple[str, dict]]) -> None:
    """Acceptance by draft position (ax1) and tokens per verify step (ax2) of each record."""
    k_max = max(len(spec["drafted_by_position"]) for _, spec in records)
    width = 0.8 / len(records)
    for i, (name, spec) in enumerate(records):
        by_pos = [np.nan if r is None else 100 * r for r in spec.get("acceptance_by_position") or []]
        x = np.arange(1, len(by_pos) + 1) + (i - (len(records) - 1) / 2) * width
        bars = ax1.bar(x, np.nan_to_num(by_pos), width, label=_label(name, spec), edgecolor="black", linewidth=0.5)
        for bar, drafted in zip(bars, spec["drafted_by_position"]):
            # how many drafts each rate rests on: later positions are drafted less often
            ax1.annotate(f"n={drafted}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                         ha="center", va="bottom", fontsize=6, rotation=90)
    ax1.set_xticks(np.arange(1, k_max + 1))
    ax1.set_xlabel("draft position")
    ax1.set_ylabel("accepted / drafted at the position (%)")
    ax1.set_ylim(0, 110)
    ax1.set_title("Acceptance by draft position (first trial)")
    ax1.legend(fontsize=7)
    names = [name for name, _ in records]
    tpv = [spec.get("tokens_per_verify") for _, spec in records]
    x = np.arange(len(names))
    ax2.bar(x, [0.0 if t is None else t for t in tpv], 0.5, color="#55A868", edgecolor="black", linewidth=0.5)
    ax2.set_xlim(-0.75, len(names) - 0.25)
    for xi, (_, spec) in zip(x, records):
        rate = spec.get("acceptance_rate")
        ax2.annotate("no draft" if rate is None else f"{100 * rate:.1f}% accepted", (xi, spec.get("tokens_per_verify") or 0),
                     ha="center", va="bottom", fontsize=7)
    ax2.axhline(1.0, color="black", linestyle="--", linewidth=0.8)  # a plain decode step emits one token
    ax2.set_xticks(x, names, rotation=20, ha="right")
    ax2.set_ylabel("tokens per verifying sequence and step")
    ax2.set_title("Tokens per verify step (1 = plain decoding)")
