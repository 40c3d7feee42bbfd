"""What the manifest records about the machine and the software: enough to reproduce a run."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import time
from pathlib import Path


def measure_read_bandwidth_gb_s(megabytes: int = 256, repeats: int = 3, huge_pages: bool = True) -> float:
    """Best of a few full reads of a buffer far larger than the caches (a `sum` streams it once),
    in huge pages as the engine places its weights, or in torch's default pages."""
    import torch

    from moebench.engine import memory

    numel = megabytes * 2**20 // 4
    x = memory.empty((numel,), torch.float32) if huge_pages else torch.empty(numel, dtype=torch.float32)
    x.fill_(1.0)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def package_versions() -> dict:
    versions = {"python": platform.python_version()}
    for name in ("moebench", "torch", "triton", "transformers", "safetensors", "tokenizers", "numpy"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def describe_machine(measure_bandwidth: bool = True) -> dict:
    import torch

    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # idle OpenMP threads spin or sleep by this policy; it changes small-op timings many-fold
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "gpu": gpu_name(),
        "memory_read_gb_s": round(measure_read_bandwidth_gb_s(), 2) if measure_bandwidth else None,
        # the same read in 4 KiB pages: on VMs with costly page walks it is several times slower,
        # which is why the engine keeps weights, KV cache and expert pools in huge pages
        "memory_read_gb_s_small_pages": (round(measure_read_bandwidth_gb_s(huge_pages=False), 2)
                                         if measure_bandwidth else None),
        "transparent_huge_pages": _thp_mode(),
    }
