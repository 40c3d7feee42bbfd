"""bench-engine's printed table: the runtime against one engine, or against several yardsticks of
one engine (llama.cpp's llama-server and llama-batched-bench), one column of rates and of roofline
fractions per engine, the ratio against the faster yardstick."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def interval_text(interval: dict, unit: str) -> str:
    """A round_interval as "geomean [low, high]", unit "x" (ratios) or "%" (fractions)."""
    if interval["ci95"] is None:
        return "n/a"
    values = [interval["geomean"], *interval["ci95"]]
    if unit == "%":
        return "{:.0%} [{:.0%}, {:.0%}]".format(*values)
    return "{:.2f}x [{:.2f}, {:.2f}]".format(*values)


def _greedy(engine: dict, batch: int) -> str:
    identical = engine["greedy_identical_to_transformers"]
    return "n/a" if identical is None else f"{identical}/{batch}"


def print_table(console: Console, rows: list[dict], ckpt, prompt_len: int, new_tokens: int, repeats: int,
                others: list, bundled, weights: str) -> None:
    names = [o.name for o in others]
    several = len(names) > 1
    table = Table(title=f"decode tok/s (median of {repeats} interleaved rounds), {ckpt.num_params / 1e9:.2f}B params, "
                        f"prompt {prompt_len}, {new_tokens} new tokens, greedy; weights: {weights}")
    # several yardsticks read the same weights: one MB/step column for them
    for col in ("threads", "batch", bundled.name, *names, "ratio (vs faster)" if several else "ratio",
                f"{bundled.name} MB/step", "llama.cpp MB/step" if several else f"{names[0]} MB/step", "read GB/s",
                f"{bundled.name} roofline", f"{bundled.name} % roof", *(f"{n} % roof" for n in names),
                "greedy = transformers"):
        table.add_column(col, justify="right")
    for r in rows:
        mine, theirs = r["engines"][bundled.name], [r["engines"][n] for n in names]
        ratio = f"{r['ratio_median']:.2f}x"  # with several yardsticks, which one is said under the table
        table.add_row(
            str(r["threads"]), str(r["batch"]), f"{mine['decode_tok_s']:.1f}", *(f"{e['decode_tok_s']:.1f}" for e in theirs),
            ratio, f"{r['bytes_per_step'] / 1e6:.0f}", f"{theirs[0]['bytes_per_step'] / 1e6:.0f}",
            f"{r['bandwidth_gb_s']:.1f}", f"{r['roofline_tok_s']:.1f}", f"{mine['roofline_fraction']:.0%}",
            *(f"{e['roofline_fraction']:.0%}" for e in theirs),
            ", ".join(_greedy(e, r["batch"]) for e in (mine, *theirs)))
    console.print(table)
    console.print("read GB/s: median of the probes taken beside the timed runs; % roof: median over rounds of each "
                  "run's rate against the probes just before and after it. Against the run's best probe: " + "; ".join(
                      f"{r['threads']}t b{r['batch']} "
                      + " / ".join(f"{r['engines'][n]['roofline_fraction_of_best_probe']:.0%}" for n in (bundled.name, *names))
                      + f" ({r['best_bandwidth_gb_s']:.1f} GB/s)" for r in rows) + f" ({' / '.join((bundled.name, *names))})")
    if several:
        console.print("ratio against each yardstick (median of the per-round ratios; * the faster one, the ratio "
                      "in the table): " + "; ".join(
                          f"{r['threads']}t b{r['batch']} " + ", ".join(
                              f"{n}{'*' if n == r['ratio_against'] else ''} {r['ratios'][n]['median']:.2f}x" for n in names)
                          for r in rows))
    if repeats >= 2:
        console.print(f"95% intervals over the {repeats} rounds (Student t on the logs of the per-round values; "
                      "geometric mean [low, high]): " + "; ".join(
                          f"{r['threads']}t b{r['batch']} ratio {interval_text(r['ratio_interval'], 'x')}, "
                          f"{bundled.name} % roof {interval_text(r['engines'][bundled.name]['roofline_fraction_interval'], '%')}"
                          for r in rows), markup=False)  # "[low, high]" is text, not a style tag
    for other in others:  # llama-server's argv, or llama-batched-bench's last one
        if getattr(other, "huge_page_bytes", None):
            argv = other.last_argv if hasattr(other, "last_argv") else other.argv
            pages = ", ".join(f"{t} threads: {b / 2**30:.2f} GiB" for t, b in sorted(other.huge_page_bytes.items()))
            console.print(f"{other.name} in huge pages (AnonHugePages, the most seen): {pages}; argv: {' '.join(argv[3:])}")
