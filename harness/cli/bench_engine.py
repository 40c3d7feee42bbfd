"""`moebench bench-engine`: its options; the benchmark itself is moebench.measuring.bench_engine."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from moebench.cli.options import WEIGHTS


def bench_engine_command(

    model: Optional[Path] = typer.Option(None, "--model", help="Checkpoint directory; default: a random 0.89B Qwen3-MoE (8 layers, hidden 1024, 128 experts top-8, width 256, vocab 32000) written to a temp dir."),
    vs: str = typer.Option("transformers", "--vs", help="The engine to compare with: transformers (generate() in this process), llama.cpp (the checkpoint exported to a GGUF of its weight type; see --llama-bench) or moebench (the runtime itself with its float32 LM head: with --lm-head, that head's speedup)."),
    llama_bench: Optional[str] = typer.Option(None, "--llama-bench", help="With --vs llama.cpp, llama.cpp's yardstick: server (llama-server over HTTP), batched (llama-batched-bench, its own in-process decode benchmark) or both (the default), timed in the same interleaved rounds; the ratio is against the faster one."),
    batch: list[int] = typer.Option([1, 16], "--batch", help="Batch sizes to measure (repeat the option)."),
    threads: Optional[list[int]] = typer.Option(None, "--threads", help="Thread counts to measure (repeat the option); default: every core of the machine, the count that measured fastest for both engines at batch 1 and 16 (docs/cpu-decode.md)."),
    prompt_len: int = typer.Option(128, "--prompt-len", help="Prompt tokens per request."),
    new_tokens: int = typer.Option(64, "--new-tokens", help="Greedy tokens generated per request."),
    repeats: int = typer.Option(3, "--repeats", help="Interleaved rounds; medians over rounds are shown."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Override the random model's layer count (smaller = faster)."),
    kernel: str = typer.Option("fused", "--kernel", help="The runtime's MoE kernel (naive = the per-expert loop)."),
    scheduler: str = typer.Option("static", "--scheduler", help="The runtime's scheduler (static or continuous)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="The runtime's weights: f32 or bf16. The random checkpoint is written in it (default f32); with --model, the checkpoint's own type (the default) and no other. llama.cpp gets a GGUF of the same type unless --gguf-dtype says."),
    gguf_dtype: Optional[str] = typer.Option(None, "--gguf-dtype", help="llama.cpp's GGUF weight type: f32, f16, bf16, q8_0 or q4_0 (default: --dtype; q4_0 holds --weights int4's very bytes). f16 has bf16's bytes per weight; take whichever of the two llama.cpp runs faster on the CPU at hand."),
    decode_path: str = typer.Option("native", "--decode-path", help="How the runtime's decode steps run: native (every layer in one C++ call; needs --kernel fused), chained (the C++ ops layer by layer) or eager (each op from Python, no step thread pool)."),
    lm_head: str = typer.Option("f32", "--lm-head", help="The runtime's LM head precision: f32, bf16, int8 or fp8 (weight-only, float32 accumulation; approximate). --vs moebench times it against the float32 head."),
    weights: str = WEIGHTS,
    activations: Optional[str] = typer.Option(None, "--activations", help="What int4 and int8 rows (--weights int4 / int8, --lm-head int8) meet in the kernels: f32 (weight-only, the default) or q8 (each activation row quantized per block of 32 to int8 with a float32 scale, integer dot products, as llama.cpp's Q4_0 / Q8_0 x Q8_0; APPROXIMATE, recorded in the JSON). Same as MOEBENCH_ACTIVATIONS."),
    hf_experts: str = typer.Option("eager", "--hf-experts", help="transformers' expert implementation: eager (its per-expert loop, like kernel=naive) or grouped_mm (its default in v5, a fused path)."),
    hf_huge_pages: bool = typer.Option(True, "--hf-huge-pages/--hf-default-pages", help="Move transformers' weights into huge pages too, as the engine places its own (the like-for-like comparison); --hf-default-pages leaves them where transformers puts them."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the figures, settings and machine as JSON here (a manifest of the benchmark)."),
):
    """Decode tok/s of the bundled runtime against transformers or llama.cpp on one checkpoint, with
    bytes per step, the roofline at the bandwidth measured in the same run, and greedy agreement."""
    from moebench.measuring.bench_engine import bench_engine

    bench_engine(model=model, vs=vs, llama_bench=llama_bench, batch=batch, threads=threads, prompt_len=prompt_len, new_tokens=new_tokens, repeats=repeats, layers=layers, kernel=kernel, scheduler=scheduler, dtype=dtype, gguf_dtype=gguf_dtype, decode_path=decode_path, lm_head=lm_head, weights=weights, hf_experts=hf_experts, hf_huge_pages=hf_huge_pages, out=out, activations=activations)
