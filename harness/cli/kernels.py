"""`moebench kernels`: MoE-layer microbenchmark (naive vs fused) and Triton config tuning.

`bench` times one MoE layer (routing excluded) at model shapes, naive (`moe_reference`, the
per-expert loop) against the fused kernel, interleaving the two so that machine noise hits
both alike. Every call draws a fresh routing from the same distribution, so the weights are
read from memory as in decode (where the next layer has other weights), not from cache.
Achieved bandwidth = bytes of the distinct experts' weights the call touched / time; it is
compared with the read bandwidth measured in the same process (a 256 MB tensor read by torch's
sum and, on the CPU, by the extension's four-runs read, the faster of the two), sampled once per
repeat between the calls; the best sample of a row is the
reference, which is the conservative choice: on a shared machine the bandwidth left to us
drifts, and a multi-threaded torch sum suffers when another process takes one of its cores.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import typer

from moebench.errors import MoebenchError

app = typer.Typer(
    help="MoE kernel microbenchmarks (naive vs fused) and Triton config tuning.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@dataclass(frozen=True)
class LayerShape:
    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    scoring: str = "softmax"  # or "sigmoid" (grouped, DeepSeek-V3 / Ling style)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def expert_bytes(self, itemsize: int) -> int:
        return 3 * self.hidden * self.inter * itemsize


SHAPES = {
    "qwen3-30b-a3b": LayerShape("qwen3-30b-a3b", experts=128, top_k=8, hidden=2048, inter=768),
    "ling-3.0-flash": LayerShape(
        "ling-3.0-flash", experts=512, top_k=8, hidden=2560, inter=768,
        scoring="sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5,
    ),
}

DTYPES = {"float32", "bfloat16", "float16"}


def _parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise MoebenchError(f"--{what}: expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise MoebenchError(f"--{what}: expected positive integers, got {text!r}")
    return values


def _custom_shape(text: str) -> LayerShape:
    """`experts=16,top_k=2,hidden=64,inter=32` (softmax routing): any other model's layer."""
    fields = {"experts", "top_k", "hidden", "inter"}
    try:
        values = {key.strip(): int(value) for key, value in (part.split("=") for part in text.split(","))}
    except ValueError:
        values = {}
    if set(values) != fields or min(values.values()) <= 0 or values["top_k"] > values["experts"]:
        raise MoebenchError(
            f"--shape: {text!r} is neither a known shape ({', '.join(SHAPES)}) nor "
            "experts=E,top_k=K,hidden=H,inter=I with positive integers and K <= E"
        )
    return LayerShape(f"E{values['experts']}k{values['top_k']}H{values['hidden']}I{values['inter']}", **values)


def _resolve_shapes(names: list[str] | None) -> list[LayerShape]:
    return [SHAPES[n.lower()] if n.lower() in SHAPES else _custom_shape(n) for n in (names or list(SHAPES))]


def _available_memory_bytes(device) -> int:
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def _fit_experts(shape: LayerShape, itemsize: int, budget: int) -> int:
    """Largest expert count <= shape.experts whose weights fit the budget, kept a multiple of
    the routing groups so that group-limited routing still applies."""
    per = shape.expert_bytes(itemsize)
    fit = min(shape.experts, budget // per)
    step = shape.n_group if shape.n_group > 1 else 1
    fit = fit // step * step
    if fit < max(shape.top_k, step):
        raise MoebenchError(
            f"{shape.name}: not enough memory for even {max(shape.top_k, step)} experts "
            f"({per / 1e6:.0f} MB each, budget {budget / 1e9:.1f} GB)"
        )
    return int(fit)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ReadBandwidth:
    """GB/s of a 256 MB float32 tensor read by the fastest reader at hand (torch's sum; on the CPU
    also the extension's four-runs read, as `moebench.measuring.machine` probes), sampled on demand. The
    buffer sits in the same kind of pages as the weights (huge pages on the CPU, see engine/memory.py)."""

    def __init__(self, device, megabytes: int = 256):
        import torch

        from moebench.engine import memory
        from moebench.measuring.machine import bandwidth_readers

        self.device = device
        self.buffer = memory.empty((megabytes * (1 << 20) // 4,), torch.float32, device).fill_(1.0)
        self.readers = bandwidth_readers(self.buffer)
        for read in self.readers.values():
            read()
        self.samples: list[float] = []

    def sample(self) -> float:
        best = 0.0
        for read in self.readers.values():
            _sync(self.device)
            t = time.perf_counter()
            read()
            _sync(self.device)
            best = max(best, self.buffer.numel() * 4 / (time.perf_counter() - t) / 1e9)
        self.samples.append(best)
        return best


def _route(shape: LayerShape, n: int, experts: int, device, gen):
    import torch

    from moebench.kernels import route_grouped_sigmoid, route_softmax_topk

    logits = torch.randn(n, experts, generator=gen, device="cpu").to(device)
    if shape.scoring == "sigmoid":
        bias = torch.zeros(experts, device=device)
        return route_grouped_sigmoid(
            logits, bias, shape.top_k, shape.n_group, shape.topk_group, True, shape.routed_scaling_factor
        )
    return route_softmax_topk(logits, shape.top_k, True)


@dataclass
class BenchRow:
    shape: str
    experts: int
    tokens: int
    distinct_experts: float
    naive_ms: float
    fused_ms: float
    speedup: float
    fused_gb_s: float
    fused_frac_bw: float
    naive_gb_s: float
    read_bandwidth_gb_s: float
    naive_best_ms: float = 0.0
    fused_best_ms: float = 0.0
    speedup_best: float = 0.0


def run_bench(
    shapes: list[LayerShape],
    tokens: list[int],
    repeats: int,
    dtype_name: str,
    device_name: str,
    memory_fraction: float = 0.3,
    log=print,
) -> tuple[dict, list[BenchRow]]:
    import torch

    from moebench import kernels
    from moebench.engine import memory

    device = torch.device(device_name)
    dtype = getattr(torch, dtype_name)
    itemsize = torch.empty((), dtype=dtype).element_size()
    fused = kernels.fused_moe
    backend = kernels.fused_backend(device_name)
    bandwidth = ReadBandwidth(device)
    for _ in range(3):
        bandwidth.sample()
    info = {
        "device": device_name,
        "dtype": dtype_name,
        "threads": torch.get_num_threads(),
        "fused_backend": backend,
        "read_bandwidth_gb_s": None,  # filled in at the end: the best sample
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "repeats": repeats,
        "notes": [],
    }
    rows: list[BenchRow] = []
    gen = torch.Generator().manual_seed(0)
    for shape in shapes:
        budget = int(_available_memory_bytes(device) * memory_fraction)
        experts = _fit_experts(shape, itemsize, budget)
        if experts < shape.experts:
            note = (
                f"{shape.name}: scaled down from {shape.experts} to {experts} experts to fit "
                f"{memory_fraction:.0%} of free memory ({budget / 1e9:.1f} GB); per-call bytes are unchanged "
                f"(top-{shape.top_k} of fewer experts touches slightly fewer distinct experts at large batches)"
            )
            info["notes"].append(note)
            log(note)
        # placed as the engine's loader places them (huge pages on the CPU)
        w13 = memory.empty((experts, 2 * shape.inter, shape.hidden), dtype, device)
        w2 = memory.empty((experts, shape.hidden, shape.inter), dtype, device)
        w13.uniform_(-(shape.hidden**-0.5), shape.hidden**-0.5)
        w2.uniform_(-(shape.inter**-0.5), shape.inter**-0.5)
        per_expert = shape.expert_bytes(itemsize)
        # The first calls of a process are slow for a while (thread teams, allocator and MKL
        # start-up: tens of ms each, even for tiny layers); one warm-up repeat does not cover it.
        started = time.perf_counter()
        while time.perf_counter() - started < 1.0:
            weights, ids = _route(shape, 1, experts, device, gen)
            x = torch.randn(1, shape.hidden, generator=gen).to(device=device, dtype=dtype)
            kernels.moe_reference(x, weights, ids, w13, w2)
            fused(x, weights, ids, w13, w2)
            _sync(device)
        for n in tokens:
            # On CUDA `fused_moe` is the Triton kernel; on CPU the C++ (or grouped torch) path.
            paths = {"naive": kernels.moe_reference, "fused": fused}
            times: dict[str, list[float]] = {p: [] for p in paths}
            gbs: dict[str, list[float]] = {p: [] for p in paths}
            distinct = []
            bw_samples = []
            for rep in range(repeats + 1):  # repeat 0 is warm-up, not recorded
                order = list(paths) if rep % 2 == 0 else list(reversed(paths))
                if rep:
                    bw_samples.append(bandwidth.sample())
                for p in order:
                    # Every call gets its own routing, so it rarely finds the previous call's
                    # experts in cache (in decode, the next layer has different weights).
                    x = (torch.randn(n, shape.hidden, generator=gen) * 0.5).to(device=device, dtype=dtype)
                    weights, ids = _route(shape, n, experts, device, gen)
                    touched = int(torch.unique(ids).numel())
                    _sync(device)
                    t = time.perf_counter()
                    paths[p](x, weights, ids, w13, w2)
                    _sync(device)
                    dt = time.perf_counter() - t
                    if rep:
                        times[p].append(dt)
                        gbs[p].append(touched * per_expert / dt / 1e9)
                        distinct.append(touched)
            naive_ms = statistics.median(times["naive"]) * 1e3
            fused_ms = statistics.median(times["fused"]) * 1e3
            fused_gb_s = statistics.median(gbs["fused"])
            row = BenchRow(
                shape=shape.name,
                experts=experts,
                tokens=n,
                distinct_experts=statistics.mean(distinct),
                naive_ms=naive_ms,
                fused_ms=fused_ms,
                speedup=naive_ms / fused_ms,
                fused_gb_s=fused_gb_s,
                naive_best_ms=min(times["naive"]) * 1e3,
                fused_best_ms=min(times["fused"]) * 1e3,
                speedup_best=min(times["naive"]) / min(times["fused"]),
                fused_frac_bw=fused_gb_s / max(bw_samples),
                read_bandwidth_gb_s=max(bw_samples),
                naive_gb_s=statistics.median(gbs["naive"]),
            )
            rows.append(row)
        del w13, w2
    info["read_bandwidth_gb_s"] = round(max(bandwidth.samples), 2)
    return info, rows


def _print_table(info: dict, rows: list[BenchRow]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # piped output: do not squeeze the table to 80 columns
    load = "" if info["load_average"] is None else f"; load average {info['load_average']:.1f}"
    console.print(
        f"MoE layer on {info['device']} ({info['dtype']}, {info['threads']} threads); fused = {info['fused_backend']}; "
        f"best read bandwidth sampled between calls {info['read_bandwidth_gb_s']:.1f} GB/s{load}; "
        f"median of {info['repeats']} interleaved calls"
    )
    table = Table()
    for col in ("shape", "experts", "tokens", "distinct experts", "naive ms", "fused ms", "speedup",
                "speedup of best times", "fused GB/s", "best read BW", "fused / read BW", "naive GB/s"):
        table.add_column(col, justify="left" if col == "shape" else "right")
    for r in rows:
        table.add_row(
            r.shape, str(r.experts), str(r.tokens), f"{r.distinct_experts:.1f}", f"{r.naive_ms:.2f}",
            f"{r.fused_ms:.2f}", f"{r.speedup:.2f}x", f"{r.speedup_best:.2f}x", f"{r.fused_gb_s:.1f}",
            f"{r.read_bandwidth_gb_s:.1f}",
            f"{r.fused_frac_bw:.0%}",
            f"{r.naive_gb_s:.1f}",
        )
    console.print(table)
    for note in info["notes"]:
        console.print(f"note: {note}")
    cores = os.cpu_count() or 1
    if info["load_average"] is not None and info["load_average"] > cores and info["device"] == "cpu":
        console.print(
            f"warning: the machine is busy (load average {info['load_average']:.1f} on {cores} cores); "
            "multi-threaded torch ops (many small parallel regions in the naive loop) suffer most from "
            "sharing cores, so speedups are inflated and absolute times are not representative. "
            "--threads 1 is less sensitive to this."
        )
    console.print(
        "ms: median per call; speedup of best times: fastest naive / fastest fused call (closest to an idle "
        "machine); GB/s = bytes of the distinct experts' weights a call touches / its time (median)."
    )


@app.command("bench")
def bench_command(
    shape: list[str] = typer.Option(None, "--shape", help=f"Layer shape, repeatable: {', '.join(SHAPES)}, or any layer as \"experts=E, top_k=K, hidden=H, inter=I\" (quoted; default: the named ones)."),
    tokens: str = typer.Option("1,4,16,64,256", "--tokens", help="Comma-separated token counts per call."),
    repeats: int = typer.Option(10, "--repeats", min=1, help="Timed calls per path and token count (after one warm-up)."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda[:n]."),
    threads: int = typer.Option(0, "--threads", help="torch / OpenMP threads on CPU (0: leave as is)."),
    memory_fraction: float = typer.Option(0.3, "--memory-fraction", help="Share of free memory the weights may use."),
    json_out: Path = typer.Option(None, "--json", help="Also write the results to this JSON file."),
) -> None:
    """Time one MoE layer: naive per-expert loop vs the fused kernel (interleaved repeats)."""
    import torch

    if dtype not in DTYPES:
        raise MoebenchError(f"--dtype: expected one of {', '.join(sorted(DTYPES))}, got {dtype!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise MoebenchError(f"--device {device}: CUDA is not available on this machine")
    if not (device == "cpu" or device.startswith("cuda")):
        raise MoebenchError(f"--device: expected cpu or cuda[:n], got {device!r}")
    if threads:
        torch.set_num_threads(threads)
    info, rows = run_bench(
        _resolve_shapes(shape), _parse_ints(tokens, "tokens"), repeats, dtype, device, memory_fraction,
        log=lambda m: typer.echo(m, err=True),
    )
    _print_table(info, rows)
    if json_out:
        from moebench.fileio import atomic_write_json

        atomic_write_json(json_out, {"info": info, "rows": [asdict(r) for r in rows]})


@app.command("tune")
def tune_command(
    shape: list[str] = typer.Option(None, "--shape", help=f"Layer shape, repeatable: {', '.join(SHAPES)} (default: all)."),
    tokens: str = typer.Option(
        "1,2,4,8,16,32,64,128,256,512,1024,2048,4096", "--tokens", help="Token counts to tune for."
    ),
    dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16, float16 or float32."),
    device: str = typer.Option("cuda", "--device", help="CUDA device to tune on."),
    out_dir: Path = typer.Option(None, "--out", help="Directory for the config JSON (default: the package's kernels/configs)."),
    quick: bool = typer.Option(False, "--quick", help="Search a reduced config space."),
) -> None:
    """Search Triton block sizes for the fused MoE kernel on this GPU and write a tuned-config JSON."""
    import torch

    if not device.startswith("cuda"):
        raise MoebenchError("kernels tune: Triton kernels are tuned on a CUDA GPU; use --device cuda")
    if not torch.cuda.is_available():
        raise MoebenchError(
            "kernels tune: needs a CUDA GPU (Triton configs are tuned per GPU); none is available here. "
            "The CPU path has no block sizes to tune."
        )
    if dtype not in DTYPES:
        raise MoebenchError(f"--dtype: expected one of {', '.join(sorted(DTYPES))}, got {dtype!r}")
    from moebench.kernels import triton_tune

    for s in _resolve_shapes(shape):
        path = triton_tune.tune(
            experts=s.experts, hidden=s.hidden, inter=s.inter, top_k=s.top_k, dtype=dtype, device=device,
            token_counts=_parse_ints(tokens, "tokens"), out_dir=out_dir, quick=quick,
            log=lambda m: typer.echo(m, err=True),
        )
        typer.echo(f"{s.name}: wrote {path}")
