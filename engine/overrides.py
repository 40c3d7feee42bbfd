"""Overrides: a slower or different implementation of one op, for an A/B measurement or a machine
without a compiler. One frozen object, read once where a command starts (the CLI, the server, a
benchmark's main: `Overrides.from_environment(os.environ)`), carried in `RuntimeConfig.overrides`
and recorded in the run's manifest. Nothing below that entry reads the environment.

Each override changes the one op it names and nothing else; a forced or fallen-back path shows in
the run's evidence. The process-wide ones (the AVX-512 kernels, the pool's spin, huge pages) are
applied once per process by `apply_process_overrides`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from moebench.errors import MoebenchError


@dataclass(frozen=True)
class Overrides:
    # the fused MoE op: kernel (the C++ kernel, the grouped torch op where it did not build) or torch
    moe_op: str = "kernel"
    # a decode step's attention: kernel (the C++ paged attention) or torch (gather + SDPA)
    attention: str = "kernel"
    # dense projections and the LM head of a decode step: kernel (the streaming C++ kernel) or torch
    dense: str = "kernel"
    # the residual add + RMSNorm and the step ops built on them (decode paths chained, native): kernel or torch
    norms: str = "kernel"
    # how long an idle worker of the step's thread pool spins before it sleeps, microseconds
    pool_spin_us: int = 200
    # chained path: each decode step's attention sub-layer and router one native call (off: the ops one by one)
    chains: bool = True
    # the streamed decode dots and tiles of 4+ tokens in AVX-512 where the CPU has it (off: AVX2)
    avx512: bool = True
    # the expert store's loads: native (C++ loader threads) or python (Python threads)
    expert_loader: str = "native"
    # the expert store's bookkeeping: auto, native or python
    expert_store: str = "auto"
    # a bfloat16 checkpoint's dense weights: checkpoint (kept bfloat16) or float32 (widened at load)
    dense_weights: str = "checkpoint"
    # MADV_HUGEPAGE on weights and the KV cache
    huge_pages: bool = True
    # accept every torch fallback (no compiler, no AVX2) instead of failing the activation check
    allow_fallback: bool = False
    # what int4 and int8 rows (weights, an int8 LM head) meet in the C++ kernels: f32 activations
    # (weight-only, exact to the dequantized weights) or q8, each activation row quantized per block of
    # 32 to int8 with a float32 scale and dotted in integers, as llama.cpp's Q4_0 / Q8_0 x Q8_0
    # (kernels/csrc/q8_cpu.h).
    # The one override that changes results: APPROXIMATE, off unless asked for, in the manifest with the
    # others, and counted where it ran (simd_stats: q8_weight_rows, q8_activation_rows)
    activations: str = "f32"

    def __post_init__(self):
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise MoebenchError(f"{VARIABLES[name]}={value}: choose from {', '.join(allowed)}")
        if self.pool_spin_us < 0:
            raise MoebenchError(f"{VARIABLES['pool_spin_us']}={self.pool_spin_us}: must be >= 0")

    @classmethod
    def from_environment(cls, environ) -> "Overrides":
        """The overrides the variables of `environ` (a mapping: os.environ at a command's entry) set."""
        given = {}
        for f in fields(cls):
            text = environ.get(VARIABLES[f.name])
            if text is None or not text.strip():
                continue
            text = text.strip().lower()
            if f.type == "bool":
                if text not in ("0", "1"):
                    raise MoebenchError(f"{VARIABLES[f.name]}={text}: choose 0 or 1")
                given[f.name] = text == "1"
            elif f.type == "int":
                try:
                    given[f.name] = int(text)
                except ValueError:
                    raise MoebenchError(f"{VARIABLES[f.name]}={text}: expected a whole number") from None
            else:
                given[f.name] = text
        return cls(**given)

    def changed(self) -> dict:
        """The overrides that differ from the defaults (the manifest records all of them)."""
        default = Overrides()
        return {k: v for k, v in asdict(self).items() if getattr(default, k) != v}

    def to_dict(self) -> dict:
        return asdict(self)


# the environment variable that feeds each override at a command's entry (docs/architecture.md's table)
VARIABLES = {
    "moe_op": "MOEBENCH_CPU_KERNEL",
    "attention": "MOEBENCH_DECODE_ATTENTION",
    "dense": "MOEBENCH_DENSE_KERNEL",
    "norms": "MOEBENCH_NORMS",
    "pool_spin_us": "MOEBENCH_POOL_SPIN_US",
    "chains": "MOEBENCH_DECODE_CHAINS",
    "avx512": "MOEBENCH_AVX512",
    "expert_loader": "MOEBENCH_EXPERT_LOADER",
    "expert_store": "MOEBENCH_EXPERT_STORE",
    "dense_weights": "MOEBENCH_DENSE_WEIGHTS",
    "huge_pages": "MOEBENCH_HUGE_PAGES",
    "allow_fallback": "MOEBENCH_ALLOW_FALLBACK",
    "activations": "MOEBENCH_ACTIVATIONS",
}
KERNEL_OR_TORCH = ("kernel", "torch")
CHOICES = {"moe_op": KERNEL_OR_TORCH, "attention": KERNEL_OR_TORCH, "dense": KERNEL_OR_TORCH,
           "norms": KERNEL_OR_TORCH, "expert_loader": ("native", "python"), "expert_store": ("auto", "native", "python"),
           "dense_weights": ("checkpoint", "float32"), "activations": ("f32", "q8")}
DEFAULT = Overrides()


def apply_process_overrides(overrides: Overrides, extension: bool = True) -> None:
    """The overrides that hold for a whole process, applied where they act: huge pages
    (engine/memory.py), and, where the extension is built, the AVX-512 choice and the pool's spin
    (its one overrides entry point, kernels/csrc/pool.cpp `set_overrides`). The AVX-512 choice is
    made once per process; asking for the other one after it was made is an error, not ignored."""
    from moebench.engine import memory
    from moebench.kernels.cpu_moe import load_extension

    memory.set_huge_pages(overrides.huge_pages)
    ext = load_extension() if extension else None
    if overrides.activations != "f32" and (ext is None or not hasattr(ext, "set_activations")):
        # the torch path computes int4 and int8 weights with float32 activations: the switch would do nothing
        message = (f"{VARIABLES['activations']}={overrides.activations}: no C++ kernel here quantizes activations "
                   "(the extension did not build, or this is not a CPU run); int4 and int8 weights would meet float32 "
                   "activations in torch")
        if not overrides.allow_fallback:
            raise MoebenchError(message + f" (set {VARIABLES['allow_fallback']}=1 to accept that)")
        import warnings

        warnings.warn("moebench: FALLBACK: " + message, RuntimeWarning, stacklevel=2)
    if ext is None:
        return
    if hasattr(ext, "set_activations"):  # every engine of the process sets it: none inherits another's
        ext.set_activations(overrides.activations)
    if not hasattr(ext, "set_overrides"):  # a build that reads MOEBENCH_AVX512 and the spin itself
        return
    if not ext.set_overrides(overrides.avx512, overrides.pool_spin_us):
        raise MoebenchError(f"{VARIABLES['avx512']}={int(overrides.avx512)}: this process chose its AVX-512 "
                            "kernels already (the choice is made once per process)")
