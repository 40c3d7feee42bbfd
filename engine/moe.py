"""The one MoE interface the model calls: route, ask the expert store, run the configured kernel,
and record what the routers chose (RoutingStats).

`kernel=naive` is the per-expert loop Hugging Face runs; `kernel=fused` sorts tokens by expert
once and runs the fused kernels of `moebench.kernels`. The evidence that the switch was honoured
is not the strategy's call count but the implementation that computed every call: the C++ kernel,
the grouped torch fallback (and any per-expert loop inside it) or Triton. A fused run in which any
call fell back is an activation failure unless the user asked for that fallback (the overrides'
moe_op=torch, or allow_fallback for every fallback: engine/overrides.py).
"""

from __future__ import annotations

import numpy as np
import torch

from moebench.engine.overrides import DEFAULT as NO_OVERRIDES
from moebench.engine.overrides import VARIABLES as OVERRIDE_VARIABLES
from moebench.kernels import BACKEND_TRITON, fused_moe
from moebench.kernels.cpu_moe import (BACKEND_CPP, BACKEND_LOOP, BACKEND_TORCH, cpp_kernel_takes, cpu_backend,
                                      fused_moe_cpu_torch)


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

    def __init__(self, overrides=NO_OVERRIDES):
        super().__init__()
        self.overrides = overrides
        self.backends: dict[str, int] = {}  # implementation -> calls it computed
        # the op, bound once: the fused kernels, or (the moe_op override) the grouped torch op on the CPU
        self._op = fused_moe if overrides.moe_op == "kernel" else _torch_unless_cuda

    def compute(self, x, topk_weights, topk_ids, w13, w2):
        return self._op(x, topk_weights, topk_ids, w13, w2, self.backends)

    def count_native_calls(self, calls: int) -> None:
        """`calls` MoE layers ran the C++ kernel inside one native call of a decode step's layers
        (engine/model.py, MoeTransformer.native_decode_layers)."""
        self.calls += calls
        self.backends[BACKEND_CPP] = self.backends.get(BACKEND_CPP, 0) + calls

    def evidence(self) -> dict:
        return {**super().evidence(), "backends": dict(self.backends),
                "allowed_backends": sorted(allowed_fused_backends(self.overrides))}


def _torch_unless_cuda(x, topk_weights, topk_ids, w13, w2, backends):
    """The moe_op override: the fused algorithm in grouped torch ops on the CPU (Triton on CUDA)."""
    if x.is_cuda:
        return fused_moe(x, topk_weights, topk_ids, w13, w2, backends)
    return fused_moe_cpu_torch(x, topk_weights, topk_ids, w13, w2, backends)


def allowed_fused_backends(overrides=NO_OVERRIDES) -> set[str]:
    """The implementations a fused run may use without failing activation."""
    allowed = {BACKEND_CPP, BACKEND_TRITON}
    if overrides.moe_op == "torch":  # the user chose the torch path
        allowed.add(BACKEND_TORCH)
    if overrides.allow_fallback:
        allowed |= {BACKEND_TORCH, BACKEND_LOOP}
    return allowed


def make_kernel(name: str, overrides=NO_OVERRIDES) -> MoeKernel:
    return FusedMoe(overrides) if name == "fused" else NaiveMoe()


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
                    f"them (set {OVERRIDE_VARIABLES['allow_fallback']}=1, or {OVERRIDE_VARIABLES['moe_op']}=torch, "
                    "to accept that)"]
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
        # the prefetcher's hooks, where it has any that do something (prefetch=off has none)
        self.hooks = prefetcher if getattr(prefetcher, "active", True) else None
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
        if self.hooks is not None:
            self.hooks.before_forward(h)

    def __call__(self, layer: int, x: torch.Tensor, residual: torch.Tensor,
                 shared: torch.Tensor | None = None) -> torch.Tensor:
        topk_weights, topk_ids = self.route(x, layer)
        self.stats.record(layer, topk_ids)
        hooks = self.hooks
        if hooks is not None:
            hooks.before_layer(layer, x)
        w13, w2, slot_ids = self.store.fetch(layer, topk_ids)
        routed = self.kernel(x, topk_weights, slot_ids, w13, w2)
        h = residual + (routed if shared is None else routed + shared)
        if hooks is not None:
            hooks.after_layer(layer, h)
        return h


class RoutingStats:
    """What the MoE block's routers chose, per step: distinct experts and load imbalance per layer,
    and the load of each expert over the run (the scheduler's affinity admission reads it too)."""

    def __init__(self, num_layers: int, num_experts: int):
        self.load = torch.zeros(num_layers, num_experts, dtype=torch.long)  # tokens routed, whole run
        self._load = self.load.numpy()  # the same memory, updated in numpy
        self._step: list[tuple[int, torch.Tensor]] = []  # (layer, topk_ids) of this step, counted at its end
        # layer -> [tokens, top_k] expert ids of the latest forward, in batch token order. Not cleared
        # by take_step: the scheduler reads it when planning the next step (affinity admission).
        self.last_topk: dict[int, torch.Tensor] = {}
        self._ext = None  # the extension's routing summary (False: numpy), looked up on the first step

    def record_layers(self, topk_ids: list[torch.Tensor]) -> None:
        """`record` for layers 0, 1, ... at once (a decode step whose layers ran in one native call)."""
        layers = list(enumerate(topk_ids))
        self._step.extend(layers)
        self.last_topk.update(layers)

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        self._step.append((layer, topk_ids))
        self.last_topk[layer] = topk_ids

    def take_step(self) -> dict:
        """Step summary (mean over the step's MoE calls), then reset. Counted once per step, for all
        layers at once, in the C++ extension (else numpy): a handful of small torch ops per layer
        would cost more than the counting. The means are float32, as torch computes them."""
        if not self._step:
            return {"distinct_experts": 0.0, "expert_imbalance": 0.0}
        if self._ext is None:
            self._ext = _routing_extension() or False
        ext = self._ext
        if ext:  # the same counting and float32 means in one C++ call
            ids = [t if t.device.type == "cpu" else t.cpu() for _, t in self._step]
            distinct_mean, imbalance_mean = ext.routing_step_summary(ids, [layer for layer, _ in self._step], self.load)
            self._step = []
            return {"distinct_experts": distinct_mean, "expert_imbalance": imbalance_mean}
        E = self._load.shape[1]
        rows = len(self._step)
        ids = [t for _, t in self._step]
        sizes = [t.numel() for t in ids]
        if sizes.count(sizes[0]) == rows:  # every MoE call of a step sees the same tokens
            flat = torch.stack(ids).cpu().numpy().reshape(rows, -1)
            flat = flat + (np.arange(rows, dtype=np.int64) * E)[:, None]
        else:
            flat = torch.cat([t.reshape(-1) for t in ids]).cpu().numpy()
            flat = flat + np.repeat(np.arange(rows, dtype=np.int64) * E, sizes)
        # row i's ids counted in bins i * E .. i * E + E - 1
        counts = np.bincount(flat.reshape(-1), minlength=rows * E).reshape(rows, E)
        layers = [layer for layer, _ in self._step]
        if layers == list(range(layers[0], layers[0] + rows)):
            self._load[layers[0] : layers[0] + rows] += counts
        else:
            np.add.at(self._load, layers, counts)
        distinct = (counts > 0).sum(1)
        with np.errstate(divide="ignore", invalid="ignore"):  # an empty call: 0 / 0, as torch gives nan
            # max / mean over active experts; int64 -> float32 division, as torch's true division
            imbalance = (counts.max(1) * distinct).astype(np.float32) / counts.sum(1).astype(np.float32)
        self._step = []
        # the mean of small integers is exact in float32 whatever the order: sum, then one division
        distinct_mean = np.float32(distinct.sum()) / np.float32(rows)
        return {"distinct_experts": float(distinct_mean),
                "expert_imbalance": float(torch.from_numpy(imbalance).mean())}


def _routing_extension():
    """The CPU extension when it is built and has the routing summary, else None (numpy counts)."""
    from moebench.kernels.cpu_moe import load_extension

    ext = load_extension()
    return ext if ext is not None and hasattr(ext, "routing_step_summary") else None
