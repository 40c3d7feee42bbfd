"""Benchmark suites: GSM8K (hub or local files), its chain-of-thought variant, and the
synthetic GSM-style suite at two levels (gsm-synth, gsm-synth-hard). `load_suite` is the one entry point."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from moebench.errors import MoebenchError
from moebench.suites.base import Item, Score, Suite

__all__ = ["Item", "Score", "Suite", "SUITES", "load_suite"]


def _gsm8k(data: Path | None, limit: int | None, split: str, num_fewshot: int | None) -> Suite:
    from moebench.suites.gsm8k import build_gsm8k_suite
    from moebench.suites.prompts import GSM8K

    return build_gsm8k_suite("gsm8k", GSM8K, data=data, limit=limit, split=split, num_fewshot=num_fewshot)


def _gsm8k_cot(data: Path | None, limit: int | None, split: str, num_fewshot: int | None) -> Suite:
    from moebench.suites.gsm8k import build_gsm8k_suite
    from moebench.suites.prompts import GSM8K_COT

    return build_gsm8k_suite(
        "gsm8k_cot", GSM8K_COT, data=data, limit=limit, split=split, num_fewshot=num_fewshot
    )


def _gsm_synth(data: Path | None, limit: int | None, split: str, num_fewshot: int | None) -> Suite:
    # Imported here so the other suites work whether or not synth.py is present.
    from moebench.suites.synth import load_synth_items

    return _synthetic("gsm-synth", "moebench.suites.synth", load_synth_items, data, limit, split, num_fewshot)


def _gsm_synth_hard(data: Path | None, limit: int | None, split: str, num_fewshot: int | None) -> Suite:
    from moebench.suites.synth_hard import load_items

    return _synthetic("gsm-synth-hard", "moebench.suites.synth_hard", load_items, data, limit, split, num_fewshot)


def _synthetic(name: str, source: str, load_items, data: Path | None, limit: int | None, split: str,
               num_fewshot: int | None) -> Suite:
    from moebench.suites.prompts import GSM8K

    if data is not None:
        raise MoebenchError(f"{data}: {name} generates its items and reads no data directory")
    if limit is not None and limit < 1:
        raise MoebenchError(f"{name}: limit must be at least 1, got {limit}")
    items, train = load_items(split, limit)
    return Suite(
        name=name,
        source=source,
        split=split,
        items=items,
        prompt_format=GSM8K,
        fewshot=train,
        num_fewshot=0 if num_fewshot is None else num_fewshot,
        fewshot_split="train",
    )


SuiteLoader = Callable[[Path | None, int | None, str, int | None], Suite]

SUITES: dict[str, SuiteLoader] = {
    "gsm8k": _gsm8k,
    "gsm8k_cot": _gsm8k_cot,
    "gsm-synth": _gsm_synth,
    "gsm-synth-hard": _gsm_synth_hard,  # the hard level: docs/gsm-synth-hard.md
}


def load_suite(
    name: str,
    data: Path | None = None,
    limit: int | None = None,
    split: str = "test",
    num_fewshot: int | None = None,
) -> Suite:
    """Load suite `name`; `num_fewshot` None means the prompt format's default."""
    try:
        loader = SUITES[name]
    except KeyError:
        raise MoebenchError(f"unknown suite {name!r}; known: {', '.join(SUITES)}") from None
    return loader(data, limit, split, num_fewshot)
