"""The scheduler bench runs configs in lockstep (one engine step at a time, round-robin). Waiting for
the baton must not enter a step's duration: the engine times a step from just before schedule() to
its end, and calls has_work() between steps."""

import threading
import time

from benchmark_scripts import load_benchmark

bench_scheduler = load_benchmark("bench_scheduler")
Lockstep, StepClock = bench_scheduler.Lockstep, bench_scheduler.StepClock


class FakeScheduler:
    def __init__(self, steps):
        self.left = steps

    def has_work(self):
        return self.left > 0

    def schedule(self):
        self.left -= 1
        return []


def engine_loop(clock, work_s, durations):
    """What Engine.generate does around each step."""
    while clock.has_work():
        start = time.perf_counter()
        clock.schedule()
        time.sleep(work_s)
        durations.append(time.perf_counter() - start)


def test_lockstep_waits_stay_out_of_step_durations_and_own_clocks():
    baton = Lockstep(2)
    fast, slow = StepClock(FakeScheduler(8), baton, 0), StepClock(FakeScheduler(8), baton, 1)
    fast_d, slow_d = [], []

    def run(clock, work_s, durations, index):
        try:
            engine_loop(clock, work_s, durations)
            clock.close()
        finally:
            baton.leave(index)

    threads = [threading.Thread(target=run, args=(fast, 0.001, fast_d, 0)),
               threading.Thread(target=run, args=(slow, 0.05, slow_d, 1))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    assert len(fast_d) == len(slow_d) == 8
    assert wall > 8 * 0.05  # they did take turns
    # the fast engine waited ~50 ms for the baton at every step; none of it is in its steps or clock
    assert max(fast_d) < 0.025, fast_d
    assert fast.clock < 0.15 < slow.clock
