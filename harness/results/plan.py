"""`moebench plan`: before a run, the two figures a user needs: the smallest accuracy drop it would
call a regression with 80% probability, and the items a non-inferior verdict at the margin would
need when nothing changed; each in the answer models it assumes. Nothing runs: arithmetic from
moebench.results.paired_accuracy, checked by simulation (docs/statistics.md, "Planning a run")."""

from __future__ import annotations


def plan_text(items: int, baseline_accuracy: float, trials: int, margin: float,
              discordance: float | None = None) -> str:
    from moebench.results.paired_accuracy import items_for_margin, planned_drop

    drop = planned_drop(items, baseline_accuracy, trials, margin / 100, discordance)
    need = items_for_margin(margin / 100, baseline_accuracy, trials, discordance)
    p, psi = baseline_accuracy, drop["discordance"]
    many = "s" if trials != 1 else ""
    shape = f"{items} items x {trials} trial{many}"
    told = (f"{psi:.1%} of pairs discordant per trial, as you said (--discordance)" if discordance is not None
            else f"{psi:.1%} of pairs discordant per trial: independent samples at {p:.1%}, the most an item "
                 "set with that accuracy can have")

    def pts(v: float) -> str:
        return "none (too few items to reach 80%)" if v != v else f"{v * 100:.1f} points"
    return "\n".join([
        f"{shape}, baseline accuracy {p:.1%}, a {margin:g}-point margin (95% intervals, 80% probability):",
        "smallest true drop the run would call a regression (the gate fails, exit 1) in 80% of runs:",
        f"  {pts(drop['same_seed'])} if the config's outputs equal the baseline's except where it loses answers",
        "    (same seeds; the worst case puts the drop in whole items, which more trials cannot reveal)",
        f"  {pts(drop['diverged'])} if its answers differ from the baseline's like fresh samples, the drop in whole",
        f"    items or spread over trials ({told})",
        "  (never below the margin: a regression is a drop the run cannot show to lie within it)",
        f"items for a non-inferior verdict (the gate passes) at a {margin:g}-point margin when accuracy did not change:",
        f"  {need['same_seed']} if no answer changes (0 discordant pairs: the interval's lower end is above -{margin:g})",
        f"  {need['diverged']} for 80% probability with answers that differ like fresh samples ({trials} trial{many}"
        " each, trials independent)",
    ])
