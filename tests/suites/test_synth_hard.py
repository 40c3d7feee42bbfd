"""The hard level of the synthetic suite (gsm-synth-hard): determinism, arithmetic, shape of the stories,
split sizes, train/test disjointness, and scoring through the suite as GSM8K is scored."""

import random
import re

import pytest

from moebench.errors import MoebenchError
from moebench.suites import load_suite, synth_hard
from moebench.suites.synth import check_answer, is_test_question

TRAIN_CHECKED = 3000  # train items generated here (the whole 20,000 takes ~25 s on this machine)


@pytest.fixture(scope="module")
def test_items():
    return load_suite("gsm-synth-hard").items


@pytest.fixture(scope="module")
def train_items():
    return load_suite("gsm-synth-hard", split="train", limit=TRAIN_CHECKED).items


def test_deterministic_for_a_seed():
    a = [synth_hard.generate_problem(random.Random(5)) for _ in range(3)]
    b = [synth_hard.generate_problem(random.Random(5)) for _ in range(3)]
    assert a == b
    assert synth_hard.generate_split("train", 30, seed=3) == synth_hard.generate_split("train", 30, seed=3)
    assert synth_hard.generate_split("train", 30, seed=3) != synth_hard.generate_split("train", 30, seed=4)
    assert load_suite("gsm-synth-hard", limit=15).items == load_suite("gsm-synth-hard", limit=15).items


def test_test_split_is_gsm8k_sized_with_stable_ids(test_items):
    assert len(test_items) == synth_hard.TEST_SIZE == 1319
    assert test_items[17].id == "gsm-synth-hard/test/17"
    assert len({it.id for it in test_items}) == len(test_items)
    # a limit takes a prefix of the same split, so 200 items are the first 200 of 1319
    assert load_suite("gsm-synth-hard", limit=200).items == test_items[:200]


def test_answers_are_arithmetically_correct_and_in_range(test_items, train_items):
    for it in test_items + train_items:
        assert check_answer(it.answer), it.answer
        assert it.answer.endswith(f"#### {it.target}") and re.fullmatch(r"\d+", it.target)
        assert synth_hard.MIN_STEPS <= it.answer.count("<<") <= synth_hard.MAX_STEPS
        nums = synth_hard.HARD
        # a sum of two people, and what a person receives, take the giver's amounts: the rest follow the ranges
        steps = "\n".join(ln for ln in it.answer.splitlines() if not ln.startswith(("Together", "With the gift")))
        for a, op, b in re.findall(r"<<(\d+)([+\-*/])(\d+)=", steps):
            if op in "*/":
                assert 2 <= int(b) <= 9 and int(a) < (nums.mul_below if op == "*" else nums.div_below), it.answer
            elif int(a) >= nums.two_digit_below:
                assert int(b) <= 9, it.answer
            assert int(a) < nums.max_value, it.answer
        assert "\n\n" not in it.answer and "Question:" not in it.answer


def test_hard_features_are_all_present(test_items):
    """Every feature the level promises shows up in a real share of the test split."""
    n = len(test_items)
    steps = {it.answer.count("<<") for it in test_items}
    assert steps == set(range(synth_hard.MIN_STEPS, synth_hard.MAX_STEPS + 1))
    assert sum(int(it.target) >= 100 for it in test_items) > n * 0.7  # into the hundreds
    assert any(int(it.target) >= 1000 for it in test_items)
    assert sum(bool(re.search(r"<<\d+[+-]\d\d=", it.answer)) for it in test_items) > n * 0.6  # two-digit operands
    distractors = [re.compile(re.escape(d).replace(r"\{who\}", r"\w+").replace(r"\{n\}", r"\d+"))
                   for d in synth_hard.DISTRACTORS]
    with_distractor = sum(any(d.search(it.question) for d in distractors) for it in test_items)
    assert n * 0.4 < with_distractor < n * 0.8
    together = sum("together" in it.question for it in test_items)
    assert n * 0.2 < together < n * 0.5
    # a story names 2-3 people, and numbers the answer never uses (other people, distractors)
    unused = 0
    for it in test_items:
        used = set(re.findall(r"\d+", it.answer))
        unused += any(num not in used for num in re.findall(r"\d+", it.question))
    assert unused > n * 0.85


def test_wide_numbers_are_the_same_stories_with_larger_amounts():
    """The first training stage's problems (synth_hard.WIDE): amounts into the thousands, two-digit
    operands on any amount; train bucket only, like every training stream."""
    wide = synth_hard.generate_split("train", 300, seed=12345, nums=synth_hard.WIDE)
    assert all(check_answer(p.answer) and not is_test_question(p.question) for p in wide)
    assert sum(bool(re.search(r"<<\d{3,}[+-]\d\d=", p.answer)) for p in wide) > 100
    assert max(int(p.target) for p in wide) > synth_hard.HARD.max_value
    assert wide != synth_hard.generate_split("train", 300, seed=12345)


def test_train_and_test_are_disjoint_by_construction(test_items, train_items):
    test_q = {it.question for it in test_items}
    assert len(test_q) == len(test_items)
    assert all(is_test_question(q) for q in test_q)
    assert not any(is_test_question(it.question) for it in train_items)
    assert not test_q & {it.question for it in train_items}
    # the training stream of `moebench train-bundled --level hard` (another seed) stays in the train bucket
    stream = synth_hard.iter_problems("train", seed=12345)
    assert not any(is_test_question(next(stream).question) for _ in range(300))


def test_scored_as_gsm8k(test_items):
    suite = load_suite("gsm-synth-hard", limit=5)
    item = suite.items[0]
    assert suite.prompt(item) == f"Question: {item.question}\nAnswer:"
    assert suite.score(" " + item.answer, item).correct
    assert suite.score(" " + item.answer, item).correct_strict
    wrong = item.answer.rsplit("####", 1)[0] + f"#### {int(item.target) + 1}"
    assert not suite.score(" " + wrong, item).correct
    assert suite.score(f"so the answer is {int(item.target):,}.", item).correct  # flexible-extract, commas ignored


def test_bad_input_is_one_line_error():
    with pytest.raises(MoebenchError, match="limit must be at least 1"):
        load_suite("gsm-synth-hard", limit=0)
    with pytest.raises(MoebenchError, match="reads no data directory"):
        from pathlib import Path

        load_suite("gsm-synth-hard", data=Path("somewhere"))
