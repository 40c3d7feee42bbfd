"""Schedulers decide which sequences run in each engine step.

`static`: take up to batch-size waiting requests, run that batch until its longest request ends,
then take the next batch. Finished requests leave the computation (the baseline is not padded
with dead rows), but their slots stay empty until the whole batch is done.
"""

from __future__ import annotations

import time
from collections import deque

from moebench.engine.kv_cache import BlockManager
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


def make_scheduler(runtime, block_manager: BlockManager) -> Scheduler:
    from moebench.errors import MoebenchError

    if runtime.scheduler == "static":
        return StaticScheduler(runtime.batch_size, block_manager, runtime.max_tokens_per_step)
    raise MoebenchError(f"scheduler={runtime.scheduler} is not implemented yet")


def scheduler_activation_errors(scheduler: str, evidence: dict, num_requests: int, batch_size: int) -> list[str]:
    """Continuous batching must have admitted requests into a running batch when there were more
    requests than slots."""
    if scheduler == "continuous" and num_requests > batch_size and evidence.get("admissions_mid_flight", 0) == 0:
        return ["scheduler=continuous but no request was admitted into a running batch"]
    return []
