"""Which path a session's decode steps run: decided here, once when the session starts, as the step
runner it builds (engine/runner.py), and recorded in the evidence.

The decode path is an axis of its own, the CPU counterpart of what CUDA graphs are to vLLM and
SGLang (`--enforce-eager`, `--disable-cuda-graph`). It never depends on the MoE kernel, the
scheduler or the prefetcher, so flipping any of those switches leaves it as it was:

- `chained`: the extension's step ops (kernels/csrc/decode_layer.cpp), a decode step's attention
  sub-layer and router each one native call, layer by layer; the MoE op, whichever the `kernel`
  switch chose, is called from Python between them. The step's parallel work runs on the
  extension's thread pool and torch's own on one thread, for both kernels alike.
- `native`: the same ops with every layer of a step, from the token ids to the logits, in one C++
  call (DecodeLayers). The MoE op inside that call is the fused C++ kernel on resident experts, so
  this path needs kernel=fused, every expert resident, prefetch=off and every layer an MoE layer;
  asked for anywhere else, it is refused before the run starts (`native_refusal`), never quietly
  replaced.
- `eager`: each op called on its own from Python, torch keeping its threads (no step thread pool).

`auto` is `chained` where the extension's ops run (float32 on the CPU, the extension built), else
`eager`: a quiet choice between those two changes no result, only where time goes, and the evidence
says which ran and why. A family whose layers run only from Python (Ling's `bailing_hybrid`) runs
`eager` and refuses the other two.
"""

from __future__ import annotations

from moebench.engine.config import DECODE_PATHS as CHOICES
from moebench.errors import MoebenchError

DEFAULT = "auto"
# families whose layers the step ops run (engine/model.py's MoeTransformer); others run eager only
STEP_OP_FAMILIES = ("qwen3_moe", "mixtral")


def native_refusal(cfg, runtime) -> str | None:
    """Why `native` cannot run for a model of config `cfg` under `runtime`, from what is known before
    anything is loaded (the CLI asks before a run claims its folder; `decide` asks again), or None."""
    if cfg.family not in STEP_OP_FAMILIES:
        return f"the {cfg.family} model runs its layers from Python only (--decode-path eager or auto)"
    dense = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
    if dense:
        return f"the model has dense layers ({', '.join(map(str, dense))}), which the one native call does not run"
    if runtime.kernel != "fused" or runtime.prefetch != "off":
        # the MoE op inside the one call is the fused kernel, and no prefetch hook runs in it
        return (f"it needs kernel=fused and prefetch=off, not kernel={runtime.kernel}, prefetch={runtime.prefetch} "
                "(use --decode-path chained)")
    budget = runtime.expert_budget
    if isinstance(budget, float) and budget < 1:
        return f"expert budget {budget} leaves experts out of memory, and the one call loads none"
    return None


def path_refusal(requested: str, cfg, runtime) -> str | None:
    """The one-line reason `requested` cannot run on this model and runtime, or None (checked once
    per run before it starts, and again by `decide`)."""
    if requested == "native":
        why = native_refusal(cfg, runtime)
        return f"decode path 'native' cannot run: {why}" if why else None
    if requested == "chained" and cfg.family not in STEP_OP_FAMILIES:
        return f"decode path 'chained' cannot run: the {cfg.family} model runs its layers from Python only"
    return None


def decide(requested: str | None, model, runtime=None, moe_block=None, experts_resident: bool = True):
    """The step runner of a session of `model` for `requested` (a CHOICES entry, None for auto).
    `runtime`, `moe_block` (the session's, set on the model) and `experts_resident` (whether its
    store holds every expert) are checked against what `native` needs; without a runtime only the
    model is (tests drive a model alone)."""
    from moebench.engine import runner as R

    requested = requested or DEFAULT
    if requested not in CHOICES:
        raise MoebenchError(f"unknown decode path '{requested}' (choose from: {', '.join(CHOICES)})")
    cfg = model.cfg
    if runtime is not None:
        refusal = path_refusal(requested, cfg, runtime)
        if refusal:
            raise MoebenchError(refusal)
    if cfg.family not in STEP_OP_FAMILIES:  # its own forward, from Python
        return R.StepRunner(model, lambda batch, kv, all_positions, chained: model.forward(batch, kv, all_positions),
                            R.TorchThreads(), requested, f"the {cfg.family} model runs its layers from Python",
                            R.TORCH)
    ext, threads = _step_threads(model, pool=requested != "eager" and model.ops is not None)
    if model.ops is None:
        why_not = ("the step ops run only on float32 CPU weights, with the C++ extension built "
                   "(it did not build, or the model is not float32 on the CPU)")
        if requested in ("native", "chained"):
            raise MoebenchError(f"decode path '{requested}' cannot run: {why_not}")
        return R.StepRunner(model, model.forward_torch, threads, requested,
                            "asked for" if requested == "eager" else why_not, R.TORCH, ext)
    if requested == "eager":
        model.decode_chains = False
        return R.StepRunner(model, model.forward_layers, threads, requested, "asked for", R.LAYER_BY_LAYER, ext)
    if requested == "native":
        problem = _native_model_problem(model)
        experts = moe_block.resident_experts() if moe_block is not None else None
        if problem is None and moe_block is not None and (not experts_resident or experts is None):
            problem = ("the experts are not all resident float32, bfloat16 or int8 rows of one dtype for the "
                       "fused C++ kernel")
        if problem:
            raise MoebenchError(f"decode path 'native' cannot run: {problem} (use --decode-path chained)")
        model.decode_chains = True
        if moe_block is None:  # a model alone (tests): the layers are built when its MoE block is set
            raise MoebenchError("decode path 'native' needs the session's MoE block to bind its experts")
        native, head_inside = model.native_decode_layers(experts)
        return R.NativeRunner(model, model.forward_layers, threads, requested, "asked for", native, moe_block,
                              head_inside, ext)
    model.decode_chains = model.chains_available
    return R.ChainedRunner(model, model.forward_layers, threads, requested, "asked for" if requested == "chained" else
                           "the extension's step ops run here (auto picks chained, never native)",
                           model.chains_available, ext)


def _native_model_problem(model) -> str | None:
    """What the loaded model and the extension lack for the one native call, or None."""
    if not model.chains_available:
        return "the chained ops are off (an override runs attention, the dense projections or the chains in torch, " \
               "or weights the dense kernel does not stream)"
    if not hasattr(model.ops, "DecodeLayers"):
        return "the extension has no DecodeLayers (an old build)"
    return None


def _step_threads(model, pool: bool):
    """(the extension or None, the context each decode step runs in): the extension's StepThreads
    (kernels/csrc/dense_cpu.cpp), which on a path with the step's thread pool gives the pool torch's
    threads and torch one for the step, and counts each step by the threads it ran on; without the
    extension, TorchThreads."""
    from moebench.engine.runner import TorchThreads
    from moebench.kernels.cpu_moe import load_extension

    ext = load_extension()
    if ext is not None and hasattr(ext, "StepThreads"):
        return ext, ext.StepThreads(pool)
    return None, TorchThreads()
