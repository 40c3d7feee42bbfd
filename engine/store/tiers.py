"""Slow tiers behind a budgeted expert store: where an expert lives while it is not in the fast pool.

A tier copies one expert into a fast-pool slot: `load(layer, expert, w13_dst, w2_dst) -> bytes read`.
The destination slot is in the compute dtype; the tier keeps the checkpoint's own dtype (bfloat16
for most checkpoints), so every load is an exact upcast, never a rounding.

- `HostTier`: cold experts in host memory. On CUDA they sit in pinned memory so a copy on a side
  stream overlaps compute; on CPU a load is a memory copy plus the upcast.
- `DiskTier`: cold experts are read from the checkpoint's safetensors files, past the page cache
  (O_DIRECT with aligned buffers; where the file system refuses O_DIRECT, `posix_fadvise(DONTNEED)`
  before each buffered read). Byte offsets come from the safetensors header, so no tensor is ever
  deserialized through a library that might cache it. `load` is thread-safe: several readers run
  at once (the disk serves parallel requests faster than one).

Nothing here sleeps or simulates: a load costs what the hardware costs.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
import weakref
from pathlib import Path

import torch

from moebench.engine.memory import to_huge_pages
from moebench.errors import MoebenchError

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_ALIGN = 4096  # O_DIRECT needs offsets, lengths and buffer addresses aligned to the logical block size


class ExpertTier:
    name = "base"
    batched = False  # whether load_many does a batch in one call (else it is a loop over load)

    def __init__(self):
        self.loaders = []  # native loaders made by `native_loader`, for counters and close
        self.sync = None  # a thread-less native loader once `prepare_native` succeeded
        self.substituted = None  # why this tier stands in for the one asked for (in the evidence)
        self.native_loads = True  # False: loads on Python threads (the expert_loader override)

    def load(self, layer: int, expert: int, w13_dst: torch.Tensor, w2_dst: torch.Tensor) -> int:
        raise NotImplementedError

    # Native loads (`moebench.kernels.expert_loader`): the tier describes a load as integers and a
    # native worker, which never takes the GIL, does it. A tier that cannot, or a destination it
    # cannot describe (CUDA, an odd layout), keeps its Python `load`.

    def prepare_native(self, dst_dtype: torch.dtype) -> bool:
        """Get ready to describe loads into slots of `dst_dtype`; False where this tier cannot, or the
        expert_loader override keeps its loads on Python threads (`native_loads`)."""
        return self.native_loads and self._prepare_native(dst_dtype)

    def _prepare_native(self, dst_dtype: torch.dtype) -> bool:
        return False

    def describe(self, layer: int, expert: int, w13_addr: int, w2_addr: int) -> tuple:
        """One expert's load into the slot whose w13 and w2 rows start at these addresses."""
        raise NotImplementedError

    def run_native(self, loads: list[tuple]) -> None:
        """Loads described by `describe`, now, in this thread (the GIL released while they run)."""
        from moebench.kernels.expert_loader import load_extension

        try:
            self.sync.run(loads)
        except load_extension().LoadError as e:  # a short or failed read: loud, never a slot of garbage
            raise MoebenchError(str(e)) from None

    def native_loader(self, threads: int, spin_us: int = 0, cpus: list[int] = ()):
        """A native loader with `threads` workers (0: it only runs loads in the caller's thread), one
        of which spins `spin_us` for the next load before it sleeps, all on `cpus` (empty: any)."""
        from moebench.kernels.expert_loader import load_extension

        loader = load_extension().Loader(threads, spin_us, list(cpus))
        self.loaders.append(loader)
        return loader

    def held_tensors(self) -> list[torch.Tensor]:
        """Expert copies this tier keeps in memory (counted in a store's expert memory)."""
        return []

    def read_buffer_bytes_per_thread(self) -> int:
        """Memory of the buffer each thread reading from this tier keeps (a disk tier's page-aligned
        read buffer, as large as its longest read)."""
        return 0

    def load_many(self, layer: int, items: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Several (expert, w13_dst, w2_dst) loads of one layer, in order."""
        for expert, w13_dst, w2_dst in items:
            self.load(layer, expert, w13_dst, w2_dst)

    def evidence(self) -> dict:
        return {"tier": self.name}

    def close(self) -> None:
        for loader in self.loaders:
            loader.close()


def _native_available(dst_dtype: torch.dtype, src_dtype: torch.dtype, device: str) -> bool:
    from moebench.kernels.expert_loader import conversion, load_extension

    return device == "cpu" and conversion(src_dtype, dst_dtype) is not None and load_extension() is not None


def _moe_layers(ckpt) -> list[int]:
    return [i for i in range(ckpt.config.num_layers) if ckpt.config.is_moe_layer(i)]


# Converted copies of a checkpoint's experts, one per (checkpoint, dtype, device, pinning), shared
# by every store built on it: the harness builds a store per generate() call, and re-packing
# gigabytes of experts each time would dominate short trials.
_EXPERT_COPIES: dict[tuple, dict] = {}


# A checkpoint's expert file dtype, read once: a session asks for it a few times, and parsing a large
# checkpoint's safetensors header each time put tens of milliseconds (and the garbage collections
# its objects set off) into every generate() call's timed region.
_EXPERT_FILE_DTYPES: dict[int, torch.dtype] = {}


def expert_file_dtype(ckpt) -> torch.dtype:
    """The dtype routed experts are stored in (the header of the file holding the first one; int8 for
    a checkpoint whose experts were packed in memory by --weights int8, engine/quantize.py)."""
    if getattr(ckpt, "weights", "f32") in ("int8", "int4"):  # int4: uint8 Q4_0 blocks (docs/int4.md)
        return torch.int8 if ckpt.weights == "int8" else torch.uint8
    if not ckpt.expert_sources:
        return ckpt.checkpoint_dtype
    key = id(ckpt)
    if key not in _EXPERT_FILE_DTYPES:
        f, name = next(iter(ckpt.expert_sources.values()))[0]
        meta = read_safetensors_header(Path(f))[1].get(name, {})
        _EXPERT_FILE_DTYPES[key] = _DTYPES.get(meta.get("dtype"), ckpt.checkpoint_dtype)
        weakref.finalize(ckpt, _EXPERT_FILE_DTYPES.pop, key, None)
    return _EXPERT_FILE_DTYPES[key]


def experts_in(ckpt, dtype: torch.dtype, device="cpu", pin: bool = False) -> dict:
    """Every MoE layer's (w13, w2) in `dtype` on `device` (pinned for CUDA copies with `pin`), cached
    for the checkpoint's lifetime. Conversions between a bfloat16 checkpoint's values and float32
    are exact both ways; where the loaded experts already are in `dtype` on `device`, `.to` returns
    them themselves (no extra memory). New host copies go to huge pages."""
    key = (id(ckpt), dtype, str(device), pin)
    if key not in _EXPERT_COPIES:
        copy = {}
        for i in _moe_layers(ckpt):
            w = ckpt.layers[i]
            w13, w2 = w.w13.to(device, dtype), w.w2.to(device, dtype)
            if pin:
                w13, w2 = w13.pin_memory(), w2.pin_memory()
            elif w13 is not w.w13:
                w13, w2 = to_huge_pages(w13), to_huge_pages(w2)
            copy[i] = (w13, w2)
        _EXPERT_COPIES[key] = copy
        weakref.finalize(ckpt, _EXPERT_COPIES.pop, key, None)
    return _EXPERT_COPIES[key]


class HostTier(ExpertTier):
    name = "host"
    batched = True

    def __init__(self, ckpt, device: str):
        super().__init__()
        self.cuda = device == "cuda"
        # in the file's dtype: the experts were loaded from it, so converting back is exact
        self.experts = experts_in(ckpt, expert_file_dtype(ckpt), "cpu", pin=self.cuda)
        w13, w2 = next(iter(self.experts.values()))
        self.expert_bytes = w13[0].nbytes + w2[0].nbytes

    def _prepare_native(self, dst_dtype):
        from moebench.kernels.expert_loader import conversion

        if self.cuda or not all(w.is_contiguous() for pair in self.experts.values() for w in pair):
            return False
        src_dtype = next(iter(self.experts.values()))[0].dtype
        if not _native_available(dst_dtype, src_dtype, "cpu"):
            return False
        kind = conversion(src_dtype, dst_dtype)
        # per layer: (w13 base address, bytes per expert, w2 base address, bytes per expert)
        self._sources = {i: (w13.data_ptr(), w13[0].nbytes, w2.data_ptr(), w2[0].nbytes)
                         for i, (w13, w2) in self.experts.items()}
        self._kind = kind
        self.sync = self.native_loader(0)
        return True

    def describe(self, layer, expert, w13_addr, w2_addr):
        a13, n13, a2, n2 = self._sources[layer]
        k = self._kind
        return (-1, 0, 0, 0, False, "host", [(a13 + expert * n13, w13_addr, n13, k), (a2 + expert * n2, w2_addr, n2, k)])

    def load(self, layer, expert, w13_dst, w2_dst):
        w13, w2 = self.experts[layer]
        # non_blocking only matters on CUDA (pinned source -> async DMA on the caller's stream).
        w13_dst.copy_(w13[expert], non_blocking=self.cuda)
        w2_dst.copy_(w2[expert], non_blocking=self.cuda)
        return self.expert_bytes

    def load_many(self, layer, items):
        # One call for the whole batch: a worker thread takes the GIL once, not twice per expert.
        # On a busy CPU a thread preempted while holding the GIL stalls the model's thread too.
        w13, w2 = self.experts[layer]
        dst = [d for _, d, _ in items] + [d for _, _, d in items]
        src = [w13[e] for e, _, _ in items] + [w2[e] for e, _, _ in items]
        torch._foreach_copy_(dst, src, non_blocking=self.cuda)

    def held_tensors(self):
        return [w for pair in self.experts.values() for w in pair]

    def evidence(self):
        ev = {"tier": self.name, "tier_dtype": str(next(iter(self.experts.values()))[0].dtype).replace("torch.", ""),
              "pinned": self.cuda}
        return {**ev, "tier_substituted": self.substituted} if self.substituted else ev


def read_safetensors_header(path: Path) -> tuple[int, dict]:
    """(byte offset where tensor data starts, header dict) of one safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise MoebenchError(f"{path}: truncated safetensors file (no header length)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise MoebenchError(f"{path}: malformed safetensors header ({e})") from None
    return 8 + n, header


class _Extent:
    """Where one expert's gate, up and down tensors lie in a file: one read when they are adjacent."""

    __slots__ = ("file", "start", "end", "parts")

    def __init__(self, file: str, parts: list[tuple]):
        self.file = file
        self.parts = parts  # (absolute offset, nbytes, dtype, shape, 0/1/2 for gate/up/down)
        self.start = min(p[0] for p in parts)
        self.end = max(p[0] + p[1] for p in parts)


class DiskTier(ExpertTier):
    name = "disk"

    def __init__(self, ckpt, readers: int = 4, direct: bool = True):
        super().__init__()
        if not ckpt.expert_sources:
            raise MoebenchError(
                f"{ckpt.path}: --offload-tier disk needs one tensor per expert in the safetensors files "
                "(this checkpoint stores experts fused); use --offload-tier host"
            )
        self.readers = readers
        self.cfg = ckpt.config
        headers: dict[str, tuple[int, dict]] = {}
        self.extents: dict[tuple[int, int], list[_Extent]] = {}
        for (layer, expert), sources in ckpt.expert_sources.items():
            by_file: dict[str, list] = {}
            for which, (f, name) in enumerate(sources):
                f = str(f)
                if f not in headers:
                    headers[f] = read_safetensors_header(Path(f))
                base, header = headers[f]
                meta = header.get(name)
                if meta is None or meta.get("dtype") not in _DTYPES:
                    raise MoebenchError(f"{f}: tensor '{name}' missing or of an unsupported dtype for the disk tier")
                lo, hi = meta["data_offsets"]
                by_file.setdefault(f, []).append((base + lo, hi - lo, _DTYPES[meta["dtype"]], tuple(meta["shape"]), which))
            extents = []
            for f, parts in by_file.items():
                span = max(p[0] + p[1] for p in parts) - min(p[0] for p in parts)
                if span <= 2 * sum(p[1] for p in parts):  # adjacent (the usual layout): one request
                    extents.append(_Extent(f, parts))
                else:
                    extents.extend(_Extent(f, [p]) for p in parts)
            self.extents[(layer, expert)] = extents
        self.expert_bytes = sum(p[1] for ext in next(iter(self.extents.values())) for p in ext.parts)
        self.mode = "o_direct" if direct and self._direct_works(next(iter(headers))) else "fadvise"
        flags = os.O_RDONLY | (os.O_DIRECT if self.mode == "o_direct" else 0)
        self.fds = {f: os.open(f, flags) for f in headers}
        self._local = threading.local()
        self._lock = threading.Lock()
        self.requests = 0
        self.bytes_read = 0

    def _prepare_native(self, dst_dtype):
        """One read per expert (gate, up and down adjacent, the usual layout), described once: the file
        range rounded out for O_DIRECT and where each part lands in the slot."""
        from moebench.kernels.expert_loader import conversion

        if any(len(extents) != 1 for extents in self.extents.values()):
            return False
        if not all(_native_available(dst_dtype, p[2], "cpu") for (ext,) in self.extents.values() for p in ext.parts):
            return False
        inter, hidden = self.cfg.moe_intermediate_size, self.cfg.hidden_size
        up_offset = inter * hidden * torch.empty(0, dtype=dst_dtype).element_size()
        self._described = {}
        for key, (ext,) in self.extents.items():
            start, length = self._read_range(ext)
            # (offset in what was read, 0: into w13 / 1: into w2, byte offset there, bytes, kind)
            parts = [(off - start, 1 if which == 2 else 0, up_offset if which == 1 else 0, nbytes,
                      conversion(dtype, dst_dtype)) for off, nbytes, dtype, _, which in ext.parts]
            self._described[key] = (self.fds[ext.file], start, length, ext.end - start, self.mode == "fadvise",
                                    ext.file, parts)
        self.sync = self.native_loader(0)
        return True

    def describe(self, layer, expert, w13_addr, w2_addr):
        fd, start, length, needed, fadvise, label, parts = self._described[(layer, expert)]
        dst = (w13_addr, w2_addr)
        return (fd, start, length, needed, fadvise, label,
                [(src, dst[into] + at, nbytes, kind) for src, into, at, nbytes, kind in parts])

    @staticmethod
    def _direct_works(f: str) -> bool:
        """Some file systems (tmpfs, some overlays) refuse O_DIRECT at open or at the first read."""
        if not hasattr(os, "O_DIRECT"):
            return False
        probe = mmap.mmap(-1, _ALIGN)
        try:
            fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
            try:
                os.preadv(fd, [probe], 0)
            finally:
                os.close(fd)
            return True
        except OSError:
            return False
        finally:
            probe.close()

    def _buffer(self, size: int) -> mmap.mmap:
        """This thread's read buffer: anonymous mmap is page-aligned, as O_DIRECT requires."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            if buf is not None:
                buf.close()
            buf = mmap.mmap(-1, -(-size // _ALIGN) * _ALIGN)
            self._local.buf = buf
        return buf

    def _read_range(self, ext: _Extent) -> tuple[int, int]:
        """(offset, length) to read for one extent: rounded out to the block size for O_DIRECT."""
        if self.mode == "o_direct":
            start = ext.start // _ALIGN * _ALIGN
            return start, -(-(ext.end - start) // _ALIGN) * _ALIGN
        return ext.start, ext.end - ext.start

    def _read(self, ext: _Extent) -> tuple[mmap.mmap, int]:
        """Read one extent; returns (buffer, offset of ext.start in it)."""
        fd = self.fds[ext.file]
        start, length = self._read_range(ext)
        if self.mode == "fadvise":
            # Drop any cached copy first, so this read comes from the device, not from memory.
            os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
        buf = self._buffer(length)
        view = memoryview(buf)[:length]
        got = os.preadv(fd, [view], start)
        view.release()
        if got < ext.end - start:
            raise MoebenchError(f"{ext.file}: short read at byte {start} (file truncated?)")
        if self.mode == "fadvise":
            os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
        with self._lock:
            self.requests += 1
            self.bytes_read += length
        return buf, ext.start - start

    def load(self, layer, expert, w13_dst, w2_dst):
        inter = self.cfg.moe_intermediate_size
        dsts = (w13_dst[:inter], w13_dst[inter:], w2_dst)  # gate, up, down
        for ext in self.extents[(layer, expert)]:
            buf, base = self._read(ext)
            for off, nbytes, dtype, shape, which in ext.parts:
                src = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=base + off - ext.start)
                # Synchronous copy: the buffer is reused by this thread's next read.
                dsts[which].copy_(src.view(dtype).view(shape))
        return self.expert_bytes

    def read_buffer_bytes_per_thread(self):
        longest = max(self._read_range(ext)[1] for extents in self.extents.values() for ext in extents)
        return -(-longest // _ALIGN) * _ALIGN

    def evidence(self):
        return {"tier": self.name, "read_mode": self.mode, "readers": self.readers,
                "disk_requests": self.requests + sum(x.reads for x in self.loaders),
                "disk_bytes_read": self.bytes_read + sum(x.bytes_read for x in self.loaders)}

    def close(self):
        super().close()
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = {}


def disk_read_mode(ckpt) -> str | None:
    """How the disk tier will read this checkpoint's experts: o_direct, or fadvise where the file
    system refuses O_DIRECT (tmpfs, some overlays); None when it has no per-expert tensors."""
    if not ckpt.expert_sources:
        return None
    first = str(next(iter(ckpt.expert_sources.values()))[0][0])
    return "o_direct" if DiskTier._direct_works(first) else "fadvise"


def make_tier(name: str, ckpt, device: str, readers: int = 4, native_loads: bool = True) -> ExpertTier:
    if name not in ("host", "disk"):
        raise MoebenchError(f"unknown --offload-tier '{name}' (choose host or disk)")
    tier = HostTier(ckpt, device) if name == "host" else DiskTier(ckpt, readers)
    tier.native_loads = native_loads
    return tier
