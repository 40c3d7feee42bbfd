"""The bundled model through the project's own engine: it loads from package data and scores
>= 85% on a fixed 50-item slice of the held-out gsm-synth test split."""

import torch

from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
from moebench.engine.loader import load_tokenizer
from moebench.run import bundled_model_path
from moebench.suites import load_suite


def test_bundled_model_solves_50_held_out_items_through_the_engine():
    path = bundled_model_path()
    suite = load_suite("gsm-synth", limit=50)
    ckpt = load_checkpoint(path, dtype=torch.float32)
    engine = Engine(ckpt, load_tokenizer(path), RuntimeConfig(kernel="naive", batch_size=16, max_new_tokens=256))
    requests = [Request(item.id, suite.prompt(item), None, tuple(suite.stop)) for item in suite.items]
    result = engine.generate(requests)
    scores = [suite.score(c.text, item) for c, item in zip(result.completions, suite.items)]
    correct = sum(s.correct for s in scores)
    assert correct >= 43, f"{correct}/50 correct"
