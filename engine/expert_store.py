"""Where the MoE block gets expert weights from.

`ResidentStore` holds every expert (budget 1.0). `PooledStore` holds only a budgeted fast pool per
MoE layer (w13 [S, 2I, H], w2 [S, H, I] in the compute dtype, an expert -> slot map) and loads the
rest from a slow tier (`moebench.engine.offload`: host memory or disk). Both answer the same call,
`fetch(layer, topk_ids) -> (w13, w2, ids remapped to rows of w13/w2)`, so the kernel never knows
which store it runs on.

Baseline (prefetch=off): an expert missing from the pool is loaded on demand, synchronously, one at
a time, into the least recently used slot. A prefetcher (prefetch=lookahead, `moebench.engine.
prefetch`) plans loads for the next layer through `plan_prefetch`; the store issues them to worker
threads once the current layer's own experts are in place, so they overlap this layer's compute.

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

import torch

from moebench.engine import memory
from moebench.errors import MoebenchError

STEP_KEYS = ("expert_hits", "expert_misses", "prefetch_issued", "prefetch_hits", "bytes_loaded", "stall_s")


class ExpertStore:
    def fetch(self, layer: int, topk_ids: torch.Tensor):
        """-> (w13 pool, w2 pool, topk_ids remapped to pool slots)."""
        raise NotImplementedError

    def take_step(self) -> dict:
        return {}

    def evidence(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class _Counters:
    """Per-step counters (reset by take_step) plus run totals, both fed by the same `add`."""

    def __init__(self, extra_total_keys=()):
        self.step = dict.fromkeys(STEP_KEYS, 0)
        self.step["stall_s"] = 0.0
        self.total = dict(self.step)
        for k in extra_total_keys:
            self.total[k] = 0

    def add(self, key: str, value) -> None:
        if key in self.step:
            self.step[key] += value
        self.total[key] += value

    def take_step(self) -> dict:
        out = self.step
        self.step = dict.fromkeys(STEP_KEYS, 0)
        self.step["stall_s"] = 0.0
        return out


def _ratio(a, b):
    return a / b if b else None


class ResidentStore(ExpertStore):
    """Every expert in the fast pool: every look-up is a hit, nothing is ever loaded."""

    def __init__(self, ckpt, budget=1.0):
        self.layers = ckpt.layers
        self.budget = budget
        self.counters = _Counters()

    def fetch(self, layer, topk_ids):
        w = self.layers[layer]
        self.counters.add("expert_hits", int(torch.unique(topk_ids).numel()))
        return w.w13, w.w2, topk_ids

    def take_step(self):
        return self.counters.take_step()

    def evidence(self):
        t = self.counters.total
        return {"store": "resident", "expert_budget": self.budget, "expert_hits": t["expert_hits"],
                "expert_misses": 0, "hit_rate": 1.0 if t["expert_hits"] else None}


class _Pool:
    """One MoE layer's fast pool: S slots, which expert each holds, LRU order, loads in flight."""

    def __init__(self, slots: int, num_experts: int, inter: int, hidden: int, dtype, device):
        self.w13 = memory.empty((slots, 2 * inter, hidden), dtype, device)
        self.w2 = memory.empty((slots, hidden, inter), dtype, device)
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # resident or loading; least recent first
        self.free = list(range(slots - 1, -1, -1))
        self.loading: dict[int, Future] = {}
        # expert -> slot (-1: not held), a list because per-element writes to a tensor cost
        # microseconds each; it becomes a tensor once per call to remap ids
        self.table = [-1] * num_experts
        self.prefetched: set[int] = set()  # loaded by prefetch for the next call, not yet used
        self.predicted: set[int] | None = None  # what the prefetcher predicted for the next call


class PooledStore(ExpertStore):
    """A budgeted fast pool per MoE layer in front of a slow tier."""

    def __init__(self, ckpt, runtime, tier, slots: int, workers: int = 0, parallel_demand: bool = False):
        cfg = ckpt.config
        self.cfg, self.tier, self.slots = cfg, tier, slots
        self.budget = runtime.expert_budget
        self.device = runtime.device
        self.cuda = runtime.device == "cuda"
        dtype = runtime.torch_dtype
        self.expert_pool_bytes = cfg.expert_param_count * torch.empty(0, dtype=dtype).element_size()
        self.pools: dict[int, _Pool] = {}
        for i in range(cfg.num_layers):
            if not cfg.is_moe_layer(i):
                continue
            pool = _Pool(slots, cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size, dtype, runtime.device)
            # Start warm, as a server would: the first S experts of each layer, not counted as loads.
            w = ckpt.layers[i]
            for e in range(slots):
                s = pool.free.pop()
                if w.w13 is not None:
                    pool.w13[s].copy_(w.w13[e])
                    pool.w2[s].copy_(w.w2[e])
                else:
                    tier.load(i, e, pool.w13[s], pool.w2[s])
                pool.slot_of[e] = s
                pool.table[e] = s
            self.pools[i] = pool
        self.workers = workers
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="moebench-prefetch") if workers else None
        # Demand loads get readers of their own: queued behind prefetches already running (some of
        # them wrong guesses) they would wait for the disk twice.
        self.demand_executor = (ThreadPoolExecutor(workers, thread_name_prefix="moebench-demand")
                                if parallel_demand and workers > 1 else None)
        self.side_stream = torch.cuda.Stream() if self.cuda and workers else None
        self.pending: tuple[int, list[int]] | None = None
        self.counters = _Counters(("lookups", "late_hits", "evictions", "overflow_calls", "cancelled",
                                   "predicted", "needed_predicted", "predicted_needed"))
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------------ loading

    def _load_many(self, layer: int, items, after=None):
        """Runs in a worker thread: copy experts into their slots; on CUDA on the side stream, after
        the slots' previous readers, returning the event the compute stream must wait for."""
        if self.side_stream is None:
            self.tier.load_many(layer, items)
            return None
        with torch.cuda.stream(self.side_stream):
            self.side_stream.wait_event(after)
            self.tier.load_many(layer, items)
            done = torch.cuda.Event()
            done.record(self.side_stream)
        return done

    def _submit(self, layer: int, loads: list[tuple[int, int]], executor) -> list[Future]:
        """Queue (expert, slot) loads as at most one job per worker, each load with its own future.
        One wake-up per worker, not per expert: on a busy CPU every hand-over of the GIL to a
        freshly woken thread costs a scheduler slice. A load whose future was cancelled before its
        turn is skipped."""
        pool = self.pools[layer]
        after = None
        if self.side_stream is not None:
            after = torch.cuda.Event()
            after.record()
        futs = [Future() for _ in loads]
        jobs = [[] for _ in range(min(len(loads), self.workers))]
        for i, ((expert, slot), fut) in enumerate(zip(loads, futs)):
            jobs[i % len(jobs)].append((fut, expert, pool.w13[slot], pool.w2[slot]))
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
        done = fut.result()
        if done is not None:
            torch.cuda.current_stream().wait_event(done)

    def _evict(self, pool: _Pool, expert: int) -> int:
        slot = pool.slot_of.pop(expert)
        pool.table[expert] = -1
        pool.prefetched.discard(expert)
        self.counters.add("evictions", 1)
        return slot

    def _claim(self, pool: _Pool, expert: int, protect: set[int], wait: bool) -> int | None:
        """A slot for `expert`: a free one, else the least recently used expert outside `protect`
        whose slot is not being written. With `wait`, an in-flight load may be waited out."""
        if pool.free:
            slot = pool.free.pop()
        else:
            victim = None
            for x in pool.slot_of:  # least recently used first
                if x in protect:
                    continue
                fut = pool.loading.get(x)
                if fut is not None:
                    if not fut.done():
                        continue
                    self._finish(pool.loading.pop(x))
                victim = x
                break
            if victim is None:
                if not wait:
                    return None
                # Every candidate is a load in flight: wait out the oldest. One exists because the
                # pool holds at least as many slots as this call needs experts.
                victim = next(x for x in pool.slot_of if x not in protect)
                t0 = time.perf_counter()
                self._finish(pool.loading.pop(victim))
                self.counters.add("stall_s", time.perf_counter() - t0)
            slot = self._evict(pool, victim)
        pool.slot_of[expert] = slot
        pool.table[expert] = slot
        return slot

    # ------------------------------------------------------------------ the MoE block's call

    def fetch(self, layer, topk_ids):
        pool = self.pools[layer]
        needed = torch.unique(topk_ids).tolist()
        need = set(needed)
        c = self.counters
        c.add("lookups", len(needed))
        self._score_prediction(pool, need)
        self._drop_unneeded_loads(pool, need)
        c.add("prefetch_hits", len(need & pool.prefetched))
        pool.prefetched.clear()
        if len(needed) > self.slots:
            out = self._fetch_overflow(layer, pool, topk_ids, needed)
        else:
            out = self._fetch_pooled(layer, pool, topk_ids, needed, need)
        self._issue_pending()
        return out

    def _fetch_pooled(self, layer, pool, topk_ids, needed, need):
        c = self.counters
        misses = []
        stall = 0.0
        for e in needed:
            if e in pool.slot_of:
                c.add("expert_hits", 1)
                pool.slot_of.move_to_end(e)
                fut = pool.loading.pop(e, None)
                if fut is not None:
                    if not fut.done():
                        c.add("late_hits", 1)
                    t0 = time.perf_counter()
                    self._finish(fut)
                    stall += time.perf_counter() - t0
            else:
                misses.append(e)
        if misses:
            c.add("expert_misses", len(misses))
            c.add("bytes_loaded", len(misses) * self.tier.expert_bytes)
            slots = [self._claim(pool, e, need, wait=True) for e in misses]
            t0 = time.perf_counter()
            if self.demand_executor is not None and len(misses) > 1:
                futs = self._submit(layer, list(zip(misses, slots)), self.demand_executor)
                for f in futs:
                    self._finish(f)
            else:  # the baseline: one at a time, on the critical path (the compute stream on CUDA)
                for e, s in zip(misses, slots):
                    self.tier.load(layer, e, pool.w13[s], pool.w2[s])
            stall += time.perf_counter() - t0
        c.add("stall_s", stall)
        table = torch.tensor(pool.table, dtype=torch.long)
        ids = table[topk_ids.cpu()].to(topk_ids.device) if self.cuda else table[topk_ids]
        return pool.w13, pool.w2, ids

    def _fetch_overflow(self, layer, pool, topk_ids, needed):
        """A call needs more distinct experts than the pool has slots (a long prefill): serve it from a
        transient scratch buffer holding exactly those experts; the pool itself is left as it is."""
        c = self.counters
        c.add("overflow_calls", 1)
        n = len(needed)
        if self._scratch is None or self._scratch[0].shape[0] < n:
            self._scratch = (memory.empty((n, *pool.w13.shape[1:]), pool.w13.dtype, pool.w13.device),
                             memory.empty((n, *pool.w2.shape[1:]), pool.w2.dtype, pool.w2.device))
        w13, w2 = self._scratch
        remap = torch.full((self.cfg.num_experts,), -1, dtype=torch.long)
        stall = 0.0
        for i, e in enumerate(needed):
            remap[e] = i
            t0 = time.perf_counter()
            if e in pool.slot_of:
                c.add("expert_hits", 1)
                pool.slot_of.move_to_end(e)
                fut = pool.loading.pop(e, None)
                if fut is not None:
                    self._finish(fut)
                    stall += time.perf_counter() - t0
                s = pool.slot_of[e]
                w13[i].copy_(pool.w13[s])
                w2[i].copy_(pool.w2[s])
            else:
                c.add("expert_misses", 1)
                c.add("bytes_loaded", self.tier.expert_bytes)
                self.tier.load(layer, e, w13[i], w2[i])
                stall += time.perf_counter() - t0
        c.add("stall_s", stall)
        ids = remap[topk_ids.cpu()].to(topk_ids.device)
        return w13[:n], w2[:n], ids

    def _drop_unneeded_loads(self, pool: _Pool, need: set[int]) -> None:
        """Prefetches for this call that turned out wrong and have not started yet cost nothing:
        cancel them and give their slots back."""
        for e in [e for e in pool.loading if e not in need]:
            if pool.loading[e].cancel():
                del pool.loading[e]
                pool.free.append(self._evict(pool, e))
                self.counters.add("evictions", -1)  # never held an expert
                self.counters.add("bytes_loaded", -self.tier.expert_bytes)  # counted when issued, never read
                self.counters.add("cancelled", 1)

    # ------------------------------------------------------------------ prefetch

    def plan_prefetch(self, layer: int, experts: list[int]) -> None:
        """Prefetch `experts` (most wanted first) into `layer`'s pool once the current call's own
        experts are in place; the plan is issued at the end of the next `fetch`."""
        self.pending = (layer, experts)

    def _issue_pending(self) -> None:
        if self.pending is None or self.executor is None:
            return
        layer, experts = self.pending
        self.pending = None
        pool = self.pools[layer]
        experts = experts[: self.slots]
        pool.predicted = set(experts)
        keep = pool.predicted
        for e in reversed(experts):  # predicted residents become the most recently used
            if e in pool.slot_of:
                pool.slot_of.move_to_end(e)
        loads = []
        for e in experts:
            if e in pool.slot_of:
                continue
            slot = self._claim(pool, e, keep, wait=False)
            if slot is None:
                break
            loads.append((e, slot))
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
            "store": "pooled",
            "expert_budget": self.budget,
            "slots_per_layer": self.slots,
            "num_experts": self.cfg.num_experts,
            "fast_pool_bytes": self.slots * len(self.pools) * self.expert_pool_bytes,
            **self.tier.evidence(),
            "load_workers": self.workers,
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
        }

    def close(self):
        for ex in (self.executor, self.demand_executor):
            if ex is not None:
                ex.shutdown(wait=True, cancel_futures=True)
        self.executor = self.demand_executor = None
        self.tier.close()


class NoPrefetch:
    name = "off"

    def before_layer(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor) -> None:
        pass

    def evidence(self) -> dict:
        return {}


# ---------------------------------------------------------------------- budget

_UNITS = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3}


def _budget_bytes(text: str) -> float:
    t = text.strip().upper().replace(" ", "")
    for unit, scale in _UNITS.items():  # longest units first: GIB before GB
        if t.endswith(unit):
            try:
                return float(t[: -len(unit)]) * scale
            except ValueError:
                break
    raise MoebenchError(f"--expert-budget: expected a fraction such as 0.5 or a size such as 8GB, got '{text}'")


def _machine_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def slots_for_budget(cfg, runtime) -> int:
    """Fast-pool slots per MoE layer for `runtime.expert_budget`; num_experts means all resident.

    A fraction f keeps floor(f * E) experts of every MoE layer; a size keeps as many as fit, split
    evenly over the MoE layers (compute-dtype bytes). One token needs top_k experts of a layer at
    once, so fewer slots than top_k is refused; calls needing more distinct experts than the pool
    holds (long prefills) go through a transient scratch buffer instead (see PooledStore).
    """
    budget = runtime.expert_budget
    E, k = cfg.num_experts, cfg.top_k
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    expert_bytes = cfg.expert_param_count * torch.empty(0, dtype=runtime.torch_dtype).element_size()
    total = moe_layers * E * expert_bytes
    try:
        fraction = float(budget)
        size = None
    except (TypeError, ValueError):
        fraction, size = None, _budget_bytes(str(budget))
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
    if slots < k:
        need = k * moe_layers * expert_bytes
        raise MoebenchError(
            f"--expert-budget {asked} leaves {slots} expert slots per MoE layer, but one token needs "
            f"top_k={k} experts of a layer at once: use at least {k / E:.3g} or {need / 2**20:.0f}MiB "
            f"(all experts: {total / 2**20:.0f}MiB)"
        )
    return min(slots, E)


def make_store_and_prefetcher(ckpt, runtime):
    """Build the expert store for the configured budget and tier, and the prefetch strategy."""
    from moebench.engine.offload import make_tier

    cfg = ckpt.config
    if runtime.offload_tier not in ("host", "disk"):
        raise MoebenchError(f"unknown --offload-tier '{runtime.offload_tier}' (choose host or disk)")
    slots = slots_for_budget(cfg, runtime)
    if slots >= cfg.num_experts:
        moe = [w for i, w in enumerate(ckpt.layers) if cfg.is_moe_layer(i)]
        if moe and moe[0].w13.dtype != runtime.torch_dtype:
            raise MoebenchError(
                f"{ckpt.path}: experts were loaded in {moe[0].w13.dtype} for an offloading budget; a fully "
                f"resident run (--expert-budget {runtime.expert_budget}) needs them loaded in the compute dtype"
            )
        store = ResidentStore(ckpt, runtime.expert_budget)
    else:
        lookahead = runtime.prefetch == "lookahead"
        disk = runtime.offload_tier == "disk"
        # O_DIRECT reads here: ~0.4 GB/s with one reader, ~0.7-1 GB/s with 4-16 in parallel
        readers = int(runtime.extra.get("readers", 8))
        # Workers exist only to overlap loads with compute, which is what prefetch=lookahead is;
        # the baseline loads on the critical path, one expert at a time.
        workers = (readers if disk else int(runtime.extra.get("host_workers", 1))) if lookahead else 0
        tier = make_tier(runtime.offload_tier, ckpt, runtime.device, readers)
        store = PooledStore(ckpt, runtime, tier, slots, workers, parallel_demand=lookahead and disk)
    if runtime.prefetch == "lookahead":
        from moebench.engine.prefetch import LookaheadPrefetcher

        return store, LookaheadPrefetcher(ckpt, store, extra_per_token=int(runtime.extra.get("lookahead_extra", 0)))
    return store, NoPrefetch()
