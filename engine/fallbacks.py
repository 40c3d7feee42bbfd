"""Whether the user accepted slower implementations standing in for the configured ones.

Every activation check (the MoE kernel, decode attention, the expert loader) asks here, so one
toggle answers for all of them; it sits below the modules that ask, which import nothing else of
each other for it."""

from __future__ import annotations

import os

ALLOW_FALLBACK_ENV = "MOEBENCH_ALLOW_FALLBACK"


def fallback_allowed() -> bool:
    return os.environ.get(ALLOW_FALLBACK_ENV, "") not in ("", "0")
