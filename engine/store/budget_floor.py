"""The smallest expert budget an offloaded store can run with, said where a budget is refused.

A pooled store's rows must hold one layer's every expert (a call can route to all of them) plus
the rows its read buffers take; a budget below that is refused, and the refusal names the
smallest budget that works rather than only "raise the budget"."""

from __future__ import annotations

import math


def smallest_fraction(slots: int, num_experts: int) -> str:
    """The shortest decimal f with floor(f * E) == slots (how a fraction becomes slots per layer)."""
    for digits in range(1, 8):
        scale = 10 ** digits
        f = math.ceil(slots / num_experts * scale) / scale
        if math.floor(f * num_experts + 1e-9) == slots:
            return f"{f:.{digits}f}".rstrip("0").rstrip(".")
    return repr(slots / num_experts)


def smallest_budget_note(num_experts: int, moe_layers: int, buffer_rows: int, expert_bytes: int) -> str:
    """What to ask for instead: the fraction and size of the fewest slots per layer that leave
    `num_experts` rows after the read buffers' `buffer_rows`."""
    slots = math.ceil((num_experts + buffer_rows) / moe_layers)
    if slots >= num_experts:
        return ("no budget below 1.0 works for this checkpoint (its read buffers are as large as its "
                "experts): use --expert-budget 1.0, every expert resident")
    size = slots * moe_layers * expert_bytes
    return (f"the smallest budget that works here is {smallest_fraction(slots, num_experts)} "
            f"({slots} of {num_experts} experts per layer, {size / 2**20:.1f} MiB)")
