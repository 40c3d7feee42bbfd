"""Host memory placement: large CPU tensors live in transparent huge pages.

Why: a decode step streams every routed expert's weights from DRAM, and on virtual machines
of this project's kind a 4 KiB page costs a nested page walk. Measured here (one thread,
`sum` over the buffer): 21 GB/s over 32 MB but 1.1 GB/s over 512 MB in 4 KiB pages, against
12.6 GB/s over the same 512 MB in 2 MiB pages. A 1-token expert matmul ([1,1024] x 768 KiB
weights, 128 experts cycled) took 3.9 ms in 4 KiB pages and 0.34 ms in huge pages. On a
machine whose page walks are cheap the placement costs nothing.

The buffer is an anonymous mapping advised MADV_HUGEPAGE before any page is touched (the
kernel then backs it with 2 MiB pages at first write, with `enabled` set to madvise or
always), aligned to 2 MiB inside a slightly larger mapping. `huge_page_bytes()` reads back
how much of the process really sits in huge pages: the manifest records it as evidence.
"""

from __future__ import annotations

import functools
import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 * 1024 * 1024
MIN_BYTES = HUGE_PAGE  # smaller tensors stay where torch put them


_huge_pages = [True]  # the huge_pages override, set once per process (engine/overrides.py)


def set_huge_pages(on: bool) -> None:
    _huge_pages[0] = bool(on)


def huge_pages_supported() -> bool:
    if not _huge_pages[0] or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    return _kernel_allows_huge_pages()


@functools.cache
def _kernel_allows_huge_pages() -> bool:
    """Read once: every large allocation asks, and the kernel setting does not change under us."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode


def huge_page_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor backed by an anonymous mapping advised to use huge pages."""
    numel = 1
    for d in shape:
        numel *= int(d)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes < MIN_BYTES or not huge_pages_supported():
        return torch.empty(shape, dtype=dtype)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
    offset = (-raw.data_ptr()) % HUGE_PAGE
    return raw[offset : offset + nbytes].view(dtype).view(shape)


def to_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of a large CPU tensor in huge pages (the tensor itself when that does not apply)."""
    if t.device.type != "cpu" or t.numel() * t.element_size() < MIN_BYTES or not huge_pages_supported():
        return t
    out = huge_page_empty(t.shape, t.dtype)
    out.copy_(t)
    return out


def huge_page_bytes() -> int | None:
    """Bytes of this process's anonymous memory that sit in huge pages (None off Linux)."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return 0


def empty(shape, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """`torch.empty`, in huge pages when on the CPU and large enough."""
    if torch.device(device).type == "cpu":
        return huge_page_empty(shape, dtype)
    return torch.empty(shape, dtype=dtype, device=device)


def _status_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class PeakRss:
    """This process's peak resident set size from now on: the kernel's high-water mark (VmHWM),
    reset at the start by writing 5 to /proc/self/clear_refs (Linux 4.0+). Where the reset is not
    allowed the peak counts from the process's start, and `since_start` says so."""

    def __init__(self):
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.since_start = False
        except OSError:
            self.since_start = True

    def peak(self) -> int | None:
        return _status_bytes("VmHWM")


def tensor_bytes(tensors) -> int:
    """Bytes of `tensors`, each counted once (a tensor that two holders share is one copy)."""
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    return total
