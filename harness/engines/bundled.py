"""The bundled runtime in-process, as an engine backend: one `Engine` per configuration."""

from __future__ import annotations

from contextlib import contextmanager


class BundledBackend:
    def __init__(self, configs, checkpoints, tokenizer, base_runtime, sampling=None):
        self.configs = configs
        self.checkpoints = checkpoints  # cfg -> the checkpoint it runs (negative controls are quantized)
        self.tokenizer = tokenizer
        self.base_runtime = base_runtime
        self.sampling = sampling  # the run's sampling settings (None: greedy), checked in the warm-up too

    @contextmanager
    def session(self, cfg, label: str = ""):
        from moebench import run as run_module  # looked up at call time: bench_gate wraps _runtime_for
        from moebench.engine import Engine

        yield Engine(self.checkpoints(cfg), self.tokenizer, run_module._runtime_for(self.base_runtime, cfg))

    def warm_up(self, suite, n_items: int) -> None:
        from moebench import run as run_module
        from moebench.measure import warm_up

        warm_up(self.configs, self.checkpoints, self.tokenizer, suite, self.base_runtime,
                run_module._runtime_for, n_items, self.sampling)

    def close(self) -> None:
        pass
