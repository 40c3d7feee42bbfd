"""How big the expert store is, in which dtype, of which class and over which tier, for a runtime:
the factory that wires a session's store and prefetcher (engine/store/expert_store.py holds the stores,
engine/store/native.py the C++ one, engine/store/prefetch.py the prefetcher; this module sits above them)."""

from __future__ import annotations

import math
import os

import torch

from moebench.engine.config import budget_bytes
from moebench.engine.store.expert_store import NoPrefetch, ResidentStore
from moebench.engine.store.tiers import expert_file_dtype, make_tier
from moebench.errors import MoebenchError

def _machine_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def slots_for_budget(cfg, runtime, dtype: torch.dtype | None = None) -> int:
    """Fast-pool slots per MoE layer for `runtime.expert_budget`; num_experts means all resident.

    A fraction f keeps floor(f * E) experts of every MoE layer; a size keeps as many as fit, split
    evenly over the MoE layers (bytes in `dtype`, the pool's, by default the compute dtype). That is
    all the memory the store holds: calls needing more distinct experts than their layer's share
    (prefills, large decode batches) borrow rows from other layers (see PooledStore).
    """
    budget = runtime.expert_budget
    E, k = cfg.num_experts, cfg.top_k
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    expert_bytes = cfg.expert_param_count * torch.empty(0, dtype=dtype or runtime.torch_dtype).element_size()
    total = moe_layers * E * expert_bytes
    try:
        fraction = float(budget)
        size = None
    except (TypeError, ValueError):
        fraction, size = None, budget_bytes(str(budget))
    if fraction is not None:
        if not (0 < fraction <= 1) or math.isnan(fraction):
            raise MoebenchError(f"--expert-budget: a fraction must be in (0, 1], got {budget}")
        slots = math.floor(fraction * E + 1e-9)
        asked = f"{fraction:g} of {E} experts per layer"
    else:
        machine = _machine_bytes(runtime.device)
        if size > machine:
            raise MoebenchError(
                f"--expert-budget {budget}: larger than this machine's {runtime.device} memory "
                f"({machine / 2**30:.1f} GiB)"
            )
        slots = min(E, math.floor(size / (moe_layers * expert_bytes))) if moe_layers else E
        asked = f"{budget} ({size / 2**20:.0f} MiB; one expert is {expert_bytes / 2**20:.2f} MiB)"
    # One token needs top_k experts of a layer at once, and a call (a prefill) can need every expert of
    # its layer: the rows all layers share (see PooledStore) must hold that many.
    fewest = max(k, math.ceil(E / moe_layers)) if moe_layers else k
    if slots < fewest:
        need = fewest * moe_layers * expert_bytes
        raise MoebenchError(
            f"--expert-budget {asked} leaves {slots} expert slots per MoE layer, but one token needs "
            f"top_k={k} experts of a layer at once and a call can need all {E} of one layer: use at least "
            f"{fewest / E:.3g} or {need / 2**20:.0f}MiB (all experts: {total / 2**20:.0f}MiB)"
        )
    return min(slots, E)


def resolve_tier(name: str, device: str) -> str:
    """`auto`: the tier offloading really has on the device: a GPU streams cold experts from pinned
    host memory, a CPU-only machine from disk (the host tier on a CPU is a synthetic setting: a copy
    from RAM to RAM)."""
    if name == "auto":
        return "host" if device == "cuda" else "disk"
    if name not in ("host", "disk"):
        raise MoebenchError(f"unknown --offload-tier '{name}' (choose auto, host or disk)")
    return name


def expert_store_dtype(stored: torch.dtype, compute: torch.dtype, device: str) -> torch.dtype:
    """The dtype the store holds experts in, whichever the kernel. A bfloat16 checkpoint's experts stay
    bfloat16 for float32 compute on the CPU where the C++ kernels build: the fused kernel widens
    them in registers and the naive loop each expert it uses (kernels/reference.moe_reference), both
    exact (a float32 copy holds the very same values), so results are those of float32 weights while
    half the bytes are held and streamed. Without the C++ kernel, the fused torch fallback would
    compute in bfloat16: every kernel gets the compute dtype then."""
    from moebench.kernels.cpu_moe import BACKEND_CPP, cpu_backend

    if stored in (torch.int8, torch.uint8):  # int8 or int4 rows with their scales (--weights): every kernel reads them
        return stored
    widen = device == "cpu" and compute == torch.float32 and stored == torch.bfloat16
    return stored if widen and cpu_backend() == BACKEND_CPP else compute


def store_layout(ckpt, runtime) -> tuple[torch.dtype, int]:
    """(dtype, slots per MoE layer) of the store for this runtime. One dtype for every kernel (the
    kernel switch changes the MoE op only): the same rows, bytes and slots under a budget, which
    counts bytes in that dtype."""
    dtype = expert_store_dtype(expert_file_dtype(ckpt), runtime.torch_dtype, runtime.device)
    return dtype, slots_for_budget(ckpt.config, runtime, dtype)


def make_store_and_prefetcher(ckpt, runtime):
    """Build the expert store for the configured budget and tier, and the prefetch strategy.

    prefetch=off and prefetch=lookahead get the same store: the same slots, loader threads, readers
    and pinning, so that the switch changes only when loads happen (ahead, or on demand)."""
    cfg = ckpt.config
    tier_name = resolve_tier(runtime.offload_tier, runtime.device)
    substituted = None
    in_memory_only = getattr(ckpt, "quantized", None) or (ckpt.weights if getattr(ckpt, "weights", "f32") != "f32" else None)
    if tier_name == "disk" and in_memory_only:
        # a negative control's quantized experts, or --weights int8's, exist only in memory: no file holds them
        tier_name, substituted = "host", f"disk -> host: the {in_memory_only} experts exist only in memory"
    dtype, slots = store_layout(ckpt, runtime)
    if slots >= cfg.num_experts:
        store = ResidentStore(ckpt, runtime.expert_budget, dtype)
    else:
        disk = tier_name == "disk"
        readers = runtime.store.readers
        workers = readers if disk else runtime.store.host_workers
        tier = make_tier(tier_name, ckpt, runtime.device, readers,
                         native_loads=runtime.overrides.expert_loader == "native")
        tier.substituted = substituted
        from moebench.engine.store.native import pick_store_class

        store_class = pick_store_class(runtime, tier, dtype)  # C++ bookkeeping where it can run
        store = store_class(ckpt, runtime, tier, slots, workers, parallel_demand=disk, dtype=dtype)
    if runtime.prefetch == "lookahead":
        from moebench.engine.store.prefetch import LookaheadPrefetcher

        # Each layer is also guessed from the previous layer's MoE input (the early guess), so that
        # its loads overlap that layer's MoE too, not just one attention (docs/prefetch.md).
        early = runtime.store.lookahead_early
        # Guessing stops for a while where it costs more than it saves (cheap loads); see PlanGovernor.
        governor = {"enabled": runtime.store.lookahead_governor,
                    "window": runtime.store.lookahead_window,
                    "keep": runtime.store.lookahead_keep}
        return store, LookaheadPrefetcher(ckpt, store, extra_per_token=runtime.store.lookahead_extra,
                                          early=early, governor=governor)
    return store, NoPrefetch(store)
