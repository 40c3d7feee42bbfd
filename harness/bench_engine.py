"""`moebench bench-engine`: the engine against `transformers.generate()` on the same checkpoint,
prompts, batch and greedy settings, timed side by side (interleaved) in one process.

Decode tokens/s for both = batch * (new_tokens - 1) / (time(new_tokens) - time(1)): the same
subtraction of the prefill for each, so neither side is measured by a different clock.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table


DEFAULT_SHAPE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                     head_dim=64, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=256,
                     intermediate_size=2048, vocab_size=32000)


def _time_engine(engine, prompts, new_tokens: int) -> float:
    from moebench.engine import Request

    engine.runtime = engine.runtime.__class__(**{**engine.runtime.__dict__, "max_new_tokens": new_tokens})
    reqs = [Request(f"r{i}", "", new_tokens) for i in range(len(prompts))]
    start = time.perf_counter()
    engine.generate(reqs, prompt_ids=prompts)
    return time.perf_counter() - start


def _time_hf(model, prompts, new_tokens: int) -> float:
    import torch

    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def bench_engine_command(
    model: Optional[Path] = typer.Option(None, "--model", help="Checkpoint directory; default: a random 0.89B Qwen3-MoE (8 layers, hidden 1024, 128 experts top-8, width 256, vocab 32000) written to a temp dir."),
    batch: list[int] = typer.Option([1, 16], "--batch", help="Batch sizes to measure (repeat the option)."),
    prompt_len: int = typer.Option(128, "--prompt-len", help="Prompt tokens per request."),
    new_tokens: int = typer.Option(64, "--new-tokens", help="Greedy tokens generated per request."),
    repeats: int = typer.Option(2, "--repeats", help="Interleaved repetitions; the best time of each side is kept."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Override the random model's layer count (smaller = faster)."),
    kernel: str = typer.Option("naive", "--kernel", help="Engine MoE kernel to measure (naive = the baseline)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch threads (default: torch's choice)."),
    hf_experts: str = typer.Option("eager", "--hf-experts", help="transformers' expert implementation: eager (its per-expert loop, like kernel=naive) or grouped_mm (its default in v5, a fused path)."),
    hf_huge_pages: bool = typer.Option(True, "--hf-huge-pages/--hf-default-pages", help="Move transformers' weights into huge pages too, as the engine places its own (the like-for-like comparison); --hf-default-pages leaves them where transformers puts them."),
):
    """Measure decode tok/s of the engine and of transformers' generate() on one checkpoint."""
    import torch  # here, not at the top: `moebench --help` imports this module
    from transformers import AutoModelForCausalLM

    from moebench.random_models import make_random_qwen3_moe

    from moebench.engine import Engine, RuntimeConfig, load_checkpoint
    from moebench.engine.memory import to_huge_pages

    if threads:
        torch.set_num_threads(threads)
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        path = model
        if path is None:
            overrides = {"num_hidden_layers": layers} if layers else {}
            with console.status("writing a random Qwen3-MoE checkpoint"):
                path = make_random_qwen3_moe(Path(tmp) / "model", {**DEFAULT_SHAPE, **overrides}, pad_token_id=0)
        ckpt = load_checkpoint(path)
        # transformers 5 runs experts through torch._grouped_mm by default; "eager" is its
        # per-expert loop, the same algorithm as the engine's kernel=naive
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation=hf_experts).eval()
        if hf_huge_pages:
            for param in hf.parameters():
                param.data = to_huge_pages(param.data)
        g = torch.Generator().manual_seed(0)
        pages = "huge pages on both sides" if hf_huge_pages else "engine in huge pages, transformers in default pages"
        table = Table(title=f"decode tok/s, {ckpt.num_params / 1e9:.2f}B params, prompt {prompt_len}, "
                            f"{new_tokens} new tokens, {pages}")
        for col in ("batch", f"transformers ({hf_experts})", f"engine ({kernel})", "ratio"):
            table.add_column(col, justify="right")
        for b in batch:
            prompts = torch.randint(1, ckpt.config.vocab_size, (b, prompt_len), generator=g).tolist()
            engine = Engine(ckpt, None, RuntimeConfig(kernel=kernel, batch_size=b, max_new_tokens=new_tokens))
            best = {"hf": [float("inf")] * 2, "engine": [float("inf")] * 2}
            _time_engine(engine, prompts, 2)  # warm-up both sides
            _time_hf(hf, prompts, 2)
            for _ in range(repeats):
                for side, fn, target in (("engine", _time_engine, engine), ("hf", _time_hf, hf)):
                    for i, n in enumerate((1, new_tokens)):
                        best[side][i] = min(best[side][i], fn(target, prompts, n))
            rate = {s: b * (new_tokens - 1) / max(t[1] - t[0], 1e-9) for s, t in best.items()}
            table.add_row(str(b), f"{rate['hf']:.1f}", f"{rate['engine']:.1f}", f"{rate['engine'] / rate['hf']:.2f}x")
        console.print(table)
