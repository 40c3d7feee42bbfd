"""What the manifest records about the machine and the software: enough to reproduce a run."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import time
from pathlib import Path


def measure_read_bandwidth_gb_s(megabytes: int = 256, repeats: int = 3, huge_pages: bool = True) -> float:
    """Read bandwidth: the best of a few full reads of a buffer far larger than the caches, in huge
    pages as the engine places its weights (or in torch's default pages), by the fastest reader at
    hand at torch's thread count. The readers are torch's `sum` (one sequential stream per thread)
    and, where the CPU extension is built, `read_in_runs` (four runs side by side per thread, the way
    the decode kernels read weights; one core reads faster that way, docs/cpu-decode.md). A
    roofline taken from a slower reader than the engine's own would overstate the engine's share."""
    return max(read_bandwidth_by_reader(megabytes, repeats, huge_pages).values())


def read_bandwidth_by_reader(megabytes: int = 256, repeats: int = 3, huge_pages: bool = True) -> dict[str, float]:
    """GB/s of each reader of `measure_read_bandwidth_gb_s`, best of `repeats` reads each."""
    import torch

    from moebench.engine import memory

    numel = megabytes * 2**20 // 4
    x = memory.empty((numel,), torch.float32) if huge_pages else torch.empty(numel, dtype=torch.float32)
    x.fill_(1.0)
    readers = bandwidth_readers(x)
    best = {name: float("inf") for name in readers}
    for _ in range(repeats):
        for name, read in readers.items():
            start = time.perf_counter()
            read()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: x.numel() * 4 / seconds / 1e9 for name, seconds in best.items()}


def bandwidth_readers(x) -> dict:
    """name -> a call that reads all of the float32 buffer `x` once: torch's `sum`, and on the CPU,
    where the extension is built, its `read_in_runs` (four runs side by side per thread)."""
    import torch

    readers = {"torch.sum": x.sum}
    if x.device.type == "cpu" and torch.cpu._is_avx2_supported():
        from moebench.kernels.cpu_moe import load_extension

        ext = load_extension()
        if ext is not None and hasattr(ext, "read_in_runs"):
            readers["read_in_runs"] = lambda: ext.read_in_runs(x)
    return readers


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
        root = Path(__file__).resolve().parent.parent.parent
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
