"""`moebench report`: report.md, a self-contained report.html and PNG plots for one run.

The content is built once as a list of blocks (heading, paragraph, table, image, code) and
rendered twice, to Markdown and to HTML, so both files always say the same thing. Every
piece of text is escaped on the way out: model outputs may contain markup.
"""

from __future__ import annotations

import base64
import html
import json
import re
from dataclasses import dataclass, field
from pathlib import Path


from moebench.fileio import atomic_write_text, ensure_writable_dir

MAX_EXAMPLES = 8
MAX_EXAMPLE_CHARS = 2000


# ---------------------------------------------------------------- content blocks

@dataclass
class Heading:
    text: str
    level: int = 2


@dataclass
class Para:
    text: str
    strong: bool = False


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]


@dataclass
class Image:
    caption: str
    path: Path


@dataclass
class Code:
    text: str
    label: str = ""


@dataclass
class Doc:
    title: str
    blocks: list = field(default_factory=list)

    def add(self, *blocks) -> None:
        self.blocks.extend(blocks)


# ---------------------------------------------------------------- formatting

def format_p(p: float | None) -> str:
    # moebench.results.summary imports pandas and scipy; `moebench report --help` must not wait for them
    from moebench.results.summary import format_p as summary_format_p

    return summary_format_p(p)


def _f(v: float | None, fmt: str = "{:.2f}", none: str = "n/a") -> str:
    return none if v is None else fmt.format(v)


def _ci(ci: list[float] | None, fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    return "" if not ci else f" [{fmt.format(ci[0] * scale)}, {fmt.format(ci[1] * scale)}]"


def _pct_change(new: float | None, old: float | None) -> str:
    if new is None or old is None or old == 0:
        return "n/a"
    return f"{(new / old - 1) * 100:+.1f}%"


def _paired_change(sp: dict) -> str:
    """A speedup block as the change column shows it: the paired estimate, never a ratio of medians."""
    med, ci = sp.get("median"), sp.get("ci95")
    if med is None:
        return "n/a"
    return f"{(med - 1) * 100:+.0f}% (speedup {med:.2f}x{_ci(ci)})"


def _acc(c: dict) -> str:
    a = c["accuracy"]
    if a["value"] is None:
        return "n/a"
    return f"{a['value']:.2%} ({a['correct']}/{a['total']})"


def _lat(c: dict, key: str, stat: str) -> float | None:
    return (c["latency"].get(key) or {}).get(stat)


# ---------------------------------------------------------------- sections

def _headline(summary: dict, base: dict, opt: dict) -> Table:
    vb = opt.get("vs_baseline") or {}
    sp = vb.get("speedup") or {}
    bd, od = base["decode_tokens_per_s"], opt["decode_tokens_per_s"]
    bo, oo = base["output_tokens_per_s"], opt["output_tokens_per_s"]
    diff = vb.get("accuracy_difference") or {}
    rows = [
        ["Decode tokens/s (median [95% CI]; change: paired speedup)", _f(bd["median"]) + _ci(bd["ci95"]),
         _f(od["median"]) + _ci(od["ci95"]), _paired_change(sp)],
        ["Output tokens/s, whole run (median [95% CI]; change: paired speedup)", _f(bo["median"]) + _ci(bo.get("ci95")),
         _f(oo["median"]) + _ci(oo.get("ci95")), _paired_change(vb.get("output_speedup") or {})],
        ["Accuracy (correct / total; change: paired difference, all trials)", _acc(base), _acc(opt),
         f"{_f(diff.get('points'), '{:+.2f}')} points{_ci(diff.get('ci95'), '{:+.2f}')}"],
        ["McNemar exact p, trial 0 (discordant baseline-only vs optimized-only)", "",
         format_p(vb.get("mcnemar_p")),
         f"{(vb.get('discordant') or {}).get('baseline_only', 'n/a')} vs "
         f"{(vb.get('discordant') or {}).get('config_only', 'n/a')}"],
        ["Identical outputs", "", _f(vb.get("identical_outputs"), "{:.1%}"),
         f"{vb.get('differing_outputs', 'n/a')} differ"],
    ]
    for label, key, stat in (("Mean latency (s)", "latency_s", "mean"), ("P50 latency (s)", "latency_s", "p50"),
                             ("P95 latency (s)", "latency_s", "p95"), ("Mean TTFT (s)", "ttft_s", "mean"),
                             ("Mean TPOT (s)", "tpot_s", "mean")):
        b, o = _lat(base, key, stat), _lat(opt, key, stat)
        rows.append([label, _f(b, "{:.3f}"), _f(o, "{:.3f}"), _pct_change(o, b)])
    rows += [
        ["Output length P50 / P95 (tokens)",
         f"{_f(base['output_tokens']['p50'], '{:.0f}')} / {_f(base['output_tokens']['p95'], '{:.0f}')}",
         f"{_f(opt['output_tokens']['p50'], '{:.0f}')} / {_f(opt['output_tokens']['p95'], '{:.0f}')}", ""],
        ["Errors / truncations", f"{base['errors']} / {base['truncations']}",
         f"{opt['errors']} / {opt['truncations']}", ""],
        ["Optimizations active", _active(base), _active(opt), ""],
    ]
    return Table(["metric", f"baseline ({base['name']})", f"optimized ({opt['name']})", "change"], rows)


def _active(c: dict) -> str:
    ok = c["activation"].get("ok")
    if ok and c["activation"].get("not_exercised"):
        return "not exercised"  # the workload gave a switch no chance to show evidence: never "yes"
    return "unknown" if ok is None else ("yes" if ok else "NO")


def _switches(c: dict) -> str:
    if "server_args" in c:  # a configuration of a server: its own arguments are its switches
        return " ".join(c["server_args"]) or "(server defaults)"
    return f"{c['kernel']} / {c['scheduler']} / {c['prefetch']}"


def _per_config(summary: dict) -> list[Table]:
    """Speed and accuracy, then latency and errors: two tables narrow enough for a page."""
    speed, latency = [], []
    for c in summary["configs"]:
        vb = c.get("vs_baseline") or {}
        sp = vb.get("speedup") or {}
        d = c["decode_tokens_per_s"]
        speed.append([
            c["name"], str(c["trials"]), _f(d["median"]) + _ci(d["ci95"]),
            "1 (baseline)" if not vb else _f(sp.get("median"), "{:.2f}x") + _ci(sp.get("ci95")),
            _acc(c) + _ci(c["accuracy"]["ci95"], "{:.1f}", 100),
            "" if not vb else _f(vb.get("accuracy_delta"), "{:+.2f}") + _ci(vb.get("accuracy_delta_ci95")),
            "" if not vb else format_p(vb.get("mcnemar_p")),
            "" if not vb else _f(vb.get("identical_outputs"), "{:.1%}"),
            _active(c),
        ])
        latency.append([
            c["name"], _switches(c), _f(_lat(c, "ttft_s", "mean"), "{:.3f}"), _f(_lat(c, "tpot_s", "mean"), "{:.4f}"),
            f"{_f(_lat(c, 'latency_s', 'p50'), '{:.2f}')} / {_f(_lat(c, 'latency_s', 'p95'), '{:.2f}')}",
            f"{_f(c['output_tokens']['p50'], '{:.0f}')} / {_f(c['output_tokens']['p95'], '{:.0f}')}",
            f"{c['errors']} / {c['truncations']}",
        ])
    return [Table(["config", "trials", "decode tok/s [95% CI]",
                   "speedup [95% CI]", "accuracy [95% CI %]", "Δ accuracy points [95% CI]", "McNemar p",
                   "identical outputs", "active"], speed),
            Table(["config", "switches", "mean TTFT s", "mean TPOT s", "latency P50 / P95 s", "output tokens P50 / P95",
                   "errors / truncations"], latency)]


def _throughput_blocks(summary: dict) -> list:
    """Decode tok/s (decode steps only) beside output tok/s over the whole run, with both speedups,
    how their intervals were computed, and what a switch changes beyond its name."""
    rows = []
    for c in summary["configs"]:
        vb = c.get("vs_baseline") or {}
        d, o = c["decode_tokens_per_s"], c.get("output_tokens_per_s") or {}
        sp, osp = vb.get("speedup") or {}, vb.get("output_speedup") or {}
        rows.append([c["name"], str(c["trials"]), _f(d["median"]) + _ci(d.get("ci95")),
                     "1 (baseline)" if not vb else _f(sp.get("median"), "{:.2f}x") + _ci(sp.get("ci95")),
                     _f(o.get("median")) + _ci(o.get("ci95")),
                     "1 (baseline)" if not vb else _f(osp.get("median"), "{:.2f}x") + _ci(osp.get("ci95"))])
    blocks = [Table(["config", "trials", "decode tok/s [95% CI]", "decode speedup [95% CI]",
                     "output tok/s, whole run [95% CI]", "whole-run speedup [95% CI]"], rows)]
    iv = summary.get("intervals") or {}
    n = iv.get("trials") or 0
    order = {"rotated": "the configurations' order rotated by one place from trial to trial",
             "fixed": "the configurations in the same order in every trial"}.get(iv.get("order"), "")
    blocks.append(Para(
        "Decode tok/s counts decode steps only (tokens generated in decode steps / their wall time); output "
        "tok/s counts every output token over each trial's whole wall time, prefill included, as `vllm bench "
        "serve` reports output throughput. " + (
            f"Intervals: a Student t interval on the logs of the {n} per-trial values, {n - 1} degree"
            f"{'s' if n > 2 else ''} of freedom; for speedups on the per-trial ratios config / baseline of the "
            f"same trial (paired){', with ' + order if order else ''}. With {n} trials the interval is as wide "
            "as so few trials demand (docs/statistics.md)." if n >= 2 else
            "One trial: no interval can be computed; run with --repeats 2 or more.")))
    dtypes = {}
    for c in summary["configs"]:
        ev = (c["activation"].get("evidence") or {}).get("prefetch") or {}
        if ev.get("expert_dtype"):
            dtypes.setdefault(c["kernel"], set()).add(ev["expert_dtype"])
    if len({d for ds in dtypes.values() for d in ds}) > 1:
        said = "; ".join(f"kernel={k}: {', '.join(sorted(v))}" for k, v in sorted(dtypes.items()))
        blocks.append(Para(f"The switches bundle a change of expert dtype ({said}): the fused CPU kernel reads "
                           "bfloat16 experts as stored and widens them in registers (exact), where the naive "
                           "loop reads float32 copies, so kernel=fused also halves the bytes per expert read "
                           "and per load. Both get the same number of expert slots for a budget."))
    return blocks


def _mcnemar_table(summary: dict) -> Table:
    rows = []
    for c in summary["configs"]:
        vb = c.get("vs_baseline")
        if not vb:
            continue
        d, cc = vb["discordant"], vb.get("concordant") or {}
        rows.append([c["name"], str(vb["paired_items"]), str(cc.get("both_correct", "")),
                     str(d["baseline_only"]), str(d["config_only"]), str(cc.get("both_wrong", "")),
                     format_p(vb["mcnemar_p"]),
                     _f(vb.get("accuracy_delta"), "{:+.2f}") + _ci(vb.get("accuracy_delta_ci95"))])
    return Table(["config vs baseline", "paired items", "both correct", "baseline only", "config only",
                  "both wrong", "McNemar exact p", "Δ points [95% CI]"], rows)


def _trials_cell(diff: dict) -> str:
    check = diff.get("trial_check") or {}
    if check.get("p") is None:
        return "n/a (one trial)"
    flag = f"; FLAGGED, trial {check.get('standout')} stands out" if check.get("flagged") else ""
    return f"p = {format_p(check['p'])}{flag}"


def _verdict_blocks(summary: dict) -> list:
    """Every config's accuracy verdict: the difference over all trials, clustered by item, with the
    interval, whether the trials agree, the drop the run would call a regression and the verdict
    at the margin; then each verdict's sentence (what it certifies, warnings)."""
    rows, methods, sentences = [], [], []
    for c in summary["configs"]:
        vb = c.get("vs_baseline") or {}
        diff, v = vb.get("accuracy_difference") or {}, vb.get("accuracy_verdict") or {}
        if not vb or not diff.get("pairs"):
            continue
        if diff.get("method") not in methods:
            methods.append(diff["method"])
        d = diff.get("discordant") or {}
        name = c["name"] + (" (approximate)" if c.get("approximate") else "")
        rows.append([name, f"{diff['items']} x {diff['trials']}",
                     f"{d.get('baseline_only', '')} / {d.get('config_only', '')}",
                     _f(diff.get("points"), "{:+.2f}") + _ci(diff.get("ci95"), "{:+.2f}"),
                     _f(diff.get("design_effect"), "{:.2f}"), _trials_cell(diff),
                     _f(v.get("detectable_drop"), "{:.1f}"), _f(v.get("margin"), "{:g}"),
                     (v.get("verdict") or "n/a") + (" (warning)" if v.get("warning") else "")])
        if v.get("statement"):
            sentences.append(f"{name}: {v['statement']}.")
    if not rows:
        return []
    return [Table(["config", "items x trials", "answers lost / won", "Δ points [95% CI]", "design effect",
                   "trials exchangeable?", "drop called a regression (80%)", "margin", "verdict"], rows),
            Para("Method: " + "; ".join(methods) + ". A pair is one item in one trial, answered by both configs (under "
                 "sampling from the same seed); items, not trials, are the independent unit, and the interval carries "
                 "the trials' excess variance when they disagree (docs/statistics.md). The decision: identical and "
                 "non-inferior pass, regression fails, inconclusive fails unless the gate's policy says otherwise. "
                 "Trial 0's McNemar test (above) is the seed report's statistic; it decides nothing."),
            *[Para(s) for s in sentences]]


def _engine_tables(summary: dict) -> list[Table]:
    batching, store = [], []
    for c in summary["configs"]:
        b, s, r = c["batching"], c["expert_store"], c["roofline"]
        batching.append([
            c["name"], _f(b["mean_batch_size"], "{:.1f}"), _f(b["mean_distinct_experts"], "{:.1f}"),
            _f(b["mean_expert_imbalance"], "{:.2f}"), _f(b["p95_queue_wait_s"], "{:.3f}"),
        ])
        store.append([
            c["name"], _f(s["hit_rate"], "{:.1%}"), _f(s["prefetch_precision"], "{:.1%}"), _f(s["stall_s"], "{:.3f}"),
            _f(s["stall_share"], "{:.1%}"), _f(None if r["bytes_per_decode_step"] is None
                                             else r["bytes_per_decode_step"] / 1e6, "{:.1f}"),
            _f(r["limit_tokens_per_s"], "{:.1f}"), _f(r["achieved_fraction"], "{:.1%}"),
        ])
    return [Table(["config", "batch size", "distinct experts", "expert imbalance", "P95 queue wait s"], batching),
            Table(["config", "store hit rate", "prefetch precision", "stall s / trial", "stall share",
                   "MB read / decode step", "roofline tok/s", "achieved"], store)]


def _serving_blocks(summary: dict) -> list:
    serving = summary.get("serving")
    if not serving:
        return []
    slo = serving.get("slo") or {}
    rows = []
    for name, points in serving["configs"].items():
        for label, p in points.items():
            good, lag = p.get("goodput_rps") or {}, p.get("send_lag_s") or {}
            vs = (p.get("vs_baseline") or {}).get("p99_ttft_ratio") or {}
            rows.append([name, label, _f(p["achieved_rps"]["median"]), _f(p["output_tok_s"]["median"], "{:.1f}"),
                         f"{_f(p['ttft_s']['p50'], '{:.3f}')} / {_f(p['ttft_s']['p99'], '{:.3f}')}",
                         f"{_f(p['tpot_s']['p50'], '{:.4f}')} / {_f(p['tpot_s']['p99'], '{:.4f}')}",
                         _f(p["latency_s"]["p99"], "{:.3f}"),
                         f"{_f(good.get('mean'))} {_ci(good.get('ci95'))}" if slo else "-",
                         _f(p.get("slo_attainment"), "{:.0%}", "-"),
                         f"{_f(vs.get('median'), '{:.2f}x', '-')} {_ci(vs.get('ci95'))}".strip(),
                         _f(None if lag.get("p99") is None else 1e3 * lag["p99"], "{:.1f}", "-")])
    words = ", ".join(f"{k.removesuffix('_s')} <= {v:g} s" for k, v in slo.items()) or "none given (--slo)"
    blocks = [Heading("Offered load"),
              Para(f"Requests sent at each load's arrival times (the same for every config and trial); the "
                   f"accuracy verdict and speedups above are the {serving['primary']} load's. SLOs: {words}. "
                   "Send lag is how late the measuring client handed a request over (docs/serving-load.md)."),
              Table(["config", "load", "achieved req/s", "output tok/s", "TTFT P50 / P99 s", "TPOT P50 / P99 s",
                     "e2e P99 s", "goodput req/s (95% CI)", "met SLOs", "P99 TTFT vs baseline (95% CI)",
                     "send lag P99 ms"], rows)]
    stab = [[name, label, _f(p["stability"]["median_cv"], "{:.3f}"), _f(p["stability"]["worst_min_over_mean"]),
             _f(p["stability"]["worst_max_over_mean"]),
             f"{p['stability'].get('windows', '?')} x {p['stability']['window_s']:g} s"]
            for name, points in serving["configs"].items() for label, p in points.items() if p.get("stability")]
    if stab:
        blocks.append(Table(["config", "fluctuating load", "CV of window tok/s (median over trials)",
                             "lowest window / mean", "highest window / mean", "windows"], stab))
        notes = {p["stability"]["note"] for points in serving["configs"].values() for p in points.values()
                 if (p.get("stability") or {}).get("note")}
        blocks += [Para(note) for note in sorted(notes)]
    return blocks


def _memory_blocks(summary: dict) -> list:
    """Expert memory (every expert byte the store held) and peak RSS per config beside decode tok/s;
    with an all-resident reference in the run, the offload trade-off and the penalty lookahead hides."""
    off = summary.get("offload") or {}
    resident = (off.get("resident") or {}).get("expert_memory_bytes")
    rows = []
    for c in summary["configs"]:
        m = c.get("memory") or {}
        if m.get("expert_memory_bytes") is None:
            continue
        tier = m.get("tier") or ""
        rows.append([c["name"], str(m.get("expert_budget")), tier + (f" ({m['read_mode']})" if m.get("read_mode") else ""),
                     _f(m["expert_memory_bytes"] / 1e6, "{:.2f}"),
                     _f(None if not resident else m["expert_memory_bytes"] / resident, "{:.0%}"),
                     _f(None if m.get("process_rss_peak_bytes") is None else m["process_rss_peak_bytes"] / 1e6,
                        "{:.0f}"),
                     _f(c["decode_tokens_per_s"]["median"]) + _ci(c["decode_tokens_per_s"].get("ci95"))])
    if not rows:
        return []
    blocks = [Heading("Expert memory and offloading"),
              Table(["config", "expert budget", "offload tier", "expert MB", "of all-resident", "peak RSS MB",
                     "decode tok/s [95% CI]"], rows),
              Para("Expert MB counts every expert byte the store held: its pool (the budget, read buffers "
                   "included) or all experts when resident, plus any copy in host memory (the host tier's); "
                   "the disk tier keeps none. Peak RSS is the whole process's high-water mark during a trial.")]
    if off and all((off[k] or {}).get("expert_memory_bytes") for k in ("resident", "off", "lookahead")):
        r, o, la = off["resident"], off["off"], off["lookahead"]
        hidden = off.get("penalty_hidden")
        trials = ", ".join("n/a" if x is None else f"{x:.0%}" for x in off.get("penalty_hidden_trials") or [])
        blocks.append(Para(
            f"Offloading to the {o.get('tier')} tier keeps {_f(o['expert_memory_vs_resident'], '{:.0%}')} of the "
            f"all-resident expert memory ({_f(o['expert_memory_bytes'] / 1e6)} of {_f(r['expert_memory_bytes'] / 1e6)} "
            f"MB) and decodes at {_f(o['decode_tokens_per_s'], '{:.1f}')} tok/s without prefetch against "
            f"{_f(r['decode_tokens_per_s'], '{:.1f}')} resident; lookahead decodes at "
            f"{_f(la['decode_tokens_per_s'], '{:.1f}')} tok/s in {_f(la['expert_memory_vs_resident'], '{:.0%}')} of "
            f"the memory, hiding {_f(hidden, '{:.0%}')} of the offload penalty (median over trials of "
            f"(T_off - T_lookahead) / (T_off - T_resident); per trial: {trials or 'n/a'})."))
    return blocks


def _evidence_value(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(_evidence_value(x) for x in v) if v else "none"
    if isinstance(v, dict):
        return "; ".join(f"{k} {_evidence_value(x)}" for k, x in v.items()) if v else "none"
    return str(v)


def _evidence_rows(evidence, prefix: str = "") -> list[list[str]]:
    """Nested counters, one row each: ("prefetch", "hit rate", "0.957")."""
    rows = []
    for key, value in (evidence or {}).items():
        if isinstance(value, dict) and not prefix:
            rows += _evidence_rows(value, str(key))
        else:
            rows.append([prefix, str(key).replace("_", " "), _evidence_value(value)])
    return rows


def _activation_blocks(summary: dict) -> list:
    blocks = [Heading("Activation evidence"),
              Para("Each switched-on optimization must leave evidence that it ran (trial 0's counters "
                   "below). A configuration marked NO did not measure its optimization.")]
    blocks.append(Table(["config", "active", "activation errors"],
                        [[c["name"], _active(c) + (f" (echo only: {c['echo_only']})" if c.get("echo_only") else ""),
                          "; ".join(c["activation"].get("errors") or []) or "none"]
                         for c in summary["configs"]]))
    for c in summary["configs"]:
        evidence = c["activation"].get("evidence")
        blocks.append(Heading(f"{c['name']}: evidence (trial 0)", 3))
        if not evidence:
            blocks.append(Para("No evidence was recorded for this configuration."))
        else:
            blocks.append(Table(["part", "counter", "value"], _evidence_rows(evidence)))
    return blocks


def _examples(summary: dict, outputs: dict[tuple[str, str], str]) -> list:
    blocks = []
    shown = 0
    for c in summary["configs"]:
        vb = c.get("vs_baseline")
        if not vb:
            continue
        for d in vb["first_divergence"]:
            if shown >= MAX_EXAMPLES:
                break
            base_text = outputs.get((summary["baseline"], d["item_id"]), "")
            cfg_text = outputs.get((c["name"], d["item_id"]), "")
            blocks.append(Para(f"{c['name']}, item {d['item_id']}: first difference at character "
                               f"{d['position']}."))
            blocks.append(Code(base_text[:MAX_EXAMPLE_CHARS], f"baseline ({summary['baseline']})"))
            blocks.append(Code(cfg_text[:MAX_EXAMPLE_CHARS], c["name"]))
            shown += 1
    if not blocks:
        return [Para("No output differs from the baseline's.")]
    return blocks


def build_document(summary: dict, samples, images: list[tuple[str, Path]]) -> Doc:
    from moebench.results.report_words import plain_words
    from moebench.results.summary import config_entry, verdict

    base = config_entry(summary, summary["baseline"])
    opt = config_entry(summary, summary["optimized"]) if summary.get("optimized") else None
    model, suite, machine = summary.get("model") or {}, summary.get("suite") or {}, summary.get("machine") or {}
    doc = Doc(f"moebench report: {summary['run_id']}")
    what = (f"Model {model['model_type']} ({Path(model.get('path') or '').name})" if model.get("model_type")
            else f"Served model '{model.get('served_model')}' over HTTP (OpenAI API)")
    doc.add(Para(f"{what}, suite "
                 f"{suite.get('name', 'unknown')} ({summary['n_items']} items, {summary.get('repeats')} "
                 f"trials), machine {machine.get('cpu', 'unknown')}"
                 f"{', GPU ' + str(machine['gpu']) if machine.get('gpu') else ''}, created "
                 f"{summary.get('created')}, commit {summary.get('git_commit')}."))
    doc.add(Heading("Verdict"))
    if opt is None:
        doc.add(Para("Only the baseline ran: there is nothing to compare."))
    else:
        doc.add(Para(verdict(summary), strong=True), _headline(summary, base, opt),
                Heading("What this run proves", 3), Para(plain_words(summary, opt)))
    doc.add(Heading("All configurations"), *_per_config(summary))
    doc.add(Heading("Throughput: decode and whole run"), *_throughput_blocks(summary))
    if len(summary["configs"]) > 1:
        doc.add(Heading("Paired accuracy vs the baseline"), _mcnemar_table(summary), *_verdict_blocks(summary))
    doc.add(*_serving_blocks(summary))
    doc.add(Heading("Batching, expert store and roofline"), *_engine_tables(summary))
    doc.add(*_memory_blocks(summary))
    doc.add(*_activation_blocks(summary))
    if images:
        doc.add(Heading("Plots"), *[Image(caption, path) for caption, path in images])
    outputs = {(r.config, r.item_id): r.output
               for r in samples.sort_values("trial", ascending=False).itertuples()}
    doc.add(Heading("Examples of differing outputs"), *_examples(summary, outputs))
    return doc


# ---------------------------------------------------------------- renderers

_MD_PUNCT = re.compile(r"\\(?=[!-/:-@\[-`{-~])")  # a backslash that would escape what follows
_MD_TAG = re.compile(r"<(?=[A-Za-z/!?])")  # only '<' that starts a tag or comment is markup
_MD_ENTITY = re.compile(r"&(?=#?\w+;)")


def _md_text(s: str) -> str:
    """Text for a Markdown line: markup in it shows literally (a backslash escape, so the raw file
    stays readable: '< 0.0001' stays as it is); '|' would split table cells."""
    s = _MD_PUNCT.sub(r"\\\\", s)
    s = _MD_ENTITY.sub(r"\\&", _MD_TAG.sub(r"\\<", s))
    return s.replace("|", "\\|").replace("\n", " ")


def render_markdown(doc: Doc) -> str:
    out = [f"# {_md_text(doc.title)}", ""]
    for b in doc.blocks:
        if isinstance(b, Heading):
            out += ["#" * b.level + " " + _md_text(b.text), ""]
        elif isinstance(b, Para):
            out += [f"**{_md_text(b.text)}**" if b.strong else _md_text(b.text), ""]
        elif isinstance(b, Table):
            out.append("| " + " | ".join(_md_text(h) for h in b.header) + " |")
            out.append("|" + "---|" * len(b.header))
            out += ["| " + " | ".join(_md_text(c) for c in row) + " |" for row in b.rows]
            out.append("")
        elif isinstance(b, Image):
            out += [f"![{_md_text(b.caption)}]({b.path.name})", ""]
        elif isinstance(b, Code):
            # A fence longer than any backtick run inside keeps model text from closing it.
            longest = max((len(m) for m in re.findall(r"`+", b.text)), default=0)
            fence = "`" * max(3, longest + 1)
            out += [f"{_md_text(b.label)}:", "", fence, b.text, fence, ""]
    return "\n".join(out)


# Every table fits the page at 1400 px and at 800 px (tests/results/test_report_layout.py checks it in
# Chromium); the scrolling wrapper only keeps the page itself from overflowing on a narrower one.
_CSS = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
.table{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;margin:1em 0;font-size:0.85em}th,td{border:1px solid #ccc;padding:3px 6px;
text-align:left;vertical-align:top;overflow-wrap:break-word}th{background:#f0f0f0}pre{background:#f7f7f7;padding:0.8em;
white-space:pre-wrap;word-break:break-word;border:1px solid #ddd}img{max-width:100%;height:auto}
figure{margin:1.5em 0}figcaption{font-size:0.9em;color:#555}.verdict{font-size:1.1em}"""


def render_html(doc: Doc) -> str:
    e = html.escape
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>{e(doc.title)}</title><style>{_CSS}</style></head><body>", f"<h1>{e(doc.title)}</h1>"]
    for b in doc.blocks:
        if isinstance(b, Heading):
            out.append(f"<h{b.level}>{e(b.text)}</h{b.level}>")
        elif isinstance(b, Para):
            out.append(f'<p class="verdict"><strong>{e(b.text)}</strong></p>' if b.strong else f"<p>{e(b.text)}</p>")
        elif isinstance(b, Table):
            out.append('<div class="table"><table><thead><tr>' + "".join(f"<th>{e(h)}</th>" for h in b.header)
                       + "</tr></thead><tbody>")
            out += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in b.rows]
            out.append("</tbody></table></div>")
        elif isinstance(b, Image):
            data = base64.b64encode(b.path.read_bytes()).decode("ascii")
            out.append(f'<figure><img alt="{e(b.caption)}" src="data:image/png;base64,{data}">'
                       f"<figcaption>{e(b.caption)}</figcaption></figure>")
        elif isinstance(b, Code):
            out.append(f"<p>{e(b.label)}:</p><pre>{e(b.text)}</pre>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- entry points

def _run_id(run_dir: Path) -> str:
    """The run's id as its manifest (or summary) names it; else the folder's name."""
    for name in ("manifest.json", "summary.json"):
        try:
            return str(json.loads((run_dir / name).read_text())["run_id"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return run_dir.resolve().name


def write_report(run_dir: Path, out_dir: Path | None = None, margin: float | None = None) -> Path:
    """Write report.md, report.html and the plots; returns the report directory. margin: judge the
    accuracy verdicts at this many points instead of the summary's margin."""
    from moebench.errors import MoebenchError

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise MoebenchError(f"{run_dir}: no such results directory")
    if margin is not None and not 0 < margin < 100:
        raise MoebenchError(f"--margin {margin:g}: give accuracy points between 0 and 100")
    # the output folder is checked before the run is read and the plots are drawn
    out_dir = ensure_writable_dir(out_dir if out_dir is not None else Path("reports") / _run_id(run_dir), "--out")

    from moebench.results import plots
    from moebench.results.summary import load_run, load_summary, with_margin

    run = load_run(run_dir)
    summary = load_summary(run_dir)
    if margin is not None:
        summary = with_margin(summary, margin)
    images = plots.all_plots(summary, run.samples, run.steps, out_dir)
    doc = build_document(summary, run.samples, images)
    atomic_write_text(out_dir / "report.md", render_markdown(doc))
    atomic_write_text(out_dir / "report.html", render_html(doc))
    return out_dir
