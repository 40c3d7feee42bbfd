"""The activation evidence of `--weights` (docs/int8.md): the precision asked for, and what the kernels
streamed of the weights a decode step reads besides the LM head, by kind and weight dtype, counted
where they ran (kernels/csrc: dense_linear_into for the dense projections, the fused MoE kernel for
the routed experts; `kernels.cpu_dense.weight_stats`), plus the int8 projections that ran in torch.
Counters are per process: an engine takes the difference over its own run, as the LM head's do."""

from __future__ import annotations

import torch

# dtype names as the kernels report them (kernels/csrc/dense_cpu.cpp), per --weights precision
STREAMED = {"int8": "int8", "int4": "int4"}
FLOAT_DTYPES = ("float32", "bfloat16")


def streamed_now(device: str) -> dict:
    """The process's counters now: the extension's (a CPU model) and the torch int8 calls."""
    from moebench.kernels import cpu_dense

    if device != "cpu":
        return {"kernel": {}, "torch": {}}
    return cpu_dense.weight_stats()


def _difference(now: dict, start: dict) -> dict:
    out = {}
    for dtype, c in now.items():
        before = start.get(dtype, {"calls": 0, "bytes": 0})
        if c["calls"] > before["calls"]:
            out[dtype] = {"calls": c["calls"] - before["calls"], "bytes": c["bytes"] - before["bytes"]}
    return out


class WeightsEvidence:
    """Counts from the moment a model is built: `evidence()` is what ran since."""

    def __init__(self, precision: str, ckpt, device: str):
        self.precision, self.device = precision, device
        layer = next((w for w in ckpt.layers if getattr(w, "qkv_proj", None) is not None), None)
        self.held = {"dense": _dtype(layer.qkv_proj) if layer is not None else None,
                     "experts": _dtype(next((w.w13 for w in ckpt.layers if w.w13 is not None), None))}
        self.start = streamed_now(device)

    def evidence(self) -> dict:
        now = streamed_now(self.device)
        kernel = {kind: _difference(now["kernel"].get(kind, {}), self.start["kernel"].get(kind, {}))
                  for kind in ("dense", "experts")}
        in_torch = {d: n - self.start["torch"].get(d, 0) for d, n in now["torch"].items()
                    if n > self.start["torch"].get(d, 0)}
        return {"precision": self.precision, "held": self.held, "kernel": kernel, "torch": in_torch}


def _dtype(w: torch.Tensor | None) -> str | None:
    from moebench.engine.store.base import dtype_name  # int4 rows are held as uint8

    return dtype_name(w.dtype) if w is not None else None


def weights_errors(evidence: dict | None, experts_dtype: str | None = None, allow_fallback: bool = False) -> list[str]:
    """--weights int8 (int4) must be seen where it ran: the model holds int8 matrices, the expert store
    int8 rows (`experts_dtype`, the store's evidence), the dense kernel, where it ran, streamed int8 rows
    (float rows beside them are the routers, float32 by design, docs/int8.md), the fused MoE kernel,
    where it ran, int8 experts and nothing wider, and some projection ran with int8 weights. (A run
    of prefills only runs its projections in torch, on many rows: that is where they belong.) Decode
    projections the dense kernel left to torch (int4 where no C++ kernel streams it: the slow path,
    kernels/int4_torch.py) are an error unless fallbacks are accepted (`allow_fallback`)."""
    precision = (evidence or {}).get("precision", "f32")
    if precision == "f32":
        return []
    want = STREAMED[precision]
    errors = []
    held = evidence.get("held") or {}
    for kind, dtype in held.items():
        if dtype not in (want, None):
            errors.append(f"--weights {precision}: the model holds its {kind} weights in {dtype}")
    if experts_dtype not in (want, None):
        errors.append(f"--weights {precision}: the expert store holds {experts_dtype} rows")
    kernel = evidence.get("kernel") or {}
    wide = {d: c for d, c in (kernel.get("experts") or {}).items() if d != want}
    if wide:
        errors.append(f"--weights {precision}: the MoE kernel streamed experts in {', '.join(sorted(wide))}")
    dense, in_torch = kernel.get("dense") or {}, (evidence.get("torch") or {}).get(want, 0)
    if dense and want not in dense and not (allow_fallback and in_torch):
        from moebench.engine.overrides import VARIABLES

        errors.append(f"--weights {precision}: the dense kernel streamed {', '.join(sorted(dense))} weights and never "
                      f"{want} ({want} calls in torch: {in_torch}; set {VARIABLES['allow_fallback']}=1 to "
                      "accept that slow path)")
    elif not dense and not in_torch:
        errors.append(f"--weights {precision}: no projection ran with {want} weights")
    return errors


def streams_q8_rows(weights: str, lm_head: str) -> bool:
    """Whether a config of these --weights and --lm-head streams rows the q8 kernels take
    (kernels/csrc/q8_cpu.h): int4 or int8 weights, or an int8 LM head."""
    return weights in ("int4", "int8") or lm_head == "int8"


def activations_refusal(activations: str, runtimes) -> str | None:
    """Why q8 activations cannot be asked for in a run of these configs' runtimes, or None: where no
    config streams an int4 or int8 row, the switch would act on nothing."""
    if activations == "f32" or any(streams_q8_rows(r.weights, r.lm_head) for r in runtimes):
        return None
    from moebench.engine.overrides import VARIABLES

    return (f"{VARIABLES['activations']}={activations}: no config of this run streams int4 or int8 rows "
            "(--weights int4 / int8, --lm-head int8), so the q8 kernels would act on nothing")


def activations_errors(activations: str, runner_evidence: dict | None, runtime) -> list[str]:
    """q8 activations asked for (an approximation): in a config that streams int4 or int8 rows, the
    kernels must have quantized some activation rows, counted where they ran (the runner's
    streamed_dots), or the switch did nothing. A config with none (an ablation's float baseline beside
    its int4 config; activations_refusal keeps a run from having only such configs) has nothing for it
    to meet, and its counts stay 0 in its evidence."""
    if activations == "f32" or not streams_q8_rows(runtime.weights, runtime.lm_head):
        return []
    dots = (runner_evidence or {}).get("streamed_dots") or {}
    if dots.get("q8_activation_rows"):
        return []
    return [f"activations {activations}: no activation row was quantized in the kernels (streamed_dots: {dots}); "
            "q8 applies to int4 and int8 rows in the C++ kernels (--weights int4 / int8, --lm-head int8, "
            "--kernel fused for the experts)"]
