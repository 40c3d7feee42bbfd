"""The pooled expert store with its bookkeeping in C++ (`kernels/csrc/expert_store.cpp`).

`NativePooledStore` is a `PooledStore` (same buffers, budget, warm start, loader threads, memory
and evidence) whose per-layer bookkeeping (residency table, LRU order, free rows, quota and
borrowing, predictions, loads in flight, counters) lives in the native loader's module, so that a
fetch whose experts are all resident is one C++ call, and a miss is described and loaded from C++.
`PooledStore` stays the reference: tests run the same calls through both and compare rows,
counters and weights (tests/store/test_native_store.py).

Where it runs: on CPU, when the native loader builds and the tier can describe its loads as plain
integers (`ExpertTier.describe`). The expert_store override (engine/overrides.py) picks it: auto (default; the Python store, with a warning, where the native one cannot run),
native (an error where it cannot), python.
"""

from __future__ import annotations

import warnings

from moebench.engine.store.expert_store import PooledStore
from moebench.errors import MoebenchError

from moebench.engine.overrides import VARIABLES as OVERRIDE_VARIABLES

STORE_ENV = OVERRIDE_VARIABLES["expert_store"]

# Row addresses handed to `tier.describe` to learn where each part of a load lands: any destination
# at or past A is in the w13 row, past B in the w2 row (both far beyond any offset inside a row).
_W13_MARK, _W2_MARK = 1 << 46, 1 << 47


def store_choice(runtime) -> str:
    """auto, native or python: the expert_store override (engine/overrides.py checked the value)."""
    return runtime.overrides.expert_store


def native_store_unavailable(runtime, tier, dtype) -> str | None:
    """Why the native store cannot run with this tier, or None where it can. Prepares the tier's
    native loads (`prepare_native`) as the store would."""
    if runtime.device != "cpu":
        return f"the native store runs on CPU, not {runtime.device}"
    if runtime.overrides.expert_loader != "native":
        return f"the expert_loader override ({OVERRIDE_VARIABLES['expert_loader']}=python) keeps loads in Python"
    from moebench.kernels.expert_loader import load_extension

    ext = load_extension()
    if ext is None:
        return "the native loader did not build"
    if not hasattr(ext, "Store"):
        return "the native loader's module has no Store (an old build)"
    if not tier.prepare_native(dtype):
        return (f"the {tier.name} tier cannot describe these loads natively (experts not in one read each, or a "
                "dtype it cannot convert)")
    return None


def pick_store_class(runtime, tier, dtype) -> type[PooledStore]:
    """NativePooledStore where chosen and possible; PooledStore where chosen, or (loudly) where not possible."""
    choice = store_choice(runtime)
    if choice == "python":
        return PooledStore
    why_not = native_store_unavailable(runtime, tier, dtype)
    if why_not is None:
        return NativePooledStore
    if choice == "native":
        raise MoebenchError(f"expert store 'native' cannot run: {why_not}")
    if runtime.device == "cpu" and runtime.overrides.expert_loader == "native":
        warnings.warn(f"moebench: the native expert store cannot run ({why_not}); the Python store runs instead "
                      f"(same results, more per-call overhead); set {STORE_ENV}=python to choose it",
                      RuntimeWarning, stacklevel=3)
    return PooledStore


class _NativeCounters:
    """`counters.total` as the reference has it (the prefetcher's governor reads it), from C++."""

    def __init__(self, native):
        self._native = native

    @property
    def total(self) -> dict:
        return self._native.totals()

    def take_step(self) -> dict:
        return self._native.take_step()


class NativePooledStore(PooledStore):
    store_name = "pooled-native"

    def __init__(self, ckpt, runtime, tier, slots: int, workers: int = 0, parallel_demand: bool = False,
                 dtype=None):
        super().__init__(ckpt, runtime, tier, slots, workers, parallel_demand=parallel_demand, dtype=dtype)
        if not self.native_rows:
            self.close()
            raise MoebenchError(f"the native expert store needs native loads: the {tier.name} tier cannot "
                                "describe them")
        from moebench.kernels.expert_loader import load_extension

        ext = load_extension()
        n13, n2 = self.row_bytes
        layers = [(layer, list(pool.slot_of.items()), [self._template(layer, e) for e in range(self.cfg.num_experts)])
                  for layer, pool in self.pools.items()]
        self.native_store = ext.Store(
            self.cfg.num_experts, self.rows, self.quota, tier.expert_bytes, self.w13.data_ptr(), self.w2.data_ptr(),
            n13, n2, layers, list(self.free), [p.layer for p in self.recent],
            self.executor if self.native else None, self.demand_executor if self.native else None, tier.sync)
        self._load_error = ext.LoadError
        # The C++ store owns the bookkeeping from here: no stale Python copy of it is left to read.
        del self.pools, self.free, self.recent
        self.counters = _NativeCounters(self.native_store)

    def _template(self, layer: int, expert: int) -> tuple:
        """The tier's description of `expert`'s load with the row left open: each segment as
        (src, 0/1 for a w13/w2 row, byte offset in that row, bytes, kind)."""
        fd, offset, length, needed, fadvise, label, segments = self.tier.describe(layer, expert, _W13_MARK, _W2_MARK)
        n13, n2 = self.row_bytes
        parts = []
        for src, dst, nbytes, kind in segments:
            if _W13_MARK <= dst < _W13_MARK + n13:
                parts.append((src, 0, dst - _W13_MARK, nbytes, kind))
            elif _W2_MARK <= dst < _W2_MARK + n2:
                parts.append((src, 1, dst - _W2_MARK, nbytes, kind))
            else:
                raise MoebenchError(f"{self.tier.name} tier: a load of layer {layer} expert {expert} writes "
                                    "outside its row")
        return fd, offset, length, needed, fadvise, label, parts

    def fetch(self, layer, topk_ids):
        try:
            return self.w13, self.w2, self.native_store.fetch(layer, topk_ids)
        except self._load_error as e:  # a short or failed read: loud, never a row of garbage
            raise MoebenchError(str(e)) from None

    def prefetch(self, layer: int, experts: list[int]) -> None:
        if self.executor is None:
            return
        try:
            self.native_store.prefetch(layer, experts)
        except self._load_error as e:  # an earlier load that failed, met while claiming a row
            raise MoebenchError(str(e)) from None

    def take_step(self):
        return self.native_store.take_step()
