"""`moebench plan`: before a run, the smallest accuracy drop it could detect with 80% power, and
the items a non-inferior verdict at the margin would need. Nothing runs: arithmetic from
moebench.results.paired_accuracy (docs/statistics.md, "Planning a run")."""

from __future__ import annotations




def plan_text(items: int, baseline_accuracy: float, trials: int, margin: float) -> str:
    from moebench.results.paired_accuracy import items_for_margin, planned_drop

    drop = planned_drop(items, baseline_accuracy, trials)
    need = items_for_margin(margin / 100, baseline_accuracy, trials)
    p = baseline_accuracy
    shape = f"{items} items x {trials} trial{'s' if trials != 1 else ''}"

    def pts(v: float) -> str:
        return "none (too few items)" if v != v else f"{v * 100:.1f} points"
    return "\n".join([
        f"{shape}, baseline accuracy {p:.1%}, a {margin:g}-point margin (95% intervals, 80% power):",
        "smallest drop the run would detect (verdict: regression):",
        f"  {pts(drop['rare'])} if the config's outputs seldom differ from the baseline's (every changed",
        "    answer a lost one; a drop in whole items, which more trials of the same items cannot reveal)",
        f"  {pts(drop['independent'])} if its answers differ like independent samples at {p:.1%}"
        f" ({2 * p * (1 - p):.1%} of pairs discordant per trial)",
        f"items for a non-inferior verdict at a {margin:g}-point margin when accuracy did not change:",
        f"  {need['rare']} if no answer changes (0 discordant pairs: the interval's lower end is above -{margin:g})",
        f"  {need['independent']} for 80% power if answers differ like independent samples"
        f" ({trials} trial{'s' if trials != 1 else ''} each)",
    ])
