"""Which path a decode step runs: decided here, once per session, and recorded in the evidence.

The decode path is an axis of its own, the CPU counterpart of what CUDA graphs are to vLLM and
SGLang (`--enforce-eager`, `--disable-cuda-graph`). It never depends on the MoE kernel, the
scheduler or the prefetcher, so flipping any of those switches leaves it as it was:

- `chained`: the extension's step ops (kernels/csrc/decode_layer.cpp), a decode step's attention
  sub-layer and router each one native call, layer by layer; the MoE op, whichever the `kernel`
  switch chose, is called from Python between them. The step's parallel work runs on the
  extension's thread pool and torch's own on one thread (DecodePath.step_context), for both
  kernels alike.
- `native`: the same ops with every layer of a step, from the token ids to the logits, in one C++
  call (DecodeLayers). The MoE op inside that call is the fused C++ kernel on resident experts, so
  this path needs kernel=fused, every expert resident and prefetch=off; asked for anywhere else, it
  is refused before the run starts, never quietly replaced.
- `eager`: each op called on its own from Python, torch keeping its threads (no step thread pool).

`auto` is `chained` where the extension's ops run (float32 on the CPU, the extension built), else
`eager`: a quiet choice between those two changes no result, only where time goes, and the evidence
says which ran and why.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from moebench.engine.config import DECODE_PATHS as CHOICES
from moebench.errors import MoebenchError
DEFAULT = "auto"


class DecodePath:
    """The path this session's decode steps run, and what they were observed to run on."""

    def __init__(self, requested: str, name: str, why: str, chains: bool):
        self.requested = requested
        self.name = name  # native | chained | eager
        self.why = why
        # the attention sub-layer and router as one native call each (MOEBENCH_DECODE_CHAINS=0 calls
        # their ops one by one inside the same path, an A/B knob of benchmarks/decode_breakdown.py)
        self.chains = chains
        self._threads = None  # the context decode steps run in (step_context), made when a session starts
        self._ext = None  # the extension whose streamed-dot counters the evidence reads, if any
        self._streams_start = None  # those counters when the session started (simd_stats)

    @property
    def pool(self) -> bool:
        """Whether decode steps run their parallel work on the extension's thread pool."""
        return self.name != "eager"

    @property
    def whole_step(self) -> bool:
        return self.name == "native"

    def step_context(self):
        """The context each decode step's forward runs in (engine/llm_engine.py enters it), made once
        per session: the extension's StepThreads (kernels/csrc/dense_cpu.cpp), which on a path with the
        step's thread pool gives the pool torch's threads and torch one for the step, and counts each
        step by the threads it ran on, read inside the step; without the extension, TorchThreads."""
        if self._threads is None:
            from moebench.kernels.cpu_moe import load_extension

            ext = load_extension()
            if ext is not None and hasattr(ext, "StepThreads"):
                self._threads = ext.StepThreads(self.pool)
                if hasattr(ext, "simd_stats"):
                    self._ext, self._streams_start = ext, dict(ext.simd_stats())
            else:
                self._threads = TorchThreads()
        return self._threads

    def evidence(self) -> dict:
        return {"requested": self.requested, "path": self.name, "why": self.why, "chains": self.chains,
                "step_pool": self.pool, "decode_threads": dict(self._threads.seen()) if self._threads else {},
                "streamed_dots": self.streamed_dots()}

    def streamed_dots(self) -> dict | None:
        """Which kernel the extension's streamed dot products and tiles of 4+ tokens ran in this process
        (avx512 or avx2, kernels/csrc/cpu_common.h) and the weight rows each streamed (1-3 tokens) or
        tiled (4+) since this session started (its step_context), as the extension counted them, and
        the run length its streamed items aim at now (cpu_common.h: streamed_item_rows; 0: fixed row
        counts); None before that or without the extension."""
        if not self._ext or self._streams_start is None:
            return None
        now = dict(self._ext.simd_stats())
        counted = [k for k in now if k.endswith("_rows")]
        run_bytes = {"stream_run_bytes": self._ext.stream_run_bytes()} if hasattr(self._ext, "stream_run_bytes") else {}
        return {"kernel": now["streams"], **{k: now[k] - self._streams_start[k] for k in counted}, **run_bytes}


def decide(requested: str | None, model, runtime=None, experts_resident: bool = True) -> DecodePath:
    """The decode path of a session of `model` (an MoeTransformer) for `requested` (a CHOICES entry,
    None for auto). `runtime` and `experts_resident` (whether its store holds every expert: the
    session's store, engine/store/factory.py, says) are checked against what `native` needs."""
    requested = requested or DEFAULT
    if requested not in CHOICES:
        raise MoebenchError(f"unknown decode path '{requested}' (choose from: {', '.join(CHOICES)})")
    chains = bool(getattr(model, "chains_available", False))
    if model.ops is None:
        why_not = ("the step ops run only on float32 CPU weights, with the C++ extension built "
                   "(it did not build, or the model is not float32 on the CPU)")
        if requested in ("native", "chained"):
            raise MoebenchError(f"decode path '{requested}' cannot run: {why_not}")
        return DecodePath(requested, "eager", "asked for" if requested == "eager" else why_not, False)
    if requested == "eager":
        return DecodePath(requested, "eager", "asked for", False)
    if requested == "native":
        problem = native_step_problem(model, runtime, experts_resident)
        if problem:
            raise MoebenchError(f"decode path 'native' cannot run: {problem} (use --decode-path chained)")
        return DecodePath(requested, "native", "asked for", True)
    return DecodePath(requested, "chained", "asked for" if requested == "chained" else
                      "the extension's step ops run here (auto picks chained, never native)", chains)


def native_step_problem(model, runtime, experts_resident: bool = True) -> str | None:
    """Why a decode step's layers cannot all run in one C++ call for this model and runtime, or None.
    The experts' residency and dtype are checked again when the call is built (MoeBlock.resident_experts)."""
    cfg = model.cfg
    if not getattr(model, "chains_available", False):
        return "the chained ops are off (MOEBENCH_DECODE_CHAINS=0, MOEBENCH_DECODE_ATTENTION=torch, "\
               "MOEBENCH_DENSE_KERNEL=torch, or weights the dense kernel does not stream)"
    if not hasattr(model.ops, "DecodeLayers"):
        return "the extension has no DecodeLayers (an old build)"
    if not all(map(cfg.is_moe_layer, range(cfg.num_layers))):
        return "the model has dense layers, which the one call does not run"
    if runtime is None:
        return None
    from moebench.kernels.cpu_moe import BACKEND_CPP, cpu_backend

    if cpu_backend() != BACKEND_CPP:
        return "the fused C++ MoE kernel did not build"
    if not experts_resident:
        return f"expert budget {runtime.expert_budget} leaves experts out of memory, and the one call loads none"
    return None


class TorchThreads:
    """StepThreads without the extension: no pool to hand threads to; steps counted by torch's threads."""

    def __init__(self):
        self._seen: dict[str, int] = {}

    def __enter__(self):
        key = f"pool=0 torch={torch.get_num_threads()}"
        self._seen[key] = self._seen.get(key, 0) + 1
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def seen(self) -> dict[str, int]:
        return dict(self._seen)


def step_context(model):
    """The context `model`'s decode steps run in: its decode path's step_context, where it has one."""
    path = getattr(model, "decode_path", None)
    return nullcontext() if path is None else path.step_context()
