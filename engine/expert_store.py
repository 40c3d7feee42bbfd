"""Where the MoE block gets expert weights from.

`ResidentStore` holds every expert (budget 1.0). `PooledStore` holds only a budgeted fast pool per
MoE layer (w13 [S, 2I, H], w2 [S, H, I] in the compute dtype, an expert -> slot map) and loads the
rest from a slow tier (`moebench.engine.offload`: host memory or disk). Both answer the same call,
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
from moebench.engine.offload import expert_file_dtype, experts_in, make_tier
from moebench.errors import MoebenchError

DEFAULT_DISK_READERS = 3
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


def host_ids(ids: torch.Tensor) -> np.ndarray:
    """Expert ids as a numpy array: the store's and the prefetcher's work on a few ids per call is
    done in numpy, whose calls cost ~0.1 us where a small torch call costs ~10 us inside a decode step
    (its code is cold after the layer's kernel)."""
    return ids.numpy() if ids.device.type == "cpu" else ids.cpu().numpy()


class _NeverRaised(Exception):
    """Stands for the native loader's error class where no native loader runs."""


def loader_cpus(runtime) -> list[int]:
    """The cores the native loader threads run on: the last ones of this process's set beyond the
    model's intra-op threads, so a loader never takes the model thread's core (on 2 cores, disk
    lookahead at batch 1 was ~8% faster so). [] (any core) when the model's threads need every
    core, or with `runtime.extra["loader_cpus"] = "any"`; a list ("1" or "2,3") picks them."""
    choice = str(runtime.extra.get("loader_cpus", "auto")).strip()
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


class ResidentStore(ExpertStore):
    """Every expert in the fast pool: every look-up is a hit, nothing is ever loaded."""

    def __init__(self, ckpt, budget=1.0, dtype: torch.dtype | None = None):
        self.experts = {i: (w.w13, w.w2) for i, w in enumerate(ckpt.layers) if w.w13 is not None}
        if dtype is not None and any(w13.dtype != dtype for w13, _ in self.experts.values()):
            # converted once per checkpoint, where the loaded experts are
            self.experts = experts_in(ckpt, dtype, next(iter(self.experts.values()))[0].device)
        self.dtype = dtype
        self.budget = budget
        self.counters = _Counters()

    def fetch(self, layer, topk_ids):
        w13, w2 = self.experts[layer]
        self.counters.add("expert_hits", len(set(host_ids(topk_ids).ravel().tolist())))
        return w13, w2, topk_ids

    def take_step(self):
        return self.counters.take_step()

    def evidence(self):
        t = self.counters.total
        return {"store": "resident", "expert_budget": self.budget, "expert_hits": t["expert_hits"],
                "expert_dtype": _dtype_name(next(iter(self.experts.values()))[0].dtype) if self.experts else None,
                "expert_misses": 0, "hit_rate": 1.0 if t["expert_hits"] else None}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class _Pool:
    """One MoE layer's fast pool: S slots, which expert each holds, LRU order, loads in flight."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, first_row: int, num_experts: int):
        self.w13, self.w2 = w13, w2  # [S, ...] views of the store's buffer
        self.first_row = first_row  # row of slot 0 in that buffer
        slots = w13.shape[0]
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # resident or loading; least recent first
        self.free = list(range(slots - 1, -1, -1))
        self.loading: dict[int, Future] = {}
        # expert -> slot (-1: not held); numpy, not torch, for the reason given at `host_ids`
        self.table = np.full(num_experts, -1, dtype=np.int64)
        self.views = None  # (w13, w2) from slot 0: to the pool's end, and to its stage's end
        self.prefetched: set[int] = set()  # loaded by prefetch for the next call, not yet used
        self.predicted: set[int] | None = None  # what the prefetcher predicted for the next call


class _Stage:
    """Rows for the experts one call needs beyond its layer's pool, when its working set is larger than
    the pool (a decode step of 16 sequences at top-2 of 16 experts touches ~10 of them; a prefill, most).

    The rows are transient: filled for one call of one layer (by that layer's prefetch, then by the
    call's own misses) and never read again after it. E - S rows always suffice: a stage only holds
    experts that are not in the layer's pool, and one is added only while the pool is full."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, first_row: int):
        self.w13, self.w2 = w13, w2
        self.first_row = first_row
        self.layer: int | None = None  # the layer whose next call the rows are filled for
        self.row_of: dict[int, int] = {}
        self.free = list(range(w13.shape[0] - 1, -1, -1))
        self.loading: dict[int, Future] = {}
        self.prefetched: set[int] = set()


class PooledStore(ExpertStore):
    """A budgeted fast pool per MoE layer in front of a slow tier.

    All pools and the stages live in one buffer per weight ([pool of MoE layer 0 | pool of layer 1 |
    ... | stage 0 | stage 1]), so a call whose experts sit partly in its pool and partly in a stage is
    served by one view from its pool to the stage: nothing resident is ever copied. With a
    prefetcher there are two stages, alternating between consecutive MoE layers, so layer L+1's
    stage fills while layer L's kernel reads its own."""

    def __init__(self, ckpt, runtime, tier, slots: int, workers: int = 0, parallel_demand: bool = False,
                 dtype: torch.dtype | None = None):
        cfg = ckpt.config
        self.cfg, self.tier, self.slots = cfg, tier, slots
        self.budget = runtime.expert_budget
        self.device = runtime.device
        self.cuda = runtime.device == "cuda"
        dtype = dtype or runtime.torch_dtype
        self.dtype = dtype
        self.expert_pool_bytes = cfg.expert_param_count * torch.empty(0, dtype=dtype).element_size()
        moe = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
        stages = 2 if workers else 1
        stage_rows = cfg.num_experts - slots
        rows = len(moe) * slots + stages * stage_rows
        inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
        self.w13 = memory.empty((rows, 2 * inter, hidden), dtype, runtime.device)
        self.w2 = memory.empty((rows, hidden, inter), dtype, runtime.device)
        self.pools: dict[int, _Pool] = {}
        for p, i in enumerate(moe):
            lo = p * slots
            pool = _Pool(self.w13[lo : lo + slots], self.w2[lo : lo + slots], lo, cfg.num_experts)
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
        self.stages = []
        for k in range(stages):
            lo = len(moe) * slots + k * stage_rows
            self.stages.append(_Stage(self.w13[lo : lo + stage_rows], self.w2[lo : lo + stage_rows], lo))
        self.stage_of = {i: self.stages[p % stages] for p, i in enumerate(moe)}
        for i, pool in self.pools.items():  # the views a call hands the kernel, made once
            lo, stage = pool.first_row, self.stage_of[i]
            hi = stage.first_row + stage.w13.shape[0]
            pool.views = ((self.w13[lo : lo + slots], self.w2[lo : lo + slots]), (self.w13[lo:hi], self.w2[lo:hi]))
        self.staging_bytes = stages * stage_rows * self.expert_pool_bytes
        self.workers = workers
        # Loads run on native threads that never take the GIL where the tier can describe them
        # (`moebench.kernels.expert_loader`), else on Python threads.
        # native_rows: the tier can describe loads into this buffer's rows; native: workers do them
        self.native_rows = not self.cuda and tier.prepare_native(dtype)
        self.native = bool(workers) and self.native_rows
        self.row_bytes = (self.w13[0].nbytes, self.w2[0].nbytes)
        self._load_error = _NeverRaised
        self.loader_cpus: list[int] = []  # any core
        if self.native:
            from moebench.kernels.expert_loader import load_extension

            self._load_error = load_extension().LoadError
        # Demand loads get readers of their own: queued behind prefetches already running (some of
        # them wrong guesses) they would wait for the disk twice.
        demand = parallel_demand and workers > 1
        if self.native:
            # A worker that slept between two plans would pay a wake-up at each one, as much as a
            # host copy (docs/prefetch.md); one idle worker spins instead, and stops spinning as soon
            # as another thread wants its core (kernels/csrc/expert_loader.cpp).
            spin = int(runtime.extra.get("loader_spin_us", 2000))
            self.loader_cpus = loader_cpus(runtime)
            self.executor = tier.native_loader(workers, spin, self.loader_cpus)
            self.demand_executor = tier.native_loader(workers, spin, self.loader_cpus) if demand else None
        else:
            self.executor = ThreadPoolExecutor(workers, thread_name_prefix="moebench-prefetch") if workers else None
            self.demand_executor = ThreadPoolExecutor(workers, thread_name_prefix="moebench-demand") if demand else None
        self.side_stream = torch.cuda.Stream() if self.cuda and workers else None
        self.counters = _Counters(("lookups", "late_hits", "evictions", "overflow_calls", "cancelled",
                                   "predicted", "needed_predicted", "predicted_needed", "staged"))

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
        slot = pool.slot_of.pop(expert)
        pool.table[expert] = -1
        pool.prefetched.discard(expert)
        self.counters.add("evictions", 1)
        return slot

    def _claim(self, pool: _Pool, expert: int, protect: set[int]) -> int | None:
        """A slot for `expert`: a free one, else the least recently used expert outside `protect`
        whose slot is not being written; None when there is none (the caller uses a stage row)."""
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
                return None
            slot = self._evict(pool, victim)
        pool.slot_of[expert] = slot
        pool.table[expert] = slot
        return slot

    def _stage_row(self, stage: _Stage, expert: int) -> int:
        if not stage.free:  # cannot happen (see _Stage); a clear error beats reading another expert
            raise RuntimeError(f"expert stage full ({len(stage.row_of)} rows) placing expert {expert}")
        row = stage.free.pop()
        stage.row_of[expert] = row
        self.counters.add("staged", 1)
        return row

    def _reset_stage(self, stage: _Stage, layer: int | None) -> None:
        """Give the stage to `layer`'s next call. Loads still in flight into it (prefetches another
        call did not need) are cancelled or waited out: their rows are about to be rewritten."""
        if not stage.row_of and not stage.loading:  # nothing placed in it since the last reset
            stage.layer = layer
            stage.prefetched.clear()
            return
        t0 = time.perf_counter()
        for fut in stage.loading.values():
            if not self._cancel(fut):
                self._finish(fut)
        if stage.loading:  # time the model's thread waited on loads: stall like any other
            self.counters.add("stall_s", time.perf_counter() - t0)
        stage.layer = layer
        stage.row_of.clear()
        stage.loading.clear()
        stage.prefetched.clear()
        stage.free = list(range(stage.w13.shape[0] - 1, -1, -1))

    # ------------------------------------------------------------------ the MoE block's call

    def fetch(self, layer, topk_ids):
        pool, stage = self.pools[layer], self.stage_of[layer]
        ids = host_ids(topk_ids)
        needed = sorted(set(ids.ravel().tolist()))
        need = set(needed)
        c = self.counters
        c.add("lookups", len(needed))
        if len(needed) > self.slots:
            c.add("overflow_calls", 1)
        self._score_prediction(pool, need)
        if stage.layer != layer:  # nothing staged for this call: the rows are free for its misses
            self._reset_stage(stage, layer)
        self._drop_unneeded_loads(pool, stage, need)
        c.add("prefetch_hits", len(need & pool.prefetched) + len(need & stage.prefetched))
        pool.prefetched.clear()
        stall = 0.0
        misses = []
        slot_of, row_of = pool.slot_of, stage.row_of
        for e in needed:
            if e in slot_of:
                slot_of.move_to_end(e)
                if pool.loading:
                    stall += self._wait(pool.loading.pop(e, None))
            elif e in row_of:
                if stage.loading:
                    stall += self._wait(stage.loading.pop(e, None))
            else:
                misses.append(e)
        c.add("expert_hits", len(needed) - len(misses))
        if misses:
            stall += self._load_misses(layer, pool, stage, misses, need)
        c.add("stall_s", stall)
        out = self._weights(pool, stage, ids, topk_ids.device)
        stage.layer = None  # consumed: what this call staged is not kept for a later one
        return out

    def _load_misses(self, layer, pool, stage, misses, need) -> float:
        """Load the call's missing experts on demand into LRU slots, or stage rows once no slot is
        free of this call's experts and of loads in flight. -> seconds spent."""
        c = self.counters
        c.add("expert_misses", len(misses))
        c.add("bytes_loaded", len(misses) * self.tier.expert_bytes)
        loads = []
        for e in misses:
            slot = self._claim(pool, e, need)
            if slot is not None:
                loads.append((e, pool.first_row + slot))
            else:
                loads.append((e, stage.first_row + self._stage_row(stage, e)))
        t0 = time.perf_counter()
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

    def _weights(self, pool: _Pool, stage: _Stage, ids, device):
        """The buffer view from the pool's first slot (to the stage's last row if the call uses it)
        and the call's expert ids (numpy) rewritten to rows of that view."""
        table = pool.table
        if stage.row_of:
            table = table.copy()
            offset = stage.first_row - pool.first_row
            for e, row in stage.row_of.items():
                table[e] = offset + row
        w13, w2 = pool.views[1 if stage.row_of else 0]
        rows = torch.from_numpy(table[ids])
        return w13, w2, rows.to(device) if self.cuda else rows

    def _drop_unneeded_loads(self, pool: _Pool, stage: _Stage, need: set[int]) -> None:
        """Prefetches for this call that turned out wrong and have not started yet cost nothing:
        cancel them and give their slots and rows back."""
        for e in [e for e in pool.loading if e not in need]:
            if self._cancel(pool.loading[e]):
                del pool.loading[e]
                pool.free.append(self._evict(pool, e))
                self.counters.add("evictions", -1)  # never held an expert
        for e in [e for e in stage.loading if e not in need]:
            if self._cancel(stage.loading[e]):
                del stage.loading[e]
                stage.prefetched.discard(e)
                stage.free.append(stage.row_of.pop(e))

    # ------------------------------------------------------------------ prefetch

    def prefetch(self, layer: int, experts: list[int]) -> None:
        """Start loading `experts` (distinct, most wanted first) for `layer`'s next call, now: predicted
        residents become most recently used; missing ones go to LRU slots of experts not predicted, and
        once none is free (the prediction is larger than the pool) to the layer's stage.

        Called between MoE calls, so on CPU no kernel is reading any pool or stage; on CUDA a queued
        kernel may still read a stage, and the copies wait for the compute stream (see `_submit`)."""
        if self.executor is None:
            return
        pool, stage = self.pools[layer], self.stage_of[layer]
        if pool.predicted is not None and pool.predicted.issuperset(experts):
            return  # the late guess often repeats the early one: all of it is resident or on its way
        if stage.layer != layer:
            self._reset_stage(stage, layer)
        keep = set(experts)
        if pool.predicted is not None:  # a second guess for the same call (early, then late)
            keep |= pool.predicted
        pool.predicted = keep
        slot_of = pool.slot_of
        for e in reversed(experts):  # predicted residents become the most recently used
            if e in slot_of:
                slot_of.move_to_end(e)
        loads, targets = [], []
        for e in experts:
            if e in slot_of or e in stage.row_of:
                continue
            slot = self._claim(pool, e, keep)
            if slot is not None:
                loads.append((e, pool.first_row + slot))
                targets.append(pool)
            else:
                loads.append((e, stage.first_row + self._stage_row(stage, e)))
                targets.append(stage)
        if not loads:
            return
        for (e, _), where, fut in zip(loads, targets, self._submit(layer, loads, self.executor)):
            where.loading[e] = fut
            where.prefetched.add(e)
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
            "expert_dtype": _dtype_name(self.dtype),
            "num_experts": self.cfg.num_experts,
            "fast_pool_bytes": self.slots * len(self.pools) * self.expert_pool_bytes,
            "staging_bytes": self.staging_bytes,
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
            "staged_loads": t["staged"],
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


def slots_for_budget(cfg, runtime, dtype: torch.dtype | None = None) -> int:
    """Fast-pool slots per MoE layer for `runtime.expert_budget`; num_experts means all resident.

    A fraction f keeps floor(f * E) experts of every MoE layer; a size keeps as many as fit, split
    evenly over the MoE layers (bytes in `dtype`, the pool's, by default the compute dtype). One token needs top_k experts of a layer at
    once, so fewer slots than top_k is refused; calls needing more distinct experts than the pool
    holds (prefills, large decode batches) put the rest in transient stage rows (see PooledStore).
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
    """Build the expert store for the configured budget and tier, and the prefetch strategy.

    prefetch=off and prefetch=lookahead get the same store: the same slots, loader threads, readers
    and pinning, so that the switch changes only when loads happen (ahead, or on demand)."""
    from moebench.engine.moe import KERNEL_CLASSES

    cfg = ckpt.config
    if runtime.offload_tier not in ("host", "disk"):
        raise MoebenchError(f"unknown --offload-tier '{runtime.offload_tier}' (choose host or disk)")
    # The kernel says which dtype it wants its weights in (the fused CPU kernel streams bfloat16
    # checkpoints as they are, see FusedMoe.expert_dtype); the pool holds them so. The budget counts
    # slots in the compute dtype for every kernel, so both kernels get the same number of slots.
    dtype = KERNEL_CLASSES[runtime.kernel].expert_dtype(expert_file_dtype(ckpt), runtime.torch_dtype,
                                                        runtime.device)
    slots = slots_for_budget(cfg, runtime)
    if slots >= cfg.num_experts:
        store = ResidentStore(ckpt, runtime.expert_budget, dtype)
    else:
        disk = runtime.offload_tier == "disk"
        # docs/prefetch.md gives the measurements behind 3 disk readers and 1 host worker.
        readers = int(runtime.extra.get("readers", DEFAULT_DISK_READERS))
        workers = readers if disk else int(runtime.extra.get("host_workers", 1))
        tier = make_tier(runtime.offload_tier, ckpt, runtime.device, readers)
        store = PooledStore(ckpt, runtime, tier, slots, workers, parallel_demand=disk, dtype=dtype)
    if runtime.prefetch == "lookahead":
        from moebench.engine.prefetch import LookaheadPrefetcher

        # Each layer is also guessed from the previous layer's MoE input (the early guess), so that
        # its loads overlap that layer's MoE too, not just one attention (docs/prefetch.md).
        early = bool(runtime.extra.get("lookahead_early", True))
        return store, LookaheadPrefetcher(ckpt, store, extra_per_token=int(runtime.extra.get("lookahead_extra", 1)),
                                          early=early)
    return store, NoPrefetch(store)


def store_activation_errors(store) -> list[str]:
    """A CPU store whose loads ran on Python threads because the native loader did not build fell
    back (`native_loader: false` in the evidence); that is an error unless the user chose it
    (MOEBENCH_EXPERT_LOADER=python) or accepts fallbacks (MOEBENCH_ALLOW_FALLBACK=1)."""
    from moebench.engine.moe import fallback_allowed

    if not isinstance(store, PooledStore) or store.cuda or store.native or not store.workers:
        return []
    if os.environ.get("MOEBENCH_EXPERT_LOADER") == "python" or fallback_allowed():
        return []
    from moebench.kernels.expert_loader import load_extension

    if load_extension() is not None:
        return []  # built; this tier keeps its loads in Python by its own choice
    return [f"expert loads ran on Python threads: the native loader did not build ({store.tier.name} tier, "
            f"{store.workers} workers); set MOEBENCH_EXPERT_LOADER=python to accept that"]
