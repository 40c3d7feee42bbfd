"""Schedulers decide which sequences run in each engine step.

`static`: take up to batch-size waiting requests, run that batch until its longest request ends,
then take the next batch. Finished requests leave the computation (the baseline is not padded
with dead rows), but their slots stay empty until the whole batch is done.

`continuous`: iteration-level batching. Every step, finished requests have left and their slots
and KV blocks are free; if waiting requests can be admitted (a free slot or the policy's lookahead,
the step's token budget, KV blocks for the prompt), the step is a prefill of just those, otherwise
it is a decode step of the running requests the admission policy picks (up to batch size; fifo runs
them all, affinity chooses among more by their experts: `moebench.engine.admission`). Keeping
prefill and decode in separate steps keeps decode steps pure, so decode tokens/s measures decoding
only. When a request of the step cannot grow its KV by a block, one that has not decoded yet is
dropped first, else the most recently admitted one is preempted: its blocks are freed and it goes
back to the front of the queue, to be recomputed from its prompt and the tokens it already produced
(greedy decoding makes the recomputation reproduce the same state).
"""

from __future__ import annotations

import time
from collections import deque

from moebench.engine.kv_cache import BlockManager, OutOfBlocks
from moebench.engine.sequence import Sequence, Status


class Scheduler:
    name = "base"

    def __init__(self, batch_size: int, block_manager: BlockManager, max_tokens_per_step: int):
        self.batch_size = batch_size
        self.block_manager = block_manager
        self.max_tokens_per_step = max_tokens_per_step
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admitted_waits: list[float] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(not s.finished for s in self.running)

    def schedule(self) -> list[Sequence]:
        raise NotImplementedError

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self.block_manager.free(seq.block_table)

    def _admit(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        seq.admitted_at = time.perf_counter()
        self._admitted_waits.append(seq.admitted_at - seq.arrival)
        self.running.append(seq)

    def attach(self, stats) -> None:
        """The session's RoutingStats (engine/moe.py), for a scheduler whose admission reads routing."""

    def tokens_ran(self, lens: list[int]) -> None:
        """The rows each sequence of the batch just scheduled ran, where a step ran more than one per
        decoding sequence (a speculative verify step), for a scheduler that reads them."""

    def take_step(self) -> dict:
        waits = self._admitted_waits
        out = {"waiting": len(self.waiting), "queue_wait_s": sum(waits) / len(waits) if waits else float("nan")}
        self._admitted_waits = []
        return out

    def evidence(self) -> dict:
        return {}


class StaticScheduler(Scheduler):
    name = "static"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches = 0

    def schedule(self) -> list[Sequence]:
        self.running = [s for s in self.running if not s.finished]
        if not self.running and self.waiting:
            self.batches += 1
            while self.waiting and len(self.running) < self.batch_size:
                self._admit(self.waiting.popleft())
        return list(self.running)

    def evidence(self) -> dict:
        return {"batches": self.batches}


class ContinuousScheduler(Scheduler):
    name = "continuous"

    def __init__(self, batch_size: int, block_manager: BlockManager, max_tokens_per_step: int, admission=None):
        super().__init__(batch_size, block_manager, max_tokens_per_step)
        from moebench.engine.admission import AdmissionPolicy, FifoAdmission

        self.admission = admission or FifoAdmission()
        self.lookahead = self.admission.lookahead(batch_size)
        # `running`: every request with its KV in the cache (prefilled, not finished), arrival order.
        # Up to batch_size + lookahead of them; each decode step runs the batch_size the policy picks.
        self.admissions = 0  # waiting -> prefill, first time
        self.admissions_mid_flight = 0  # first decode steps while other requests were mid-generation
        self.readmissions = 0  # prefill again after a preemption
        self.preemptions = 0
        self.prefill_steps = 0
        self.opportunities = 0
        self._rank: dict[int, int] = {}  # id(seq) -> arrival rank
        self._arrivals = 0
        self._preempted: set[int] = set()
        self._decoded: set[int] = set()  # id(seq) of requests that have had a decode step
        self._stats = None
        self._learns = type(self.admission).observe is not AdmissionPolicy.observe  # fifo ignores routing
        self._last_batch: list[Sequence] = []
        self._last_lens: list[int] | None = None  # tokens per sequence of the last step; None: one each
        self._max_blocks_of: dict[int, int] = {}  # id(seq) -> KV blocks at its longest length
        self._finished_since = False  # a request finished since the last schedule()

    def attach(self, stats) -> None:
        """The engine hands over its RoutingStats; the admission policy learns from each step's routing."""
        self._stats = stats
        self.admission.attach(*stats.load.shape)

    def add(self, seq: Sequence) -> None:
        self._rank[id(seq)] = self._arrivals
        self._arrivals += 1
        super().add(seq)

    def finish(self, seq: Sequence) -> None:
        super().finish(seq)
        self._finished_since = True
        # A long-lived engine session (moebench serve) must neither grow these without end nor let a
        # later sequence that gets the same id() look decoded or preempted. schedule() drops finished
        # sequences from `running` before anything reads their rank again.
        key = id(seq)
        self._decoded.discard(key)
        self._preempted.discard(key)
        self._max_blocks_of.pop(key, None)
        self._rank.pop(key, None)

    def schedule(self) -> list[Sequence]:
        if self._finished_since:
            self._finished_since = False
            still = [s for s in self.running if not s.finished]
            if len(still) < len(self.running):
                decoded = self._decoded
                decoding = sum(1 for s in still if id(s) in decoded)
                if decoding and (self.waiting or decoding < len(still)):
                    # a slot came free while others kept decoding and requests waited: a static batch
                    # would leave it empty; counted so that activation can tell "nothing to do" from
                    # "did not run"
                    self.opportunities += 1
            self.running = still
        if self._learns and self._stats is not None and self._last_batch:
            self.admission.observe(self._last_batch, self._last_lens, self._stats.last_topk)
        batch = self._prefill()
        if batch:
            self._last_lens = [s.num_tokens - s.num_cached for s in batch]
        else:
            batch = self._decode()
            self._last_lens = None  # a decode step: one new token per sequence
        self._last_batch = batch
        return batch

    def tokens_ran(self, lens: list[int]) -> None:
        """The tokens each sequence of the batch just scheduled ran, where a decode step ran more than
        one (a speculative verify step: its last token and its drafts); admission reads the experts
        of each one's last row."""
        self._last_lens = list(lens)

    def _max_blocks(self, seq: Sequence) -> int:
        n = self._max_blocks_of.get(id(seq))
        if n is None:
            n = self.block_manager.blocks_needed(len(seq.prompt_ids) + seq.max_new_tokens)
            self._max_blocks_of[id(seq)] = n
        return n

    def _prefill(self) -> list[Sequence]:
        """A prefill step for waiting requests, in arrival order, as far as free slots (plus the
        policy's lookahead), the token budget and KV blocks allow. Empty when none can start now."""
        slots = self.batch_size - len(self.running)
        if not self.waiting or slots + self.lookahead <= 0:
            return []
        bm = self.block_manager
        # Requests beyond batch_size (candidates for the policy) must never cost a running one its
        # KV: admit them only while every admitted request could reach its longest length at once.
        committed = None  # blocks of all admitted requests at their longest, counted when first needed
        chosen: list[Sequence] = []
        tokens = 0
        for seq in self.waiting:
            if len(chosen) >= slots + self.lookahead:
                break
            n = seq.num_tokens - seq.num_cached
            if chosen and tokens + n > self.max_tokens_per_step:
                break  # this one leads the next prefill step
            if len(chosen) >= slots:
                if committed is None:
                    committed = sum(map(self._max_blocks, self.running)) + sum(map(self._max_blocks, chosen))
                if committed + self._max_blocks(seq) > bm.num_blocks:
                    break
            # Leave one block per admitted sequence free so that the next decode step, which grows
            # every sequence, does not preempt what was just admitted.
            elif not bm.can_fit(seq.block_table, seq.num_tokens, reserve=len(self.running) + len(chosen)):
                break  # back-pressure: wait for blocks; later requests must not overtake in memory
            bm.ensure_capacity(seq.block_table, seq.num_tokens)
            if committed is not None:
                committed += self._max_blocks(seq)
            chosen.append(seq)
            tokens += n
        if not chosen:
            return []
        for _ in chosen:
            self.waiting.popleft()
        now = time.perf_counter()
        for seq in chosen:
            seq.status = Status.RUNNING
            if id(seq) in self._preempted:
                self._preempted.discard(id(seq))
                self.readmissions += 1
            else:  # the queue wait ends when the request first gets compute
                self.admissions += 1
                seq.admitted_at = now
                self._admitted_waits.append(now - seq.arrival)
        self.running.extend(chosen)
        self.running.sort(key=lambda s: self._rank[id(s)])
        self.prefill_steps += 1
        return chosen

    def _decode(self) -> list[Sequence]:
        """A decode step of the batch_size running requests the admission policy picks, each given
        room for one more token. When blocks run out, a request that has not decoded yet is dropped
        first, else the most recently admitted one (possibly one of the batch) is preempted."""
        bm = self.block_manager
        if len(self.running) > self.batch_size \
                and 0 < len(self._decoded.intersection(map(id, self.running))) < len(self.running):
            self.opportunities += 1  # the policy may swap a prefilled request into a decoding batch
        batch = self.admission.select(self.running, self.batch_size)
        block_size = bm.block_size
        i = 0
        while i < len(batch):
            seq = batch[i]
            if len(seq.block_table) * block_size >= seq.num_tokens:
                i += 1  # room for the step's token already (most steps)
                continue
            try:
                bm.ensure_capacity(seq.block_table, seq.num_tokens)
                i += 1
            except OutOfBlocks:
                idle = [s for s in self.running if id(s) not in self._decoded and all(s is not b for b in batch)]
                victim = max(idle or self.running, key=lambda s: self._rank[id(s)])
                self._preempt(victim)
                if any(s is victim for s in batch[:i]):
                    i -= 1  # it had grown already; the one after it moves into its place
                batch = [s for s in batch if s is not victim]
        decoded = self._decoded
        joining = sum(1 for s in batch if id(s) not in decoded)  # first decode step of these
        # Mid-flight: they start while requests that have decoded are still unfinished, in this batch
        # or set aside by the admission policy (affinity can rotate a whole batch of prefilled
        # requests in at once). A static batch never starts a request before the last one ends. A
        # batch of one that rotates requests slices time; it batches nothing, so it is not counted.
        if joining and self.batch_size > 1 and any(id(s) in decoded for s in self.running):
            self.admissions_mid_flight += joining
        decoded.update(map(id, batch))
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.running = [s for s in self.running if s is not seq]
        self.block_manager.free(seq.block_table)
        seq.num_cached = 0  # recompute prompt + produced tokens on readmission
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self._preempted.add(id(seq))
        self._decoded.discard(id(seq))
        self.preemptions += 1

    def evidence(self) -> dict:
        return {
            "admissions_mid_flight": self.admissions_mid_flight,
            "mid_flight_opportunities": self.opportunities,
            "admissions": self.admissions,
            "preemptions": self.preemptions,
            "readmissions": self.readmissions,
            "prefill_steps": self.prefill_steps,
            "lookahead": self.lookahead,
            **self.admission.evidence(),
        }


def max_resident(runtime) -> int:
    """How many requests may hold KV at once: the batch, plus the requests continuous batching
    prefills ahead for its admission policy to choose from. The engine sizes the KV cache for it."""
    from moebench.engine.admission import make_admission

    if runtime.scheduler != "continuous":
        return runtime.batch_size
    return runtime.batch_size + make_admission(runtime.admission, runtime.batch_size).lookahead(runtime.batch_size)


def make_scheduler(runtime, block_manager: BlockManager) -> Scheduler:
    from moebench.engine.admission import make_admission

    if runtime.scheduler == "static":  # RuntimeConfig admits static and continuous only
        return StaticScheduler(runtime.batch_size, block_manager, runtime.max_tokens_per_step)
    return ContinuousScheduler(runtime.batch_size, block_manager, runtime.max_tokens_per_step,
                               make_admission(runtime.admission, runtime.batch_size))


def scheduler_not_exercised(scheduler: str, evidence: dict, num_requests: int, batch_size: int) -> list[str]:
    """Why continuous batching had no chance to show itself in this workload ([] when it had one): its
    evidence, a request admitted into a running batch, needs more requests than slots, a batch of more
    than one, and a request finishing while others still decode."""
    if scheduler != "continuous" or evidence.get("admissions_mid_flight", 0) > 0:
        return []
    if batch_size <= 1:
        return ["scheduler=continuous not exercised: a batch of one has no running batch to admit into"]
    if num_requests <= batch_size:
        return [f"scheduler=continuous not exercised: {num_requests} requests fit one batch of {batch_size}, "
                "so none waited to be admitted mid-flight"]
    if evidence.get("mid_flight_opportunities", 1) == 0:
        return ["scheduler=continuous not exercised: every batch ended all at once, nothing to admit mid-flight"]
    return []


def scheduler_activation_errors(scheduler: str, evidence: dict, num_requests: int, batch_size: int) -> list[str]:
    """Continuous batching must have admitted a request into a running batch wherever the workload gave
    it the chance (see scheduler_not_exercised for where it did not)."""
    if scheduler != "continuous" or evidence.get("admissions_mid_flight", 0) > 0:
        return []
    if scheduler_not_exercised(scheduler, evidence, num_requests, batch_size):
        return []
    return ["scheduler=continuous but no request was admitted into a running batch"]
