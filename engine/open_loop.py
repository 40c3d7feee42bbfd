"""Requests that arrive while the engine runs: each is handed to the engine at its scheduled time by
a thread of its own, as a server's request handler would hand it over, and the engine takes what has
arrived between steps (docs/serving-load.md).

A request's clock starts when it is handed over (`Sequence.arrival`), so its TTFT includes the wait
for the step in progress to end, as a server's would. How late the hand-over itself was (its send
lag) is the measuring client's error, kept apart: `Sequence.scheduled_s` against `arrival`.
"""

from __future__ import annotations

import gc
import queue
import sys
import threading
import time
from contextlib import contextmanager

from moebench.engine.sequence import Sequence

# The feeder waits for the GIL whenever the engine's thread runs Python; at the default 5 ms switch
# interval that wait alone would make a late send, and so would a full garbage collection of the
# model's objects, which holds the GIL for milliseconds (frozen for the open loop, as vLLM freezes
# them after start-up). The same for every configuration of a load.
FEEDER_SWITCH_INTERVAL_S = 0.0005


class ArrivalFeeder:
    """Puts each sequence on a queue at `start + offset` (`start`: when `running` began); the engine
    drains the queue between steps."""

    def __init__(self, seqs: list[Sequence], offsets: list[float]):
        if len(offsets) != len(seqs):
            raise ValueError(f"{len(offsets)} arrival times for {len(seqs)} requests")
        self._due = sorted(zip(offsets, range(len(seqs))))
        self._seqs = seqs
        self.start = 0.0  # perf_counter when the feeder started: offsets count from here
        self.arrived: queue.SimpleQueue[Sequence] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._feed, name="moebench-arrivals", daemon=True)
        for seq, offset in zip(seqs, offsets):
            seq.scheduled_s = float(offset)

    def _feed(self) -> None:
        for offset, i in self._due:
            wait = self.start + offset - time.perf_counter()
            if wait > 0 and self._stop.wait(wait):
                return
            seq = self._seqs[i]
            seq.arrival = time.perf_counter()
            self.arrived.put(seq)

    @contextmanager
    def running(self):
        old = sys.getswitchinterval()
        sys.setswitchinterval(FEEDER_SWITCH_INTERVAL_S)
        gc.collect()
        gc.freeze()
        self.start = time.perf_counter()
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()
            gc.unfreeze()
            sys.setswitchinterval(old)

    def take(self, block: bool) -> list[Sequence]:
        """What has arrived; with `block`, waits for at least one."""
        out = []
        if block:
            out.append(self.arrived.get())
        while True:
            try:
                out.append(self.arrived.get_nowait())
            except queue.Empty:
                return out
