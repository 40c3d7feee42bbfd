"""The bundled model through the project's own engine: it loads from package data and scores
>= 85% on a fixed 50-item slice of the held-out gsm-synth test split."""

import torch

from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
from moebench.engine.loader import load_tokenizer
from moebench.measuring.run import bundled_model_path
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


def test_stop_strings_end_generation_exactly_where_a_full_decode_finds_them():
    """The engine decodes the whole output only when the newest token can have completed a stop
    string; that must end every request exactly where checking the whole text at every step would."""
    path = bundled_model_path()
    suite = load_suite("gsm-synth", limit=12)
    tokenizer = load_tokenizer(path)
    ckpt = load_checkpoint(path, dtype=torch.float32)
    stops = ("+", "ch", "= ")  # one character, two characters (often across tokens), ends in a space

    def run(stop):
        engine = Engine(ckpt, tokenizer, RuntimeConfig(kernel="naive", batch_size=4, max_new_tokens=60))
        return engine.generate([Request(item.id, suite.prompt(item), None, stop) for item in suite.items]).completions

    for free, stopped in zip(run(()), run(stops)):
        ids = free.output_ids
        expected = None
        for n in range(1, len(ids) + 1):  # the plain rule: the first step whose whole text holds a stop
            text = tokenizer.decode(ids[:n])
            cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
            if cuts:
                expected = (text[: min(cuts)], ids[:n])
                break
        if expected is None:
            assert stopped.finish_reason == free.finish_reason and stopped.output_ids == ids
        else:
            assert (stopped.text, stopped.output_ids, stopped.finish_reason) == (*expected, "stop")
