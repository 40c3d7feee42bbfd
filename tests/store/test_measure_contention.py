"""An idle expert-loader thread must not take CPU time from real work on a busy machine. Measured in CPU
seconds of the loader thread, not in wall time: with more runnable threads than cores, the spinner sleeps instead of spinning between loads."""

import os
import subprocess
import sys
import time

import pytest
import torch


def _cpu_seconds(stat_path: str) -> float:
    fields = open(stat_path).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_loader_does_not_spin_while_the_machine_is_busy():
    from moebench.kernels.expert_loader import load_extension, memory_segment

    ext = load_extension()
    cpus = sorted(os.sched_getaffinity(0))
    if ext is None or len(cpus) < 2:
        pytest.skip("needs the native loader and two cores")
    # Hogs on every core but the loader's, more of them than cores: the machine is busy, while the
    # loader's own core stays free, so a spinner there would spin undisturbed (the old behaviour:
    # 0.6-0.97 s of CPU per second in this loop).
    others = ",".join(map(str, cpus[:-1]))
    hogs = [subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{others}}})\nwhile 1: pass"])
            for _ in range(len(cpus) + 1)]
    loader = None
    try:
        time.sleep(0.3)
        loader = ext.Loader(1, 2000, [cpus[-1]])
        src, dst = torch.ones(1024), torch.empty(1024)
        load = (-1, 0, 0, 0, False, "memory", [memory_segment(src, dst)])
        tid = next(t for t in os.listdir("/proc/self/task")
                   if open(f"/proc/self/task/{t}/comm").read().strip() == "moebench-load")
        stat = f"/proc/self/task/{tid}/stat"
        before, start = _cpu_seconds(stat), time.perf_counter()
        while time.perf_counter() - start < 1.5:  # a load now and then, as prefetch plans come
            for ticket in loader.submit([load]):
                ticket.result()
            time.sleep(0.0005)
        share = (_cpu_seconds(stat) - before) / (time.perf_counter() - start)
        assert torch.equal(src, dst)
    finally:
        for hog in hogs:
            hog.kill()
        if loader is not None:
            loader.close()
    assert share < 0.2, f"the idle loader took {share:.2f} CPU s/s from a busy machine"
