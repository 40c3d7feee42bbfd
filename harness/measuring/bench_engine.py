"""`moebench bench-engine`: the bundled runtime against another engine on the same checkpoint,
prompts, batch and greedy settings, timed side by side (interleaved rounds) in one command.

`--vs transformers` (default) times `transformers.generate()` in this process; `--vs llama.cpp`
exports the checkpoint to a GGUF of the same weight type (`moebench export gguf`, `--dtype`: a
bfloat16 checkpoint as BF16, or F16 with `--gguf-dtype f16`) and times llama.cpp (built by
`moebench engines build-llamacpp`) with two yardsticks (`--llama-bench`, both by default):
its `llama-server`, started once per thread count, and its own decode benchmark
`llama-batched-bench` (engines/batched_bench.py), one process per timed cell. Both read their
weights into memory (`--load-mode none`, i.e. no mmap) in huge pages (glibc's malloc asked for
transparent huge pages with GLIBC_TUNABLES=glibc.malloc.hugetlb=1; each one's `AnonHugePages` is
checked and printed) and keep an F32 KV cache, as the runtime keeps its own.

Decode tokens/s for the runtime, transformers and llama-server = batch * (new_tokens - 1) /
(time(new_tokens) - time(1)): the same subtraction of the prefill (and of the HTTP round trip) for
each, so none is measured by a different clock. llama-batched-bench times its own new_tokens - 1
decode steps after its prefill (its S_TG). Each round runs every engine once per (threads, batch),
each going first in turn; the table shows medians over rounds and the median of the per-round
ratios, against the faster llama.cpp yardstick (by its median) when there are two.

Beside the rates: the bytes a decode step must read (the runtime's own step records: its routed
experts' weights, every other weight, the KV cache; for llama.cpp and transformers the same step
with their own weights' bytes: the GGUF's tensors, or transformers' float32 parameters), the read bandwidth measured in the same run
at the same thread count (a 256 MB buffer in huge pages read by the fastest reader at hand, torch's
`sum` or the extension's four-runs read, best of three each: `moebench.measuring.machine`) and the
memory-bandwidth roofline, batch * bandwidth / bytes per step, with each engine's fraction of it.
The bandwidth of these VMs drifts by a third from one minute to the next, so each timed run is
paired with the bandwidth of its own minute: probes are taken between the runs of a round (before
the first, between the two, after the second), a run's roofline is the higher of the probes just
before and just after it, and an engine's fraction is the median over rounds of its runs' paired
fractions. The fraction of the run's best probe (a median rate against the fastest minute, which
drift alone pulls down) is kept beside it. Greedy tokens of every engine are compared with transformers' for the same
prompts (transformers runs once, batched, before any timing, and is then freed).
"""

from __future__ import annotations

import gc
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from rich.console import Console

from moebench.measuring.bench_engine_table import interval_text, print_table  # noqa: F401 (interval_text: pool_bench_engine's)
from moebench.backends.batched_bench import LlamaBatchedBenchSide
from moebench.measuring.bench_engine_q8 import require_q8_ran, side_name, with_activations
from moebench.engine.overrides import Overrides
from moebench.errors import MoebenchError
from moebench.measuring.bench_models import DEFAULT_SHAPE, write_random_model

VS_CHOICES = ("transformers", "llama.cpp", "moebench")
LLAMA_BENCH_CHOICES = ("server", "batched", "both")  # llama.cpp's yardsticks: llama-server, llama-batched-bench
DTYPES = ("f32", "bf16")  # the runtime's weights: a float32 or a bfloat16 checkpoint
MANIFEST_SCHEMA = "moebench.bench-engine/1"


# ------------------------------------------------------------------------------ engines


def collect_garbage_before_timing() -> None:
    """A full garbage collection before an in-process engine's timed run, outside it: a collection
    that the run's own allocations would set off inside it takes tens to hundreds of milliseconds
    with a large model's objects alive, which the decode rate's subtraction (1 token against N)
    turns into a rate far off in either direction."""
    gc.collect()


class BundledSide:
    """The bundled runtime in this process (with an LM head in `lm_head` precision)."""

    def __init__(self, ckpt, kernel: str, scheduler: str, decode_path: str = "native", lm_head: str = "f32",
                 name: str = "moebench", weights: str = "f32", overrides=None):
        self.ckpt, self.kernel, self.scheduler, self.decode_path = ckpt, kernel, scheduler, decode_path
        self.overrides = overrides or Overrides()  # read once by the command (engine/overrides.py)
        self.lm_head, self.name, self.weights = lm_head, name, weights
        self.last_steps: list[dict] = []
        self.last_evidence: dict = {}

    def run(self, prompts: list[list[int]], new_tokens: int, threads: int) -> tuple[float, list[list[int]]]:
        import torch

        from moebench.engine import Engine, Request, RuntimeConfig

        torch.set_num_threads(threads)
        engine = Engine(self.ckpt, None, RuntimeConfig(kernel=self.kernel, scheduler=self.scheduler,
                                                       decode_path=self.decode_path,
                                                       batch_size=len(prompts), max_new_tokens=new_tokens,
                                                       lm_head=self.lm_head, weights=self.weights,
                                                       overrides=self.overrides))
        reqs = [Request(f"r{i}", "", new_tokens) for i in range(len(prompts))]
        collect_garbage_before_timing()
        start = time.perf_counter()
        result = engine.generate(reqs, prompt_ids=prompts)
        seconds = time.perf_counter() - start
        if result.activation_errors:
            raise MoebenchError("bundled runtime: " + "; ".join(result.activation_errors))
        require_q8_ran(self.overrides, result.evidence)  # --activations q8 (approximate): seen where it ran
        self.last_steps, self.last_evidence = result.steps, result.evidence
        return seconds, [c.output_ids for c in result.completions]


class TransformersSide:
    """transformers' generate() in this process (its weights in huge pages, as the runtime's)."""

    name = "transformers"

    def __init__(self, path: Path, experts: str, huge_pages: bool):
        import torch
        from transformers import AutoModelForCausalLM

        from moebench.engine.memory import to_huge_pages

        # transformers 5 runs experts through torch._grouped_mm by default; "eager" is its
        # per-expert loop, the same algorithm as the engine's kernel=naive
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                          experts_implementation=experts).eval()
        if huge_pages:
            for param in self.model.parameters():
                param.data = to_huge_pages(param.data)

    def run(self, prompts: list[list[int]], new_tokens: int, threads: int) -> tuple[float, list[list[int]]]:
        import torch

        torch.set_num_threads(threads)
        ids = torch.tensor(prompts)
        collect_garbage_before_timing()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        seconds = time.perf_counter() - start
        return seconds, out[:, ids.shape[1]:].tolist()


class LlamaServerSide:
    """llama.cpp's llama-server on the checkpoint's GGUF, one server per thread count."""

    name = "llama-server"

    def __init__(self, gguf: Path, max_batch: int, context_per_slot: int, log_dir: Path):
        from moebench.backends.llamacpp import llama_server_path

        self.binary = llama_server_path()
        self.gguf = gguf
        self.slots = max_batch
        self.context = max_batch * context_per_slot
        self.context_per_slot = context_per_slot
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None
        self.threads: int | None = None
        self.url = ""
        self.huge_page_bytes: dict[int, int] = {}
        self.argv: list[str] = []

    def start(self, threads: int) -> None:
        import httpx

        from moebench.backends.server import free_port
        from moebench.processes import die_with_parent

        self.stop()
        port = free_port()
        self.argv = [str(self.binary), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(port),
                     "-t", str(threads), "-tb", str(threads), "--load-mode", "none", "-c", str(self.context),
                     "--parallel", str(self.slots), "--override-kv",
                     f"qwen3moe.context_length=int:{max(self.context_per_slot, 512)}",
                     "-ctk", "f32", "-ctv", "f32", "--cache-ram", "0", "--no-warmup"]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
        log = open(self.log_dir / f"llama-server-t{threads}.log", "wb")
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True,
                                     preexec_fn=lambda: die_with_parent(os.getppid(), signal.SIGKILL))
        log.close()
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                tail = (self.log_dir / f"llama-server-t{threads}.log").read_text(errors="replace").strip()
                raise MoebenchError(f"llama-server exited with code {self.proc.returncode} while loading; its log "
                                    f"ends: {' | '.join(tail.splitlines()[-3:])}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise MoebenchError(f"llama-server not healthy after 300 s (log: {self.log_dir})")
            time.sleep(0.25)
        self.threads = threads
        from moebench.backends.batched_bench import anon_huge_page_bytes

        self.huge_page_bytes[threads] = anon_huge_page_bytes(self.proc.pid)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        self.proc = None

    def _complete(self, prompt: list[int], new_tokens: int) -> list[int]:
        import httpx

        body = {"prompt": prompt, "n_predict": new_tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True, "stream": False}
        response = httpx.post(self.url + "/completion", json=body, timeout=600.0)
        if response.status_code != 200:
            raise MoebenchError(f"llama-server answered {response.status_code}: {response.text[:200]}")
        return list(response.json().get("tokens") or [])

    def run(self, prompts: list[list[int]], new_tokens: int, threads: int) -> tuple[float, list[list[int]]]:
        if self.threads != threads or self.proc is None:
            self.start(threads)
        with ThreadPoolExecutor(len(prompts)) as pool:
            start = time.perf_counter()
            tokens = list(pool.map(lambda p: self._complete(p, new_tokens), prompts))
            seconds = time.perf_counter() - start
        return seconds, tokens


# ------------------------------------------------------------------------------ measuring


def decode_rate(batch: int, new_tokens: int, short_s: float, long_s: float) -> float:
    """Decode tokens/s from a run of 1 and a run of `new_tokens` tokens per request (NaN where the
    longer run was not slower: noise larger than the decode time, nothing to report)."""
    return batch * (new_tokens - 1) / (long_s - short_s) if long_s > short_s else float("nan")


def step_timed_rate(steps: list[dict]) -> float:
    """Decode tokens/s by the runtime's own clock: the tokens its decode steps emitted over the time
    those steps took (NaN without a decode step). The cross-check of decode_rate's subtraction, which
    also counts what a run does around its steps (setting up, collecting garbage)."""
    decode = [s for s in steps if s["phase"] == "decode"]
    seconds = sum(s["duration_s"] for s in decode)
    return sum(s["decode_tokens"] for s in decode) / seconds if seconds > 0 else float("nan")


STEP_TIMED_TOLERANCE = 0.15  # a round's subtraction this far off its step-timed rate is called out


def step_timed_disagreements(rows: list[dict]) -> list[str]:
    """A line per in-process engine's round whose subtraction rate is off its step-timed rate by more
    than STEP_TIMED_TOLERANCE: something outside the steps (another process, a pause) moved it."""
    lines = []
    for row in rows:
        for name, e in row["engines"].items():
            for i, (rate, timed) in enumerate(zip(e["decode_tok_s_rounds"], e.get("decode_tok_s_step_timed_rounds", []))):
                if math.isfinite(rate) and math.isfinite(timed) and abs(rate / timed - 1) > STEP_TIMED_TOLERANCE:
                    lines.append(f"{name}, {row['threads']} thread(s), batch {row['batch']}, round {i + 1}: "
                                 f"{rate:.1f} tok/s by subtraction against {timed:.1f} by its own step times")
    return lines


def decode_bytes_per_step(steps: list[dict]) -> float:
    """Mean bytes read per decode step, from the runtime's step records."""
    decode = [s["bytes_read"] for s in steps if s["phase"] == "decode"]
    if not decode:
        raise MoebenchError("the measured run had no decode step (use --new-tokens >= 2)")
    return sum(decode) / len(decode)


def step_weight_bytes(ckpt, lm_head: str = "f32") -> tuple[int, int]:
    """(bytes of the weights every decode step reads besides the routed experts, bytes of one expert),
    as the runtime holds them (a bfloat16 checkpoint's stay bfloat16 on the CPU; --weights int8: the
    int8 rows with their scales, engine/quantize.py weights_in), the LM head in `lm_head` precision."""
    from moebench.engine.families import non_expert_bytes_per_step
    from moebench.engine.quantize import lm_head_bytes

    layer = next(layer for layer in ckpt.layers if layer.w13 is not None)
    V, H = ckpt.lm_head.shape
    head = lm_head_bytes(V, H, lm_head, 4) - V * H * ckpt.lm_head.element_size() if lm_head != "f32" else 0
    return non_expert_bytes_per_step(ckpt, 4) + head, (layer.w13[0].nbytes + layer.w2[0].nbytes)


def gguf_weight_bytes(path: Path, cfg) -> tuple[int, int]:
    """The same two figures for a GGUF file, from its tensors' sizes (attention projections and the
    output matrix, as the runtime counts them; the experts of every layer over their number)."""
    from gguf import GGUFReader

    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    dense = sum(n for name, n in sizes.items()
                if name.startswith("blk.") and name.split(".")[2] in ("attn_q", "attn_k", "attn_v", "attn_output"))
    dense += sizes.get("output.weight", sizes["token_embd.weight"])  # a tied head reads the embeddings
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    experts = sum(n for name, n in sizes.items() if name.endswith("_exps.weight"))
    return dense, experts // (cfg.num_experts * moe_layers)


def float32_weight_bytes(ckpt) -> tuple[int, int]:
    """The same two figures for float32 weights (transformers' copy of the checkpoint)."""
    cfg = ckpt.config
    attn = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    return 4 * (cfg.num_layers * attn + cfg.vocab_size * cfg.hidden_size), cfg.expert_param_count * 4


def other_bytes_per_step(steps: list[dict], ours: tuple[int, int], theirs: tuple[int, int], moe_layers: int) -> float:
    """Mean bytes per decode step of another engine running the same steps (the same distinct experts
    per layer and KV cache) with its own weights' bytes: the runtime's step bytes with its weights
    swapped for the other engine's."""
    decode = [s for s in steps if s["phase"] == "decode"]
    if not decode:
        raise MoebenchError("the measured run had no decode step (use --new-tokens >= 2)")
    swapped = [s["bytes_read"] - ours[0] + theirs[0] + s["distinct_experts"] * moe_layers * (theirs[1] - ours[1])
               for s in decode]
    return sum(swapped) / len(swapped)


def identical_count(tokens: list[list[int]], reference: list[list[int]]) -> int:
    return sum(list(a) == list(b) for a, b in zip(tokens, reference))


def first_difference(tokens: list[list[int]], reference: list[list[int]]) -> list[int | None]:
    """Per sequence, the index of the first token that differs from the reference (None: none)."""
    out = []
    for a, b in zip(tokens, reference):
        out.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                        None if len(a) == len(b) else min(len(a), len(b))))
    return out


def round_interval(values: list[float]) -> dict:
    """The geometric mean of per-round values (ratios, roofline fractions) and its 95% Student t
    interval on their logs, as `moebench run` gives its speedups: how far one run's figure can be
    trusted when a cell's rounds spread by a third from minute to minute."""
    from moebench.results import stats

    centre, (low, high) = stats.trial_interval(values)  # NaN rounds (no decode time) left out
    if not math.isfinite(low):  # fewer than two usable rounds
        return {"geomean": None, "ci95": None}
    return {"geomean": centre, "ci95": [low, high]}


def _median(values: list[float]) -> float:  # of the rounds that measured (a failed subtraction is nan)
    return statistics.median(finite) if (finite := [v for v in values if math.isfinite(v)]) else float("nan")


def _or_lowest(value: float) -> float:
    return value if math.isfinite(value) else -math.inf


def bench_engine(
    model: Optional[Path],
    vs: str,
    llama_bench: Optional[str],
    batch: list[int],
    threads: Optional[list[int]],
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    layers: Optional[int],
    kernel: str,
    scheduler: str,
    dtype: Optional[str],
    gguf_dtype: Optional[str],
    decode_path: str,
    lm_head: str,
    weights: str,
    hf_experts: str,
    hf_huge_pages: bool,
    out: Optional[Path], activations: Optional[str] = None) -> None:
    """Decode tok/s of the bundled runtime against transformers or llama.cpp on one checkpoint, with
    bytes per step, the roofline at the bandwidth measured in the same run, and greedy agreement."""
    if vs not in VS_CHOICES:
        raise MoebenchError(f"--vs {vs!r}: choose from {', '.join(VS_CHOICES)}")
    if new_tokens < 2:
        raise MoebenchError(f"--new-tokens must be >= 2 (decode is timed as 1 token against N), got {new_tokens}")
    if repeats < 1 or prompt_len < 1 or any(b < 1 for b in batch):
        raise MoebenchError("--repeats, --prompt-len and --batch must be >= 1")
    if kernel not in ("naive", "fused") or scheduler not in ("static", "continuous"):
        raise MoebenchError(f"--kernel {kernel!r} / --scheduler {scheduler!r}: expected naive|fused, static|continuous")
    if lm_head not in ("f32", "bf16", "int8", "fp8"):
        raise MoebenchError(f"--lm-head {lm_head!r}: choose from f32, bf16, int8, fp8")
    if llama_bench is not None and (vs != "llama.cpp" or llama_bench not in LLAMA_BENCH_CHOICES):
        raise MoebenchError(f"--llama-bench {llama_bench!r}: choose from {', '.join(LLAMA_BENCH_CHOICES)}, with --vs llama.cpp")
    if vs == "moebench" and lm_head == "f32" and weights == "f32":
        raise MoebenchError("--vs moebench times the runtime against its checkpoint's own weights: give --lm-head "
                            "bf16, int8 or fp8, or --weights int8")
    if weights not in ("f32", "int8", "int4"):
        raise MoebenchError(f"--weights {weights!r}: choose from f32, int8, int4")
    default_threads = threads is None or not threads
    thread_counts = sorted(set(threads)) if not default_threads else [default_thread_count()]
    if any(t < 1 for t in thread_counts):
        raise MoebenchError(f"--threads must be >= 1, got {thread_counts}")
    if model is not None and not (model / "config.json").is_file():
        raise MoebenchError(f"--model {model}: no config.json there")
    from moebench.models.export_gguf import WEIGHT_DTYPES

    if dtype is not None and dtype not in DTYPES:
        raise MoebenchError(f"--dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    if gguf_dtype is not None and gguf_dtype not in WEIGHT_DTYPES:
        raise MoebenchError(f"--gguf-dtype {gguf_dtype!r}: choose from {', '.join(WEIGHT_DTYPES)}")

    import torch  # here, not at the top: `moebench --help` imports this module

    from moebench.engine import load_checkpoint
    from moebench.measuring.machine import describe_machine, git_commit, package_versions, read_bandwidth_by_reader
    from moebench.models.random import write_char_tokenizer

    console = Console(width=None if sys.stdout.isatty() else 160)
    commit = git_commit()  # the code the run starts with (the extension is built from it)
    batches = sorted(set(batch))
    with tempfile.TemporaryDirectory(prefix="moebench-bench-engine-") as tmp:
        tmp = Path(tmp)
        path = model
        if path is None:
            with console.status(f"writing a random Qwen3-MoE checkpoint ({dtype or 'f32'})"):
                path = write_random_model(tmp / "model", dtype, layers)
                if vs == "llama.cpp":  # the GGUF export carries a tokenizer; a character one will do
                    write_char_tokenizer(path, DEFAULT_SHAPE["vocab_size"])
        # experts as the store holds them on the CPU (a bfloat16 checkpoint's stay bfloat16), as `run` loads
        overrides = with_activations(Overrides.from_environment(os.environ), activations, weights, lm_head)  # read once, here
        ckpt = load_checkpoint(path, experts_in_checkpoint_dtype=True, overrides=overrides)
        held = {torch.float32: "f32", torch.bfloat16: "bf16"}.get(ckpt.checkpoint_dtype)
        if held is None or (dtype is not None and dtype != held):
            raise MoebenchError(f"--model {path}: the checkpoint's weights are {ckpt.checkpoint_dtype}, not --dtype "
                                f"{dtype} (the runtime computes with the checkpoint's own; choose from {', '.join(DTYPES)})")
        dtype, gguf_dtype = held, gguf_dtype or held
        from moebench.engine.quantize import weights_in

        our_weights = their_weights = step_weight_bytes(weights_in(ckpt, weights), lm_head)
        moe_layers = sum(ckpt.config.is_moe_layer(i) for i in range(ckpt.config.num_layers))
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(1, ckpt.config.vocab_size, (max(batches), prompt_len), generator=g).tolist()

        # transformers' greedy tokens for every prompt, once, batched, before any timing
        with console.status("transformers: greedy reference tokens"):
            hf = TransformersSide(path, hf_experts, hf_huge_pages)
            _, reference = hf.run(prompts, new_tokens, max(thread_counts))
        if vs == "moebench":  # the same runtime with the checkpoint's own (float32) LM head
            del hf
            gc.collect()
            others = [BundledSide(ckpt, kernel, scheduler, decode_path, "f32", overrides=overrides,
                                  name="moebench f32 head" if weights == "f32" else f"moebench {dtype}")]
        elif vs == "llama.cpp":
            del hf
            gc.collect()
            from moebench.models.export_gguf import export_gguf

            with console.status(f"exporting the checkpoint to a {gguf_dtype.upper()} GGUF"):
                gguf = export_gguf(path, tmp / f"model-{gguf_dtype}.gguf", gguf_dtype)
            llama_bench = llama_bench or "both"
            others = ([LlamaServerSide(gguf, max(batches), prompt_len + new_tokens + 8, tmp)]
                      if llama_bench in ("server", "both") else [])
            others += [LlamaBatchedBenchSide(gguf, prompt_len)] if llama_bench in ("batched", "both") else []
            their_weights = gguf_weight_bytes(gguf, ckpt.config)  # every llama.cpp yardstick reads the same GGUF
        else:
            others = [hf]
            their_weights = float32_weight_bytes(ckpt)
        server = next((o for o in others if isinstance(o, LlamaServerSide)), None)
        batched_bench = next((o for o in others if isinstance(o, LlamaBatchedBenchSide)), None)
        bundled = BundledSide(ckpt, kernel, scheduler, decode_path, lm_head, weights=weights, overrides=overrides,
                              name="moebench" + (f" {weights}" if weights != "f32" else "") + side_name(overrides)
                              + (f" {lm_head} head" if lm_head != "f32" else ""))

        rows = []
        try:
            for t in thread_counts:
                torch.set_num_threads(t)
                readers: list[dict[str, float]] = []  # each probe's GB/s by reader, in the order taken
                sides = [bundled, *others]
                figures = {(b, side.name): {"rates": [], "bandwidths": [], "tokens": None}
                           for b in batches for side in sides}
                # bytes a decode step reads, by the runtime's own step records (each side of --vs moebench its own)
                bytes_per_step = {(b, side.name): [] for b in batches for side in sides}
                # llama.cpp's or transformers': the runtime's steps with their weights' bytes
                swapped_bytes: dict[int, list[float]] = {b: [] for b in batches}
                for b in batches:  # warm-up: first touches, the server's start (batched-bench warms itself up)
                    for side in sides:
                        if not isinstance(side, LlamaBatchedBenchSide):
                            side.run(prompts[:b], 2, t)
                def probe() -> float:
                    torch.set_num_threads(t)
                    readers.append(read_bandwidth_by_reader())
                    return max(readers[-1].values())

                for round_ in range(repeats):
                    for b in batches:
                        shift = (round_ + b) % len(sides)  # each engine goes first in turn
                        order = sides[shift:] + sides[:shift]
                        before = probe()
                        for side in order:
                            if not isinstance(side, LlamaBatchedBenchSide):
                                short_s, _ = side.run(prompts[:b], 1, t)
                                long_s, tokens = side.run(prompts[:b], new_tokens, t)
                                rate = decode_rate(b, new_tokens, short_s, long_s)
                            else:  # llama-batched-bench times its own decode steps
                                rate, tokens = side.decode_rate(b, new_tokens, t), None
                            after = probe()
                            cell = figures[(b, side.name)]
                            cell["rates"].append(rate)
                            cell["bandwidths"].append(max(before, after))
                            cell["tokens"] = tokens
                            if isinstance(side, BundledSide):
                                bytes_per_step[(b, side.name)].append(decode_bytes_per_step(side.last_steps))
                                cell.setdefault("step_rates", []).append(step_timed_rate(side.last_steps))
                            if side is bundled and not isinstance(others[0], BundledSide):
                                swapped_bytes[b].append(other_bytes_per_step(side.last_steps, our_weights,
                                                                             their_weights, moe_layers))
                            before = after
                best = max(max(r.values()) for r in readers)
                for b in batches:
                    mine = figures[(b, bundled.name)]
                    step_bytes = _median(bytes_per_step[(b, bundled.name)])
                    # the runtime with another LM head counts its own steps; another engine reads the
                    # runtime's steps in its own weights' bytes (other_bytes_per_step)
                    other_bytes = _median(bytes_per_step[(b, others[0].name)] if isinstance(others[0], BundledSide)
                                          else swapped_bytes[b])
                    bandwidth = _median([gb for side in sides for gb in figures[(b, side.name)]["bandwidths"]])
                    ratios = {o.name: [m / r for m, r in zip(mine["rates"], figures[(b, o.name)]["rates"])]
                              for o in others}
                    # the ratio that counts is against the faster yardstick, by its median rate
                    against = max(others, key=lambda o: _or_lowest(_median(figures[(b, o.name)]["rates"]))).name

                    def engine_row(cell, step_bytes):
                        fractions = [rate * step_bytes / (b * gb_s * 1e9)
                                     for rate, gb_s in zip(cell["rates"], cell["bandwidths"])]
                        tokens = cell["tokens"]  # None: llama-batched-bench decodes random tokens
                        return {"bytes_per_step": step_bytes, "decode_tok_s": _median(cell["rates"]), "decode_tok_s_rounds": cell["rates"],
                                "bandwidth_gb_s_rounds": cell["bandwidths"], "roofline_fraction_rounds": fractions,
                                "roofline_fraction": _median(fractions),
                                "roofline_fraction_interval": round_interval(fractions),
                                "roofline_fraction_of_best_probe": _median(cell["rates"]) * step_bytes / (b * best * 1e9),
                                "greedy_identical_to_transformers": None if tokens is None else identical_count(tokens, reference[:b]),
                                "first_difference": None if tokens is None else first_difference(tokens, reference[:b]),
                                **({"decode_tok_s_step_timed": _median(cell["step_rates"]),
                                    "decode_tok_s_step_timed_rounds": cell["step_rates"]} if "step_rates" in cell else {})}

                    rows.append({
                        "threads": t, "batch": b, "bytes_per_step": step_bytes, "bandwidth_gb_s": bandwidth,
                        "best_bandwidth_gb_s": best, "bandwidth_by_reader_probes": readers,
                        "roofline_tok_s": b * bandwidth * 1e9 / step_bytes,
                        **({"other_bytes_per_step": other_bytes} if other_bytes != step_bytes else {}),
                        "engines": {bundled.name: engine_row(mine, step_bytes),
                                    **{o.name: engine_row(figures[(b, o.name)], other_bytes) for o in others}},
                        "ratio_median": _median(ratios[against]), "ratio_rounds": ratios[against],
                        "ratio_interval": round_interval(ratios[against]), "ratio_against": against,
                        **({"ratios": {name: {"median": _median(r), "rounds": r, "interval": round_interval(r)}
                                       for name, r in ratios.items()}} if len(others) > 1 else {}),
                    })
        finally:
            if server is not None:
                server.stop()

        vs_name = "llama.cpp" if vs == "llama.cpp" else others[0].name
        weight_note = f"{bundled.name} {dtype if weights == 'f32' else weights}, {vs_name} " + (
            gguf_dtype if vs == "llama.cpp" else "f32" if isinstance(others[0], TransformersSide) else dtype)
        print_table(console, rows, ckpt, prompt_len, new_tokens, repeats, others, bundled, weight_note)
        for line in step_timed_disagreements(rows):
            console.print(line, markup=False, highlight=False)
        if out is not None:
            from moebench.fileio import atomic_write_json

            manifest = {
                "schema": MANIFEST_SCHEMA, "git_commit": commit, "versions": package_versions(),
                "vs": vs, "model": str(model) if model else "random qwen3_moe",
                "params": ckpt.num_params, "prompt_len": prompt_len, "new_tokens": new_tokens, "repeats": repeats,
                "dtype": dtype, "dense_dtype": str(ckpt.dense_dtype).replace("torch.", ""),
                "gguf_dtype": gguf_dtype if vs == "llama.cpp" else None, "llama_bench": llama_bench,
                "kernel": kernel, "scheduler": scheduler, "decode_path": decode_path, "lm_head": lm_head, "weights": weights, "activations": overrides.activations, "overrides": overrides.to_dict(), "batches": batches, "threads": thread_counts,
                "threads_default": default_threads, "threads_reason": THREADS_REASON if default_threads else "given",
                "machine": describe_machine(measure_bandwidth=False),
                "runtime_evidence": bundled.last_evidence,
                "llama_server": ({"argv": server.argv, "huge_page_bytes": server.huge_page_bytes}
                                 if server is not None else None),
                "llama_batched_bench": ({"argv": batched_bench.argv, "huge_page_bytes": batched_bench.huge_page_bytes,
                                         "runs": batched_bench.runs} if batched_bench is not None else None),
                "rows": rows,
            }
            atomic_write_json(out, manifest)
            console.print(f"wrote {out}")


THREADS_REASON = ("every core: with the step's thread pool (kernels/csrc/dense_cpu.cpp) the decode step measured "
                  "faster with 2 threads than with 1 at batch 1 and 16 on the 2-core machine (docs/cpu-decode.md), "
                  "and llama.cpp's fastest setting was also every core")


def default_thread_count() -> int:
    """Every core this process may run on (see THREADS_REASON)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
