"""bench-engine's `--activations` (the activations override, engine/overrides.py; kernels/csrc/q8_cpu.h):
int4 and int8 weights (and an int8 LM head) meeting q8 activations, an approximation, asked for on the
command line or by MOEBENCH_ACTIVATIONS, refused where it cannot apply, and required to show in the
kernels' own counters (the runner's streamed_dots: q8_weight_rows) after every timed run."""

from __future__ import annotations

import dataclasses

from moebench.errors import MoebenchError


def with_activations(overrides, activations: str | None, weights: str, lm_head: str = "f32"):
    """`overrides` with --activations applied (None: as the environment set them), checked: q8 has
    kernels for int4 and int8 rows only, so with float weights and a float head it would do nothing,
    and is refused."""
    if activations not in (None, "f32", "q8"):
        raise MoebenchError(f"--activations {activations!r}: choose from f32, q8")
    if activations is not None:
        overrides = dataclasses.replace(overrides, activations=activations)
    from moebench.engine.weight_evidence import streams_q8_rows

    if overrides.activations != "f32" and not streams_q8_rows(weights, lm_head):
        raise MoebenchError(f"--activations {overrides.activations} (MOEBENCH_ACTIVATIONS): only int4 and int8 rows "
                            "have q8 kernels; give --weights int4, --weights int8 or --lm-head int8")
    return overrides


def side_name(overrides) -> str:
    return f" x {overrides.activations} activations" if overrides.activations != "f32" else ""


def find(tree, key: str):
    """The first value under `key` anywhere in nested dicts (the evidence's layout is the engine's)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        for value in tree.values():
            found = find(value, key)
            if found is not None:
                return found
    return None


def require_q8_ran(overrides, evidence: dict) -> None:
    """q8 activations asked for and no int4 or int8 row met them in the kernels: an error, not a figure."""
    if overrides.activations == "f32":
        return
    dots = find(evidence, "streamed_dots") or {}
    if not dots.get("q8_weight_rows"):
        raise MoebenchError(f"bundled runtime: activations {overrides.activations} asked for and no int4 or int8 row met "
                            f"them in the kernels (streamed_dots: {dots})")
