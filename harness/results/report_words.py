"""The report's "What this run proves": speed, accuracy and activation in plain words, for the
headline config. The accuracy part states the verdict with its power (moebench.results.verdict): what
the run could have detected, not only what it did not detect.
"""

from __future__ import annotations


def format_p(p: float | None) -> str:
    from moebench.results.verdict import format_p as verdict_format_p

    return verdict_format_p(p)


def _speed_words(opt: dict, sp: dict) -> list[str]:
    ci, name, trials = sp.get("ci95"), opt["name"], opt["trials"]
    if sp.get("median") is None:
        return ["This run has no decode timing, so it says nothing about speed."]
    if ci is None:
        return [f"The measured speedup of {name} over the baseline is {sp['median']:.2f}x, but with "
                f"{trials} trial{'s' if trials != 1 else ''} there is no confidence interval, so the speed "
                "difference is not established."]
    interval = f"95% CI {ci[0]:.2f}-{ci[1]:.2f}x"
    if ci[0] > 1:
        words = [f"{name} decodes faster than the baseline: {sp['median']:.2f}x ({interval}), an interval "
                 "that lies entirely above 1.00x (no change)."]
    elif ci[1] < 1:
        words = [f"{name} decodes slower than the baseline: {sp['median']:.2f}x ({interval}), an interval "
                 "that lies entirely below 1.00x (no change)."]
    else:
        words = [f"A speed difference is not established: {sp['median']:.2f}x, and its {interval} "
                 "includes 1.00x (no change)."]
    if trials < 3:
        words.append(f"With only {trials} trials the interval is wide and uncertain itself; more trials "
                     "(--repeats) narrow it.")
    return words


def _accuracy_words(opt: dict, vb: dict) -> list[str]:
    """The verdict over every trial first (the decision), then trial 0's McNemar test, which the
    seed report used and which decides nothing here."""
    n = vb.get("paired_items") or 0
    v, diff = vb.get("accuracy_verdict") or {}, vb.get("accuracy_difference") or {}
    if not n and not diff.get("pairs"):
        return []
    words = []
    if v.get("statement") and v.get("verdict"):
        pairs = (f"{diff.get('pairs')} answers ({diff.get('items')} items x {diff.get('trials')} trials, "
                 "clustered by item)" if (diff.get("trials") or 1) > 1 else f"{diff.get('pairs')} paired answers")
        words.append(f"Accuracy verdict over {pairs}: {v['statement']}.")
    d, p = vb.get("discordant") or {}, vb.get("mcnemar_p")
    if p is not None and n:
        words.append(f"Trial 0 alone, the seed report's statistic: {d.get('baseline_only', 0)} items right only for "
                     f"the baseline, {d.get('config_only', 0)} only for {opt['name']} (McNemar exact p = "
                     f"{format_p(p)}); it is shown, and decides nothing.")
    same = vb.get("identical_outputs")
    if same == 1:
        words.append("Every output matched the baseline's character for character: no answer changed on "
                     "these items.")
    elif same is not None:
        differ = vb.get("differing_outputs")
        words.append(f"{differ} of {n} outputs differ from the baseline's text ({1 - same:.1%}); the examples "
                     "below show where they diverge.")
    return words


def plain_words(summary: dict, opt: dict) -> str:
    """What the run proves and what it does not, for the headline config."""
    vb = opt.get("vs_baseline") or {}
    parts = _speed_words(opt, vb.get("speedup") or {})
    parts.append("Absolute tokens/s depend on this machine and its load; the ratio from interleaved "
                 "trials is the measured effect.")
    parts += _accuracy_words(opt, vb)
    inactive = [c["name"] for c in summary["configs"] if c["activation"].get("ok") is False]
    unknown = [c["name"] for c in summary["configs"] if c["activation"].get("ok") is None]
    if inactive:
        parts.append(f"Not valid for {', '.join(inactive)}: a switched-on optimization left no evidence "
                     "that it ran, so those numbers do not measure it.")
    elif unknown:
        parts.append(f"Activation is unrecorded for {', '.join(unknown)} (no trials.jsonl), so it is not "
                     "shown that each optimization ran.")
    else:
        idle = [c["name"] for c in summary["configs"] if c["activation"].get("not_exercised")]
        if idle:
            parts.append(f"Not exercised in {', '.join(idle)}: this workload gave a switched-on optimization no "
                         "chance to show evidence (for example no more requests than the batch size), so those "
                         "numbers do not measure it; every other switch showed evidence that it ran.")
        else:
            parts.append("Every configuration showed evidence that its optimizations ran.")
    return " ".join(parts)
