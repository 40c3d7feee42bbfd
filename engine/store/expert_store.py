"""Where the MoE block gets expert weights from.

`ResidentStore` (engine/store/resident.py) holds every expert (budget 1.0). `PooledStore` holds
only a budgeted fast pool per MoE layer (w13 [S, 2I, H], w2 [S, H, I] in the store's dtype, an
expert -> slot map) and loads the rest from a slow tier (`moebench.engine.store.tiers`: host memory
or disk). Both answer the same call,
`fetch(layer, topk_ids) -> (w13, w2, ids remapped to rows of w13/w2)`, so the kernel never knows
which store it runs on.

Baseline (prefetch=off): an expert missing from the pool is loaded on demand, synchronously, one at
a time, into the least recently used slot. A prefetcher (prefetch=lookahead, `moebench.engine.
prefetch`) asks for a layer's experts through `prefetch` before that layer routes; the store hands
the loads to worker threads (native ones that never take the GIL, `moebench.kernels.expert_loader`,
where the tier can describe its loads), so they overlap the compute in between.

Invariants that make offloading exact:
- a slot whose expert the current layer call needs is never chosen as a victim;
- a slot with a load in flight is never a victim (its bytes are still being written);
- an expert needed now but still loading is waited for (that wait is stall), never skipped.
"""

from __future__ import annotations

import math
import os
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from moebench.engine import memory
from moebench.engine.store.resident import ResidentStore, read_all_experts  # noqa: F401 (imported from here)
from moebench.engine.store.base import STEP_KEYS, Counters, ExpertStore, dtype_name, host_ids, memory_evidence  # noqa: F401
from moebench.errors import MoebenchError
from moebench.kernels.reference import stored_width



class _NeverRaised(Exception):
    """Stands for the native loader's error class where no native loader runs."""


def loader_cpus(runtime) -> list[int]:
    """The cores the native loader threads run on: the last ones of this process's set beyond the
    model's intra-op threads, so a loader never takes the model thread's core (on 2 cores, disk
    lookahead at batch 1 was ~8% faster so). [] (any core) when the model's threads need every
    core, or with `StoreTuning(loader_cpus="any")`; a list ("1" or "2,3") picks them."""
    choice = str(runtime.store.loader_cpus).strip()
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if choice == "any":
        return []
    if choice != "auto":
        try:
            cpus = [int(c) for c in choice.split(",") if c.strip()]
        except ValueError:
            raise MoebenchError(f"loader_cpus '{choice}': expected auto, any or a list like 1,2") from None
        if not cpus or not set(cpus) <= set(mine):
            raise MoebenchError(f"loader_cpus '{choice}': not among this process's cpus {mine}")
        return cpus
    spare = len(mine) - torch.get_num_threads()
    return mine[-spare:] if spare > 0 else []


def _ratio(a, b):
    return a / b if b else None


def _held_elsewhere(ckpt, tier, own) -> dict:
    """Expert bytes held beside the store's own buffers: copies the checkpoint or the tier keep in
    memory (a loaded checkpoint's stacked experts, the host tier's copy, counted once where they are
    the same tensors)."""
    ckpt_experts = [w for layer in ckpt.layers for w in (layer.w13, layer.w2)]
    held = [t for t in ckpt_experts + list(tier.held_tensors()) if t is not None]
    own_ptrs = {t.data_ptr() for t in own}
    held = [t for t in held if t.data_ptr() not in own_ptrs]
    return {"host_copy_bytes": memory.tensor_bytes(held)}


class _Pool:
    """One MoE layer's share of the store's rows: which expert each row it holds has (LRU order), loads
    in flight, what was prefetched and predicted for its next call."""

    def __init__(self, layer: int, num_experts: int):
        self.layer = layer
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # expert -> row, resident or loading; least recent first
        self.loading: dict[int, Future] = {}
        # expert -> row (-1: not held); numpy, not torch, for the reason given at `host_ids`
        self.table = np.full(num_experts, -1, dtype=np.int64)
        self.prefetched: set[int] = set()  # loaded by prefetch for the next call, not yet used
        self.predicted: set[int] | None = None  # what the prefetcher predicted for the next call


class PooledStore(ExpertStore):
    """A budgeted fast pool in front of a slow tier: `slots` rows per MoE layer, all of them in one
    buffer per weight that every MoE layer shares.

    The budget is every row the store holds: there is no staging memory beside it. Each layer has a
    quota of `slots` rows and evicts its own least recently used expert while it holds its quota. A
    call (or a prediction) that needs more distinct experts than that (a prefill; a decode step of a
    large batch) borrows rows from other layers: first rows a layer holds beyond its own quota, then
    any, taking the layer whose next call is furthest away first (the one that ran most recently),
    never an expert that layer's pending prediction names or one still loading. The kernel gets the
    whole buffer and ids that name its rows, so nothing resident is ever copied. A call can need every
    expert of its layer, so the rows must hold at least one layer's experts (`slots_for_budget`).

    On CPU `NativePooledStore` (`moebench.engine.store.native`) does this bookkeeping in C++; this
    class is the reference it is tested against, and the store for CUDA and Python-thread loads."""

    store_name = "pooled"

    def __init__(self, ckpt, runtime, tier, slots: int, workers: int = 0, parallel_demand: bool = False,
                 dtype: torch.dtype | None = None):
        cfg = ckpt.config
        self.cfg, self.tier, self.slots = cfg, tier, slots
        self.budget = runtime.expert_budget
        self.overrides = runtime.overrides
        self.device = runtime.device
        self.cuda = runtime.device == "cuda"
        dtype = dtype or runtime.torch_dtype
        self.dtype = dtype
        inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
        # int8 rows carry their scale (--weights int8): 8 bytes more per row; int4 rows are Q4_0 blocks
        # (--weights int4): 18 bytes per 32 values (kernels/reference.py: stored_width)
        w13_width, w2_width = stored_width(hidden, dtype), stored_width(inter, dtype)
        self.expert_pool_bytes = (2 * inter * w13_width + hidden * w2_width) * torch.empty(0, dtype=dtype).element_size()
        moe = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
        # The budget holds the read buffers too (one per thread that reads from the tier: the loader
        # workers, the demand readers, the model's thread): their bytes are rows the pool does not get.
        demand = parallel_demand and workers > 1
        reading_threads = 1 + workers * (2 if demand else 1)
        buffers = reading_threads * tier.read_buffer_bytes_per_thread()
        self.rows = len(moe) * slots - math.ceil(buffers / self.expert_pool_bytes)
        if self.rows < cfg.num_experts:
            from moebench.engine.store.budget_floor import smallest_budget_note

            raise MoebenchError(
                f"--expert-budget {self.budget}: {len(moe) * slots} expert rows, less "
                f"{len(moe) * slots - self.rows} for {reading_threads} read buffers, cannot hold the "
                f"{cfg.num_experts} experts one call of a layer can need; "
                + smallest_budget_note(cfg.num_experts, len(moe), len(moe) * slots - self.rows,
                                       self.expert_pool_bytes))
        self.quota = self.rows // len(moe)  # each layer's share (see _claim)
        self.w13 = memory.empty((self.rows, 2 * inter, w13_width), dtype, runtime.device)
        self.w2 = memory.empty((self.rows, hidden, w2_width), dtype, runtime.device)
        self.pools: dict[int, _Pool] = {}
        for p, i in enumerate(moe):
            pool = _Pool(i, cfg.num_experts)
            # Start warm, as a server would: the first S experts of each layer, not counted as loads.
            w = ckpt.layers[i]
            for e in range(self.quota):
                row = p * self.quota + e
                if w.w13 is not None:
                    self.w13[row].copy_(w.w13[e])
                    self.w2[row].copy_(w.w2[e])
                else:
                    tier.load(i, e, self.w13[row], self.w2[row])
                pool.slot_of[e] = row
                pool.table[e] = row
            self.pools[i] = pool
        self.free = list(range(self.rows - 1, len(moe) * self.quota - 1, -1))
        # MoE layers, the most recently fetched first: the order in which a claim borrows rows (the
        # layer that ran last is the one needed again furthest ahead)
        self.recent: list[_Pool] = list(reversed(self.pools.values()))
        self.workers = workers
        # Loads run on native threads that never take the GIL where the tier can describe them
        # (`moebench.kernels.expert_loader`), else on Python threads.
        # native_rows: the tier can describe loads into this buffer's rows; native: workers do them
        # (prepared already where make_store_and_prefetcher asked whether the native store can run)
        self.native_rows = not self.cuda and (tier.sync is not None or tier.prepare_native(dtype))
        self.native = bool(workers) and self.native_rows
        self.row_bytes = (self.w13[0].nbytes, self.w2[0].nbytes)
        self._load_error = _NeverRaised
        self.loader_cpus: list[int] = []  # any core
        if self.native:
            from moebench.kernels.expert_loader import load_extension

            self._load_error = load_extension().LoadError
        # Demand loads get readers of their own (`demand`): queued behind prefetches already running
        # (some of them wrong guesses) they would wait for the disk twice.
        if self.native:
            # A worker that slept between two plans would pay a wake-up at each one, as much as a
            # host copy (docs/prefetch.md); one idle worker spins instead, and stops spinning as soon
            # as another thread wants its core (kernels/csrc/expert_loader.cpp).
            spin = runtime.store.loader_spin_us
            self.loader_cpus = loader_cpus(runtime)
            self.executor = tier.native_loader(workers, spin, self.loader_cpus)
            self.demand_executor = tier.native_loader(workers, spin, self.loader_cpus) if demand else None
        else:
            self.executor = ThreadPoolExecutor(workers, thread_name_prefix="moebench-prefetch") if workers else None
            self.demand_executor = ThreadPoolExecutor(workers, thread_name_prefix="moebench-demand") if demand else None
        self.side_stream = torch.cuda.Stream() if self.cuda and workers else None
        self.counters = Counters(("lookups", "late_hits", "evictions", "overflow_calls", "cancelled",
                                   "predicted", "needed_predicted", "predicted_needed", "borrowed",
                                   "prefetch_no_room"))
        self.rss = memory.PeakRss()
        self._memory = {"expert_pool_bytes": self.w13.nbytes + self.w2.nbytes,
                        **_held_elsewhere(ckpt, tier, (self.w13, self.w2)), "read_buffer_bytes": buffers}

    def memory(self) -> dict:
        return memory_evidence(self._memory, self.rss)

    # ------------------------------------------------------------------ loading

    def _load_many(self, layer: int, items, after=None):
        """Runs in a worker thread: copy experts into their rows; on CUDA on the side stream, after
        the rows' previous readers, returning the event the compute stream must wait for."""
        if self.side_stream is None:
            self.tier.load_many(layer, items)
            return None
        with torch.cuda.stream(self.side_stream):
            self.side_stream.wait_event(after)
            self.tier.load_many(layer, items)
            done = torch.cuda.Event()
            done.record(self.side_stream)
        return done

    def _submit(self, layer: int, loads: list[tuple[int, int]], executor) -> list:
        """Queue (expert, buffer row) loads; -> one future-like handle each (cancel, done, result).

        Native: one call describes them all and its workers never take the GIL. Python threads: at
        most one job per worker, so one wake-up per worker, not per expert (on a busy CPU every
        hand-over of the GIL to a freshly woken thread costs a scheduler slice); a load whose future
        was cancelled before its turn is skipped."""
        if self.native:
            return executor.submit(self._describe(layer, loads))
        loads = [(e, self.w13[row], self.w2[row]) for e, row in loads]
        after = None
        if self.side_stream is not None:
            after = torch.cuda.Event()
            after.record()
        futs = [Future() for _ in loads]
        jobs = [[] for _ in range(min(len(loads), self.workers))]
        for i, (load, fut) in enumerate(zip(loads, futs)):
            jobs[i % len(jobs)].append((fut, *load))
        for job in jobs:
            executor.submit(self._run_job, layer, job, after)
        return futs

    def _run_job(self, layer, job, after) -> None:
        """Load a job's experts one at a time where the tier reads each on its own (disk: a waiter
        gets its expert as soon as it is read), all at once where one call does them all (host)."""
        batches = [job] if self.tier.batched else [[item] for item in job]
        for batch in batches:
            batch = [item for item in batch if item[0].set_running_or_notify_cancel()]
            if not batch:
                continue
            try:
                done = self._load_many(layer, [item[1:] for item in batch], after)
                for item in batch:
                    item[0].set_result(done)
            except BaseException as e:  # handed to whoever waits for these experts
                for item in batch:
                    item[0].set_exception(e)

    def _finish(self, fut: Future) -> None:
        """Wait for one load (re-raising its error) and order the compute stream after it."""
        try:
            done = fut.result()
        except self._load_error as e:  # a native read that came back short or failed
            raise MoebenchError(str(e)) from None
        if done is not None:
            torch.cuda.current_stream().wait_event(done)

    def _wait(self, fut: Future | None) -> float:
        """Wait for a load if there is one; -> seconds waited (stall)."""
        if fut is None:
            return 0.0
        if fut.done():
            self._finish(fut)  # (re-raises a failed load)
            return 0.0
        self.counters.add("late_hits", 1)
        t0 = time.perf_counter()
        self._finish(fut)
        return time.perf_counter() - t0

    def _cancel(self, fut: Future) -> bool:
        """Cancel a load that has not started: it read nothing and wrote nothing."""
        if not fut.cancel():
            return False
        self.counters.add("bytes_loaded", -self.tier.expert_bytes)  # counted when issued, never read
        self.counters.add("cancelled", 1)
        return True

    def _evict(self, pool: _Pool, expert: int) -> int:
        row = pool.slot_of.pop(expert)
        pool.table[expert] = -1
        pool.prefetched.discard(expert)
        self.counters.add("evictions", 1)
        return row

    def _evict_lru(self, pool: _Pool, keep, force: bool = False) -> int | None:
        """The row of `pool`'s least recently used expert outside `keep` whose row is not being
        written; with `force`, a load in flight is cancelled or waited out instead of skipped."""
        for x in pool.slot_of:  # least recently used first
            if keep and x in keep:
                continue
            fut = pool.loading.get(x)
            if fut is not None:
                if not fut.done() and not force:
                    continue
                if not self._cancel(fut):
                    self._finish(fut)
                del pool.loading[x]
            return self._evict(pool, x)
        return None

    def _claim(self, layer: int, expert: int, protect: set[int], demand: bool = False) -> int | None:
        """A row for `layer`'s `expert`: a free one; else, while the layer holds its quota, its own
        least recently used expert outside `protect`; else a row borrowed from another layer (see the
        class). None when there is none (a prefetch then stops); a demand load always gets one, giving
        up other layers' predictions and waiting out loads in flight if it must."""
        own = self.pools[layer]
        if self.free:
            row = self.free.pop()
        else:
            quota = self.quota
            others = [p for p in self.recent if p is not own]
            over = [p for p in others if len(p.slot_of) > quota]
            first = [own] + over if len(own.slot_of) >= quota else over + [own]
            row = None
            for p in first + [p for p in others if p not in over]:
                row = self._evict_lru(p, protect if p is own else p.predicted)
                if row is not None:
                    break
            if row is None and demand:
                for p in [own] + others:
                    row = self._evict_lru(p, protect if p is own else None, force=True)
                    if row is not None:
                        break
            if row is None:
                return None
            if p is not own:
                self.counters.add("borrowed", 1)
        own.slot_of[expert] = row
        own.table[expert] = row
        return row

    # ------------------------------------------------------------------ the MoE block's call

    def fetch(self, layer, topk_ids):
        pool = self.pools[layer]
        ids = host_ids(topk_ids)
        needed = sorted(set(ids.ravel().tolist()))
        need = set(needed)
        c = self.counters
        c.add("lookups", len(needed))
        if len(needed) > self.quota:
            c.add("overflow_calls", 1)
        self._score_prediction(pool, need)
        self._drop_unneeded_loads(pool, need)
        c.add("prefetch_hits", len(need & pool.prefetched))
        pool.prefetched.clear()
        stall = 0.0
        misses = []
        slot_of = pool.slot_of
        for e in needed:
            if e in slot_of:
                slot_of.move_to_end(e)
                if pool.loading:
                    stall += self._wait(pool.loading.pop(e, None))
            else:
                misses.append(e)
        c.add("expert_hits", len(needed) - len(misses))
        if misses:
            stall += self._load_misses(layer, pool, misses, need)
        c.add("stall_s", stall)
        recent = self.recent
        if recent[0] is not pool:
            recent.remove(pool)
            recent.insert(0, pool)
        rows = torch.from_numpy(pool.table[ids])
        return self.w13, self.w2, rows.to(topk_ids.device) if self.cuda else rows

    def _load_misses(self, layer, pool, misses, need) -> float:
        """Load the call's missing experts on demand into free or least recently used rows (see
        `_claim`). -> seconds spent, claims included (a claim may wait out a load in flight)."""
        c = self.counters
        c.add("expert_misses", len(misses))
        c.add("bytes_loaded", len(misses) * self.tier.expert_bytes)
        t0 = time.perf_counter()
        loads = [(e, self._claim(layer, e, need, demand=True)) for e in misses]
        if self.demand_executor is not None and len(loads) > 1:
            for f in self._submit(layer, loads, self.demand_executor):
                self._finish(f)
        elif self.native_rows:  # the baseline: one at a time, in this thread
            self.tier.run_native(self._describe(layer, loads))
        else:  # the same through the tier's Python path (the compute stream on CUDA)
            for e, row in loads:
                self.tier.load(layer, e, self.w13[row], self.w2[row])
        return time.perf_counter() - t0

    def _describe(self, layer: int, loads: list[tuple[int, int]]) -> list[tuple]:
        """Native descriptions of (expert, buffer row) loads."""
        base13, base2 = self.w13.data_ptr(), self.w2.data_ptr()
        n13, n2 = self.row_bytes
        describe = self.tier.describe
        return [describe(layer, e, base13 + row * n13, base2 + row * n2) for e, row in loads]

    def _drop_unneeded_loads(self, pool: _Pool, need: set[int]) -> None:
        """Prefetches for this call that turned out wrong and have not started yet cost nothing:
        cancel them and give their rows back."""
        for e in [e for e in pool.loading if e not in need]:
            if self._cancel(pool.loading[e]):
                del pool.loading[e]
                self.free.append(self._evict(pool, e))
                self.counters.add("evictions", -1)  # never held an expert

    # ------------------------------------------------------------------ prefetch

    def prefetch(self, layer: int, experts: list[int]) -> None:
        """Start loading `experts` (distinct, most wanted first) for `layer`'s next call, now: predicted
        residents become most recently used; missing ones go to rows `_claim` finds (the layer's least
        recently used experts that are not predicted, then rows borrowed from other layers); once none
        is left the rest of the prediction is dropped (`prefetch_no_room`).

        Called between MoE calls, so on CPU no kernel is reading any row; on CUDA a queued kernel may
        still read a row, and the copies wait for the compute stream (see `_submit`)."""
        if self.executor is None:
            return
        pool = self.pools[layer]
        if pool.predicted is not None and pool.predicted.issuperset(experts):
            return  # the late guess often repeats the early one: all of it is resident or on its way
        keep = set(experts)
        if pool.predicted is not None:  # a second guess for the same call (early, then late)
            keep |= pool.predicted
        pool.predicted = keep
        slot_of = pool.slot_of
        for e in reversed(experts):  # predicted residents become the most recently used
            if e in slot_of:
                slot_of.move_to_end(e)
        loads = []
        for e in experts:
            if e in slot_of:
                continue
            row = self._claim(layer, e, keep)
            if row is None:
                self.counters.add("prefetch_no_room", 1)
                break
            loads.append((e, row))
        if not loads:
            return
        for (e, _), fut in zip(loads, self._submit(layer, loads, self.executor)):
            pool.loading[e] = fut
            pool.prefetched.add(e)
        self.counters.add("prefetch_issued", len(loads))
        self.counters.add("bytes_loaded", len(loads) * self.tier.expert_bytes)

    def _score_prediction(self, pool: _Pool, need: set[int]) -> None:
        if pool.predicted is None:
            return
        c = self.counters
        both = len(pool.predicted & need)
        c.add("predicted", len(pool.predicted))
        c.add("needed_predicted", len(need))  # needed experts in calls that had a prediction
        c.add("predicted_needed", both)
        pool.predicted = None

    # ------------------------------------------------------------------ reporting

    def take_step(self):
        return self.counters.take_step()

    def evidence(self):
        t = self.counters.total
        lookups = t["expert_hits"] + t["expert_misses"]
        return {
            "store": self.store_name,
            "expert_budget": self.budget,
            "slots_per_layer": self.slots,
            "expert_dtype": dtype_name(self.dtype),
            "num_experts": self.cfg.num_experts,
            "rows": self.rows,
            "rows_per_layer": self.quota,
            **self.memory(),
            **self.tier.evidence(),
            "load_workers": self.workers,
            "native_loader": self.native,
            "loader_cpus": self.loader_cpus,
            "lookups": lookups,
            "expert_hits": t["expert_hits"],
            "expert_misses": t["expert_misses"],
            "hit_rate": _ratio(t["expert_hits"], lookups),
            "late_hits": t["late_hits"],
            "prefetch_issued": t["prefetch_issued"],
            "prefetch_hits": t["prefetch_hits"],
            "prefetch_cancelled": t["cancelled"],
            # Of the experts loaded ahead, the share the target call used.
            "prefetch_precision": _ratio(t["prefetch_hits"], t["prefetch_issued"]),
            # Of the misses there would have been, the share prefetch turned into hits.
            "prefetch_recall": _ratio(t["prefetch_hits"], t["prefetch_hits"] + t["expert_misses"])
            if t["prefetch_issued"] else None,
            # The predictor itself, resident or not: |P & A| / |P| and |P & A| / |A| over predicted calls.
            "prediction_precision": _ratio(t["predicted_needed"], t["predicted"]),
            "prediction_recall": _ratio(t["predicted_needed"], t["needed_predicted"]),
            "bytes_loaded": t["bytes_loaded"],
            "stall_s": t["stall_s"],
            "evictions": t["evictions"],
            "overflow_calls": t["overflow_calls"],
            "borrowed_rows": t["borrowed"],
            "prefetch_no_room": t["prefetch_no_room"],
        }

    def close(self):
        for ex in (self.executor, self.demand_executor):
            if ex is None:
                continue
            if self.native:
                ex.close()  # cancels what is queued, waits for running loads, joins the workers
            else:
                ex.shutdown(wait=True, cancel_futures=True)
        self.executor = self.demand_executor = None
        self.tier.close()


class NoPrefetch:
    """prefetch=off: every miss is loaded when its layer asks for it (by the store's demand path)."""

    name = "off"
    active = False  # hooks that do nothing: the MoE block does not call them

    def __init__(self, store=None):
        self.store = store

    def activation_errors(self, store) -> list[str]:
        return store_activation_errors(store)

    def before_forward(self, h: torch.Tensor) -> None:
        """The embeddings of a forward pass, before its first layer."""

    def before_layer(self, layer: int, x: torch.Tensor) -> None:
        """MoE layer `layer`'s input, before it fetches its experts."""

    def after_layer(self, layer: int, h: torch.Tensor) -> None:
        """The residual stream once MoE layer `layer` has added its output."""

    def evidence(self) -> dict:
        return {}


def store_activation_errors(store) -> list[str]:
    """A CPU store whose loads ran on Python threads because the native loader did not build fell
    back (`native_loader: false` in the evidence); that is an error unless the user chose it
    (the expert_loader override) or accepts fallbacks (the allow_fallback override)."""

    if not isinstance(store, PooledStore) or store.cuda or store.native or not store.workers:
        return []
    overrides = store.overrides
    if overrides.expert_loader != "native" or overrides.allow_fallback:
        return []
    from moebench.kernels.expert_loader import load_extension

    if load_extension() is not None:
        return []  # built; this tier keeps its loads in Python by its own choice
    return [f"expert loads ran on Python threads: the native loader did not build ({store.tier.name} tier, "
            f"{store.workers} workers); set MOEBENCH_EXPERT_LOADER=python to accept that"]
