"""The bundled runtime in-process, as an engine backend: one `Engine` per configuration."""

from __future__ import annotations

from contextlib import contextmanager

from moebench.errors import MoebenchError


class BundledBackend:
    def __init__(self, configs, checkpoints, tokenizer, base_runtime, sampling=None, warm_up=None):
        self.configs = configs
        self.checkpoints = checkpoints  # cfg -> the checkpoint it runs (negative controls are quantized)
        self.tokenizer = tokenizer
        self.base_runtime = base_runtime
        self.sampling = sampling  # the run's sampling settings (None: greedy), checked in the warm-up too
        # the measuring loop's warm-up (moebench.measuring.measure.warm_up), handed in: backends sit below it
        self._warm_up = warm_up

    @contextmanager
    def session(self, cfg, label: str = ""):
        from moebench.ablation import runtime_for
        from moebench.engine import Engine

        yield Engine(self.checkpoints(cfg), self.tokenizer, runtime_for(self.base_runtime, cfg))

    def warm_up(self, suite, n_items: int) -> None:
        from moebench import ablation

        if self._warm_up is None:
            raise MoebenchError("the bundled backend was built without the measuring loop's warm-up")
        self._warm_up(self.configs, self.checkpoints, self.tokenizer, suite, self.base_runtime,
                      ablation.runtime_for, n_items, self.sampling)

    def close(self) -> None:
        pass
