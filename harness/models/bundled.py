"""Where the bundled models live (package data: harness/bundled/): the default gsm-synth-moe for the
easy level of the synthetic suite, gsm-synth-hard-moe for the hard level (`--suite gsm-synth-hard`)."""

from __future__ import annotations

from pathlib import Path

BUNDLED_MODEL = Path(__file__).resolve().parent.parent / "bundled" / "gsm-synth-moe"
BUNDLED_HARD_MODEL = BUNDLED_MODEL.parent / "gsm-synth-hard-moe"
# A suite whose default model is not the default one: the model trained for it.
SUITE_MODELS = {"gsm-synth-hard": BUNDLED_HARD_MODEL}


def bundled_model_path(suite: str | None = None) -> Path:
    """The bundled model a run of `suite` uses when no --model is given."""
    return SUITE_MODELS.get(suite, BUNDLED_MODEL)
