"""A disk-tier budget too small for the read buffers plus one layer's experts is refused with the
smallest budget that works, and that budget does work."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moebench.engine.store.budget_floor import smallest_fraction
from tiny_models import make_tiny_checkpoint, write_char_tokenizer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("floor")
    model = write_char_tokenizer(make_tiny_checkpoint(root / "model", "qwen3_e6_k2_norm", num_experts=32))
    data = root / "data"
    data.mkdir()
    rows = [{"question": f"What is {i} + 3?", "answer": f"{i} + 3 = {i + 3}\n#### {i + 3}"} for i in range(3)]
    for name in ("test.jsonl", "train.jsonl"):
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, data, root


def _run(setup, budget: str, run_id: str):
    model, data, root = setup
    return subprocess.run([sys.executable, "-m", "moebench", "run", "--model", model, "--suite", "gsm8k", "--data", data,
                           "--num-fewshot", "0", "--max-new-tokens", "4", "--warmup", "0", "--offload-tier", "disk",
                           "--expert-budget", budget, "--out", root / "results", "--run-id", run_id],
                          capture_output=True, text=True, timeout=600)


def test_the_refusal_names_the_smallest_budget_that_works(setup):
    refused = _run(setup, "0.5", "small")
    assert refused.returncode == 2, refused.stderr[-2000:]
    line = refused.stderr.strip().splitlines()[-1]
    found = re.search(r"the smallest budget that works here is ([0-9.]+) \((\d+) of 32 experts per layer", line)
    assert found, line
    smallest, slots = found.group(1), int(found.group(2))
    ok = _run(setup, smallest, "smallest")
    assert ok.returncode == 0, ok.stderr[-2000:]
    below = _run(setup, smallest_fraction(slots - 1, 32), "below")
    assert below.returncode == 2 and "the smallest budget that works here is " + smallest in below.stderr


def test_smallest_fraction_gives_exactly_those_slots():
    for experts in (5, 32, 128, 512):
        for slots in range(1, experts):
            f = float(smallest_fraction(slots, experts))
            assert int(f * experts + 1e-9) == slots
