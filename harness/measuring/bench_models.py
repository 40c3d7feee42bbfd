"""The models bench-engine and the benchmark scripts measure: the random Qwen3-MoE of the 0.89B
shape, and what a benchmark script's --model names."""

from __future__ import annotations

import atexit
import shutil
import signal
import sys
import tempfile
from pathlib import Path

DEFAULT_SHAPE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                     head_dim=64, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=256,
                     intermediate_size=2048, vocab_size=32000)


def write_random_model(directory: Path, dtype: str | None = None, layers: int | None = None) -> Path:
    """The random Qwen3-MoE that bench-engine measures (DEFAULT_SHAPE, `layers` deep where given),
    written to `directory` in float32, or bfloat16 with dtype "bf16"."""
    import torch

    from moebench.models.random import make_random_qwen3_moe

    shape = {**DEFAULT_SHAPE, **({"num_hidden_layers": layers} if layers else {})}
    return make_random_qwen3_moe(directory, shape, pad_token_id=0,
                                 dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)


def benchmark_checkpoint(model: str, tmp: Path, dtype: str | None = None, layers: int | None = None):
    """The checkpoint a benchmark script's --model names ("bundled"; "random-0.89b", written under
    `tmp` by write_random_model; or a checkpoint folder), loaded with its experts as `run` and
    bench-engine hold them on the CPU: in the checkpoint's own dtype."""
    from moebench.engine import load_checkpoint

    if model == "bundled":
        from moebench.models.bundled import bundled_model_path

        path = bundled_model_path()
    elif model == "random-0.89b":
        path = write_random_model(tmp / "model", dtype, layers)
    else:
        path = Path(model)
    return load_checkpoint(path, experts_in_checkpoint_dtype=True)


def scratch_checkpoint(model: str, dtype: str | None = None, layers: int | None = None):
    """benchmark_checkpoint, written (for random-0.89b: 1.8-3.4 GB) to a temporary folder that is removed
    when the process exits, also on the SIGTERM of `timeout`, which would otherwise end it before any
    cleanup ran."""
    folder = Path(tempfile.mkdtemp(prefix="moebench-checkpoint-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return benchmark_checkpoint(model, folder, dtype, layers)
