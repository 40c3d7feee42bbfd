"""The one MoE interface the model calls: route, ask the expert store, run the configured kernel.

`kernel=naive` is the per-expert loop Hugging Face runs; `kernel=fused` sorts tokens by expert
once and runs the fused kernels of `moebench.kernels`. The evidence that the switch was honoured
is not the strategy's call count but the implementation that computed every call: the C++ kernel,
the grouped torch fallback (and any per-expert loop inside it) or Triton. A fused run in which any
call fell back is an activation failure unless the user asked for that fallback
(MOEBENCH_CPU_KERNEL=torch, or MOEBENCH_ALLOW_FALLBACK=1 for every fallback).
"""

from __future__ import annotations

import os

import torch

from moebench.engine.fallbacks import ALLOW_FALLBACK_ENV, fallback_allowed
from moebench.engine.routing_stats import RoutingStats
from moebench.kernels import BACKEND_TRITON, fused_moe
from moebench.kernels.cpu_moe import BACKEND_CPP, BACKEND_LOOP, BACKEND_TORCH, cpp_kernel_takes, cpu_backend


class MoeKernel:
    name = "base"

    def __init__(self):
        self.calls = 0

    def __call__(self, x, topk_weights, topk_ids, w13, w2) -> torch.Tensor:
        self.calls += 1
        return self.compute(x, topk_weights, topk_ids, w13, w2)

    def compute(self, x, topk_weights, topk_ids, w13, w2) -> torch.Tensor:
        raise NotImplementedError

    def evidence(self) -> dict:
        return {f"{self.name}_calls": self.calls}


class NaiveMoe(MoeKernel):
    name = "naive"

    def compute(self, x, topk_weights, topk_ids, w13, w2):
        from moebench.kernels.reference import moe_reference

        return moe_reference(x, topk_weights, topk_ids, w13, w2)


class FusedMoe(MoeKernel):
    name = "fused"

    def __init__(self):
        super().__init__()
        self.backends: dict[str, int] = {}  # implementation -> calls it computed

    def compute(self, x, topk_weights, topk_ids, w13, w2):
        return fused_moe(x, topk_weights, topk_ids, w13, w2, self.backends)

    def count_native_calls(self, calls: int) -> None:
        """`calls` MoE layers ran the C++ kernel inside one native call of a decode step's layers
        (engine/model.py, MoeTransformer.native_decode_layers)."""
        self.calls += calls
        self.backends[BACKEND_CPP] = self.backends.get(BACKEND_CPP, 0) + calls

    def evidence(self) -> dict:
        return {**super().evidence(), "backends": dict(self.backends),
                "allowed_backends": sorted(allowed_fused_backends())}


def allowed_fused_backends() -> set[str]:
    """The implementations a fused run may use without failing activation."""
    allowed = {BACKEND_CPP, BACKEND_TRITON}
    if os.environ.get("MOEBENCH_CPU_KERNEL") == "torch":  # the user chose the torch path
        allowed.add(BACKEND_TORCH)
    if fallback_allowed():
        allowed |= {BACKEND_TORCH, BACKEND_LOOP}
    return allowed


KERNEL_CLASSES = {"naive": NaiveMoe, "fused": FusedMoe}


def make_kernel(name: str) -> MoeKernel:
    return KERNEL_CLASSES[name]()


def kernel_activation_errors(kernel: str, evidence: dict) -> list[str]:
    """A fused run must show fused calls, no naive call, and every call computed by an allowed
    implementation (see allowed_fused_backends); a naive run, no fused call."""
    fused, naive = evidence.get("fused_calls", 0), evidence.get("naive_calls", 0)
    if kernel == "fused" and (fused == 0 or naive > 0):
        return [f"kernel=fused but the fused kernel ran {fused} times and the naive loop {naive} times"]
    if kernel == "fused":
        allowed = set(evidence.get("allowed_backends") or allowed_fused_backends())
        fell_back = {b: n for b, n in (evidence.get("backends") or {}).items() if b not in allowed}
        if fell_back:
            ran = ", ".join(f"{b} {n}x" for b, n in sorted(fell_back.items()))
            return [f"kernel=fused fell back to {ran} (of {fused} calls): the C++ kernel did not compute "
                    f"them (set {ALLOW_FALLBACK_ENV}=1, or MOEBENCH_CPU_KERNEL=torch, to accept that)"]
    if kernel == "naive" and fused > 0:
        return [f"kernel=naive but the fused kernel ran {fused} times"]
    return []


class MoeBlock:
    """Callable `(layer, x, residual[, shared]) -> residual + (moe output [+ shared])`, wiring router,
    prefetcher, expert store and kernel. It adds its output to the residual stream itself so that the
    prefetcher sees the stream the next layer will read. `shared` (a shared expert's output, Ling)
    is added to the routed output before the residual, in the reference model's order."""

    def __init__(self, model_router, kernel: MoeKernel, store, prefetcher, stats: RoutingStats):
        self.route = model_router
        self.kernel = kernel
        self.store = store
        self.prefetcher = prefetcher
        self.stats = stats

    def resident_experts(self) -> dict | None:
        """layer -> (w13, w2) where a decode step's MoE layers may run inside one native call
        (MoeTransformer.native_decode_layers): the fused C++ kernel on resident experts and no
        prefetcher, so that between layers the store and the prefetcher have nothing to do but count
        (`ran_natively`). Else None."""
        from moebench.engine.store.expert_store import NoPrefetch, ResidentStore

        if not (type(self.kernel) is FusedMoe and type(self.store) is ResidentStore
                and type(self.prefetcher) is NoPrefetch and cpu_backend() == BACKEND_CPP):
            return None
        pairs = list(self.store.experts.values())
        if not all(cpp_kernel_takes(w13, w2) and w13.dtype == pairs[0][0].dtype and w13.stride(-1) == w2.stride(-1) == 1
                   for w13, w2 in pairs):
            return None
        return self.store.experts

    def ran_natively(self, topk_ids: list[torch.Tensor], distinct_experts: list[int]) -> None:
        """A decode step's MoE layers 0.. ran inside one native call and chose these experts (so many
        distinct ones per layer): what each layer's call would have recorded (routing statistics, the
        resident store's look-ups, all hits, the kernel's calls). The prefetcher's hooks are
        NoPrefetch's, which do nothing."""
        self.stats.record_layers(topk_ids)
        self.store.count_hits(sum(distinct_experts))
        self.kernel.count_native_calls(len(topk_ids))

    def start(self, h: torch.Tensor) -> None:
        """A forward pass begins with these embeddings."""
        self.prefetcher.before_forward(h)

    def __call__(self, layer: int, x: torch.Tensor, residual: torch.Tensor,
                 shared: torch.Tensor | None = None) -> torch.Tensor:
        topk_weights, topk_ids = self.route(x, layer)
        self.stats.record(layer, topk_ids)
        self.prefetcher.before_layer(layer, x)
        w13, w2, slot_ids = self.store.fetch(layer, topk_ids)
        routed = self.kernel(x, topk_weights, slot_ids, w13, w2)
        h = residual + (routed if shared is None else routed + shared)
        self.prefetcher.after_layer(layer, h)
        return h
