"""Where the bundled model lives (package data: harness/bundled/gsm-synth-moe)."""

from __future__ import annotations

from pathlib import Path

BUNDLED_MODEL = Path(__file__).resolve().parent.parent / "bundled" / "gsm-synth-moe"


def bundled_model_path() -> Path:
    return BUNDLED_MODEL
