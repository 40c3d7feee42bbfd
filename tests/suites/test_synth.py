"""The synthetic GSM-style suite: determinism, arithmetic, splits, lengths, tokenizer."""

import random
import re

import pytest

from moebench.suites import synth
from moebench.suites.synth import check_answer, generate_problem, generate_split, load_synth_items

N = 1000


@pytest.fixture(scope="module")
def test_items():
    items, shots = load_synth_items("test", None)
    return items


@pytest.fixture(scope="module")
def train_items():
    items, _ = load_synth_items("train", 5000)
    return items


@pytest.fixture(scope="module")
def tokenizer():
    from moebench.models.train import BUNDLED_DIR, build_tokenizer

    path = BUNDLED_DIR / "tokenizer.json"
    if path.exists():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))
    corpus = [synth.format_training_text(p.question, p.answer) for p in generate_split("train", 3000)]
    return build_tokenizer(corpus)


def test_deterministic_for_a_seed():
    a = [generate_problem(random.Random(5)) for _ in range(3)]
    b = [generate_problem(random.Random(5)) for _ in range(3)]
    assert a == b
    assert generate_split("train", 50, seed=3) == generate_split("train", 50, seed=3)
    assert generate_split("train", 50, seed=3) != generate_split("train", 50, seed=4)
    x, _ = load_synth_items("test", 20)
    y, _ = load_synth_items("test", 20)
    assert x == y


def test_item_format(test_items):
    assert len(test_items) == 1000
    assert test_items[17].id == "gsm-synth/test/17"
    assert len({it.id for it in test_items}) == len(test_items)
    for it in test_items:
        assert it.answer.endswith(f"#### {it.target}")
        assert re.fullmatch(r"\d+", it.target)
        assert "\n\n" not in it.answer and "Question:" not in it.answer


def test_answers_are_arithmetically_correct(test_items, train_items):
    for it in test_items + train_items:
        assert check_answer(it.answer), it.answer
        nsteps = it.answer.count("<<")
        assert 1 <= nsteps <= 5
        for expr, res in re.findall(r"<<([^=]+)=(\d+)>>", it.answer):
            assert 0 <= int(res) < synth.MAX_VALUE


def test_checker_rejects_wrong_answers():
    assert check_answer("He has 3+4=<<3+4=7>>7 apples.\n#### 7")
    assert not check_answer("He has 3+4=<<3+4=8>>8 apples.\n#### 8")
    assert not check_answer("He has 3+4=<<3+4=7>>7 apples.\n#### 8")
    assert not check_answer("He has 7/2=<<7/2=3>>3 apples.\n#### 3")


def test_distribution_covers_ops_and_steps(test_items):
    ops = {op: 0 for op in "+-*/"}
    steps = {}
    for it in test_items:
        for expr in re.findall(r"<<([^=]+)=", it.answer):
            ops[re.search(r"[+\-*/]", expr).group()] += 1
        n = it.answer.count("<<")
        steps[n] = steps.get(n, 0) + 1
    assert all(v > 50 for v in ops.values()), ops
    assert sorted(steps) == [1, 2, 3, 4, 5]
    assert synth.TEMPLATE_COUNT >= 36


def test_train_test_disjoint(test_items):
    train, _ = load_synth_items("train", None)
    assert len(train) == synth.TRAIN_SIZE
    test_q = {it.question for it in test_items}
    assert len(test_q) == len(test_items)
    assert not test_q & {it.question for it in train}
    assert all(synth.is_test_question(q) for q in test_q)
    assert not any(synth.is_test_question(it.question) for it in train[:2000])
    # the training stream (another seed) never yields a test-bucket problem either
    it = synth.iter_problems("train", seed=12345)
    assert not any(synth.is_test_question(next(it).question) for _ in range(500))


def test_length_variation(test_items, tokenizer):
    lens = sorted(len(tokenizer.encode(" " + it.answer).ids) for it in test_items)
    p50 = lens[len(lens) // 2]
    p95 = lens[int(0.95 * (len(lens) - 1))]
    assert p95 / p50 >= 2.0, (p50, p95)


def test_tokenizer_round_trip_and_digits(test_items, tokenizer):
    for it in test_items[:300]:
        text = synth.format_training_text(it.question, it.answer)
        enc = tokenizer.encode(text)
        assert tokenizer.decode(enc.ids, skip_special_tokens=False) == text
        # the prompt's tokens are a prefix of the full text's tokens
        p = tokenizer.encode(synth.format_prompt(it.question)).ids
        assert enc.ids[: len(p)] == p
    enc = tokenizer.encode("costs $123 and 45+6=<<45+6=51>>51\n#### 51")
    digit_tokens = [t for t in enc.tokens if any(ch.isdigit() for ch in t)]
    assert all(len(t) == 1 for t in digit_tokens), digit_tokens
    assert tokenizer.decode(enc.ids) == "costs $123 and 45+6=<<45+6=51>>51\n#### 51"
    assert 256 < tokenizer.get_vocab_size() <= 1024
    for i, s in enumerate(["<|pad|>", "<|bos|>", "<|endoftext|>"]):
        assert tokenizer.token_to_id(s) == i
