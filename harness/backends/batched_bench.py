"""llama.cpp's own decode benchmark, `llama-batched-bench`: its command line and its output table.

`llama-batched-bench` loads a GGUF, decodes a prompt of PP random tokens for each of B sequences,
then TG steps of B tokens each (one per sequence), all inside the process, and prints one
markdown row per (PP, TG, B):

    |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |

(`tools/batched-bench/batched-bench.cpp` in the vendored tree). S_TG = B * TG / T_TG is its decode
speed: no HTTP, no tokenizer, no sampling, no scheduling, so it is llama.cpp at its fastest, the
yardstick `bench-engine --vs llama.cpp` sets beside `llama-server`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from moebench.errors import MoebenchError

# the header cells, as batched-bench.cpp prints them, and the field each one fills
COLUMNS = {"PP": "prompt_tokens", "TG": "decode_steps", "B": "batch", "N_KV": "kv_cells",
           "T_PP s": "prefill_s", "S_PP t/s": "prefill_tok_s", "T_TG s": "decode_s",
           "S_TG t/s": "decode_tok_s", "T s": "total_s", "S t/s": "total_tok_s"}
INTEGER_FIELDS = ("prompt_tokens", "decode_steps", "batch", "kv_cells")


@dataclass(frozen=True)
class BatchedBenchRow:
    prompt_tokens: int
    decode_steps: int
    batch: int
    kv_cells: int
    prefill_s: float
    prefill_tok_s: float
    decode_s: float
    decode_tok_s: float  # S_TG: batch * decode_steps / decode_s
    total_s: float
    total_tok_s: float

    def as_dict(self) -> dict:
        return asdict(self)


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def parse_batched_bench_table(text: str) -> list[BatchedBenchRow]:
    """Every row of the table in `text` (llama-batched-bench's stdout and stderr, log lines
    around it). The columns are found by their header names, not their positions; a missing
    header or an unreadable row is an error, never a row of zeros."""
    lines = text.splitlines()
    header_at = next((i for i, line in enumerate(lines)
                      if line.lstrip().startswith("|") and "S_TG t/s" in _cells(line)), None)
    if header_at is None:
        raise MoebenchError("llama-batched-bench printed no results table (no header with S_TG t/s)")
    header = _cells(lines[header_at])
    missing = [name for name in COLUMNS if name not in header]
    if missing:
        raise MoebenchError(f"llama-batched-bench's table lacks the columns {', '.join(missing)}")
    rows = []
    for line in lines[header_at + 1:]:
        if not line.lstrip().startswith("|"):
            break  # the table ends at the first line that is not a row (a blank, the perf summary)
        cells = _cells(line)
        if all(set(cell) <= {"-", ":"} for cell in cells):
            continue  # the separator under the header
        if len(cells) != len(header):
            raise MoebenchError(f"llama-batched-bench row with {len(cells)} cells, header has {len(header)}: {line!r}")
        values = {}
        for name, cell in zip(header, cells):
            if name not in COLUMNS:
                continue
            field = COLUMNS[name]
            try:
                values[field] = int(cell) if field in INTEGER_FIELDS else float(cell)
            except ValueError:
                raise MoebenchError(f"llama-batched-bench row: {name} is {cell!r}: {line!r}") from None
        rows.append(BatchedBenchRow(**values))
    if not rows:
        raise MoebenchError("llama-batched-bench's results table has no rows (the output was cut short, or "
                            "the context was too small for the cell, so it skipped it)")
    return rows


def batched_bench_argv(binary: Path, gguf: Path, threads: int, prompt_tokens: int, decode_steps: int,
                       batch: int) -> list[str]:
    """One (PP, TG, B) cell with llama.cpp's best CPU settings: its weights read into memory
    (`--load-mode none`, this version's `--no-mmap`), T threads for decode and prefill, and an
    F32 KV cache (as the runtime keeps its own, and as bench-engine runs llama-server). Flash
    attention, batch and micro-batch sizes stay at llama.cpp's defaults (flash attention `auto`
    turns it on for the CPU)."""
    # batched-bench skips a cell that does not fit in the context, silently; llama.cpp rounds a
    # context down to a multiple of the sequence count, so each sequence gets whole 256-cell blocks
    per_sequence = -(-(prompt_tokens + decode_steps) // 256) * 256
    context = batch * per_sequence
    return [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "--load-mode", "none",
            "-c", str(context), "-ctk", "f32", "-ctv", "f32",
            "-npp", str(prompt_tokens), "-ntg", str(decode_steps), "-npl", str(batch)]


def huge_pages_env(threads: int) -> dict[str, str]:
    """glibc's malloc asks for transparent huge pages for its large mappings (the model's buffer
    with `--load-mode none`), as bench-engine runs llama-server."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def anon_huge_page_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class BatchedBenchRun:
    row: BatchedBenchRow
    argv: list[str]
    huge_page_bytes: int  # the most AnonHugePages seen while it ran
    attempts: int  # more than 1: an earlier run's table never reached its output (see run_batched_bench)


# llama.cpp prints through a logger thread that nothing flushes at exit (its singleton is leaked on
# purpose, llama.cpp issue 22142), so a process that ends right after printing its table can lose
# it: seen here in about one run in five of a tiny model, whose whole run takes milliseconds.
ATTEMPTS = 3


def run_batched_bench(binary: Path, gguf: Path, threads: int, prompt_tokens: int, decode_steps: int, batch: int,
                      timeout_s: float = 1800.0) -> BatchedBenchRun:
    """Run one llama-batched-bench cell; its row, and the huge pages it held (polled while it runs).
    A run that exits cleanly without its row is run again (up to ATTEMPTS, saying so on stderr)."""
    argv = batched_bench_argv(binary, gguf, threads, prompt_tokens, decode_steps, batch)
    wanted = (prompt_tokens, decode_steps, batch)
    for attempt in range(1, ATTEMPTS + 1):
        returncode, output, huge = _run(argv, threads, timeout_s)
        if returncode != 0:
            tail = " | ".join(output.strip().splitlines()[-3:])
            raise MoebenchError(f"llama-batched-bench exited with code {returncode}; its output ends: {tail}")
        try:
            rows = parse_batched_bench_table(output)
        except MoebenchError as e:
            if attempt == ATTEMPTS:
                raise MoebenchError(f"{e} in {ATTEMPTS} runs of {' '.join(argv)}") from None
            print(f"moebench: warning: llama-batched-bench exited (code 0) without its results table in its output "
                  f"({e}; llama.cpp's log thread is not flushed at exit); running the cell again", file=sys.stderr)
            continue
        if [(r.prompt_tokens, r.decode_steps, r.batch) for r in rows] != [wanted]:
            raise MoebenchError(f"llama-batched-bench printed {len(rows)} rows, not the one cell (PP, TG, B) = {wanted}")
        return BatchedBenchRun(row=rows[0], argv=argv, huge_page_bytes=huge, attempts=attempt)
    raise AssertionError("unreachable")


def _run(argv: list[str], threads: int, timeout_s: float) -> tuple[int, str, int]:
    """(exit code, stdout and stderr, the most AnonHugePages seen while it ran)."""
    from moebench.processes import die_with_parent

    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=huge_pages_env(threads), start_new_session=True,
                                preexec_fn=lambda: die_with_parent(os.getppid(), signal.SIGKILL))
        deadline = time.monotonic() + timeout_s
        huge = 0
        try:
            while proc.poll() is None:
                huge = max(huge, anon_huge_page_bytes(proc.pid))
                if time.monotonic() > deadline:
                    raise MoebenchError(f"llama-batched-bench still running after {timeout_s:.0f} s: {' '.join(argv)}")
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.seek(0)
        return proc.returncode, log.read().decode(errors="replace"), huge


class LlamaBatchedBenchSide:
    """bench-engine's in-process llama.cpp yardstick: one llama-batched-bench run per timed cell,
    its own decode speed S_TG. It decodes random tokens, so it has no greedy tokens to compare."""

    name = "llama-batched-bench"

    def __init__(self, gguf: Path, prompt_tokens: int):
        from moebench.backends.llamacpp import llama_batched_bench_path

        self.binary = llama_batched_bench_path()
        self.gguf, self.prompt_tokens = gguf, prompt_tokens
        self.argv: dict[int, dict[int, list[str]]] = {}  # threads -> batch -> argv
        self.huge_page_bytes: dict[int, int] = {}  # threads -> the most seen in any run
        self.runs: list[dict] = []
        self.last_argv: list[str] = []

    def decode_rate(self, batch: int, new_tokens: int, threads: int) -> float:
        """S_TG over new_tokens - 1 steps: the decode steps a run of new_tokens tokens takes after
        its prefill (the first token comes from the prefill), as the other engines are timed."""
        run = run_batched_bench(self.binary, self.gguf, threads, self.prompt_tokens, new_tokens - 1, batch)
        self.argv.setdefault(threads, {})[batch] = self.last_argv = run.argv
        self.huge_page_bytes[threads] = max(self.huge_page_bytes.get(threads, 0), run.huge_page_bytes)
        self.runs.append({"threads": threads, **run.row.as_dict(), "attempts": run.attempts})
        return run.row.decode_tok_s
