"""The hard level of the synthetic GSM-style suite (`gsm-synth-hard`), in GSM8K's answer format.

Where the easy level (synth.py) is made so that a tiny model gets nearly everything right, this
level is made so that it does not: a story has two or three people, each with their own amount of
the same thing; events change one person's amount or move some from one person to another;
sentences with numbers that do not matter (ages, distances, times) are mixed in; and the question
asks about one person or about two of them together. The solution follows only what the question
needs, one reasoning line with a calculator annotation ``<<a+b=c>>c`` per step, 2 to 8 steps, and
ends with ``#### N``. Amounts run into the hundreds (a sum of two people past a thousand): two-digit
amounts get two-digit operands for + and -, larger ones one-digit (a person receiving from another
gets the giver's operand); multipliers and divisors have one digit (division only when exact). The
ranges are a `Numbers`: HARD is the level, WIDE (thousands, two-digit operands throughout) the first
stage of its model's training.

Train and test are disjoint by construction as in the easy level: a hash of the question text
puts every problem in the test bucket or the train bucket, and each split draws only its own.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator

from moebench.suites.synth import NAMES, OBJECTS, Problem, is_test_question

SUITE_ID = "gsm-synth-hard"


@dataclass(frozen=True)
class Numbers:
    """The ranges a story's numbers are drawn from."""
    max_value: int        # every intermediate value is below this (a sum of two people may pass it)
    two_digit_below: int  # amounts below this get two-digit operands for + and -, larger ones one digit
    mul_below: int        # only amounts below this are multiplied (by one digit)
    div_below: int        # only amounts below this are divided (by one digit, exactly)
    plain_start: tuple[int, int]
    sum_start: tuple[int, int]  # the first addend of "A has a red and b blue ..."


# The level: amounts into the hundreds (a sum of two people past a thousand), two-digit operands on
# two-digit amounts. Carrying into a third or fourth digit is what a 5M-parameter model trained for an
# hour here gets wrong most (35% of its 3-digit + 2-digit sums at WIDE: docs/gsm-synth-hard.md), so
# larger amounts take one-digit operands and only two-digit ones are multiplied or divided.
HARD = Numbers(max_value=1000, two_digit_below=100, mul_below=100, div_below=100,
               plain_start=(20, 99), sum_start=(10, 99))
# Amounts into the thousands, two-digit operands throughout: the first stage of the level's model's
# training (`moebench train-bundled --level hard-wide`), never a test split.
WIDE = Numbers(max_value=5000, two_digit_below=5000, mul_below=250, div_below=1000,
               plain_start=(20, 900), sum_start=(100, 900))
MAX_VALUE = HARD.max_value
MIN_STEPS, MAX_STEPS = 2, 8
TEST_SEED = 2_000_003
TRAIN_SEED = 11
TEST_SIZE = 1319        # GSM8K's test size, so its protocol replays item for item
TRAIN_SIZE = 20000      # the fixed train split (the few-shot pool)
DISTRACTOR_CHANCE = 0.6  # per story: at least one sentence whose number does not matter

# Events on one person: (op, question sentence, answer sentence). {who} is the person's name,
# {b} the operand, {calc} the annotated computation, {obj} the plural noun.
EVENTS = [
    ("add", "{who} buys {b} more {obj}.", "After buying more, {who} has {calc} {obj}."),
    ("add", "{who} finds {b} {obj} in the garden.", "After finding some, {who} has {calc} {obj}."),
    ("add", "{who} wins {b} {obj} at a fair.", "With the prize, {who} has {calc} {obj}."),
    ("sub", "{who} sells {b} {obj} at a market.", "After the sale, {who} has {calc} {obj}."),
    ("sub", "{who} loses {b} {obj} on a trip.", "After the trip, {who} has {calc} {obj}."),
    ("sub", "{who} uses {b} {obj} for a project.", "After the project, {who} has {calc} {obj}."),
    ("mul", "{who} collects until there are {b} times as many {obj}.", "Now {who} has {calc} {obj}."),
    ("div", "{who} packs the {obj} into {b} equal boxes and keeps one box.", "{who} keeps {calc} {obj}."),
]
# A move from one person to another: two lines when the question follows both people, one otherwise.
TRANSFER = ("{giver} gives {b} {obj} to {taker}.",
            "After giving some away, {giver} has {calc} {obj}.",
            "With the gift, {taker} has {calc} {obj}.")
STARTS = [
    ("plain", "{who} has {a} {obj}.", None),
    ("mul", "{who} buys {a} boxes of {obj} with {b} {obj} in each box.", "{who} buys {calc} {obj}."),
    ("add", "{who} has {a} red {obj} and {b} blue {obj}.", "{who} has {calc} {obj} in total."),
]
DISTRACTORS = [
    "{who} is {n} years old.",
    "The market is {n} miles from {who}'s house.",
    "It takes {who} {n} minutes to walk to school.",
    "{who} has a shelf that is {n} inches wide.",
    "{who}'s favorite number is {n}.",
    "The fair had {n} visitors that day.",
]
QUESTIONS_ONE = ["How many {obj} does {who} have now?", "How many {obj} does {who} have at the end?"]
QUESTION_TOGETHER = "How many {obj} do {who} and {other} have together now?"
TOGETHER_LINE = "Together they have {calc} {obj}."

TEMPLATE_COUNT = len(EVENTS) + 1 + len(STARTS) + len(DISTRACTORS) + len(QUESTIONS_ONE) + 1
_OPS = {"add": "+", "sub": "-", "mul": "*", "div": "/"}


@dataclass
class _Person:
    name: str
    value: int
    lines: list[str]   # answer lines that compute this person's amount


def _calc(x: int, op: str, b: int) -> tuple[str, int]:
    r = {"add": x + b, "sub": x - b, "mul": x * b, "div": x // b}[op]
    return f"<<{x}{_OPS[op]}{b}={r}>>{r}", r


def _operand(rng: random.Random, x: int, op: str, nums: Numbers) -> int | None:
    """A second operand for `x op b` that keeps every value in [2, max_value): two digits for + and -
    on amounts below two_digit_below (one digit above), one digit for * and /."""
    lo, top = (10, 99) if x < nums.two_digit_below else (2, 9)
    if op == "add":
        hi = min(top, nums.max_value - 1 - x)
        return rng.randint(lo, hi) if hi >= lo else None
    if op == "sub":
        hi = min(top, x - 2)
        return rng.randint(lo, hi) if hi >= lo else None
    if op == "mul":
        choices = [b for b in range(2, 10) if x < nums.mul_below and x * b < nums.max_value]
        return rng.choice(choices) if choices else None
    if op == "div":
        choices = [b for b in range(2, 10) if x < nums.div_below and x % b == 0 and x // b >= 2]
        return rng.choice(choices) if choices else None
    raise ValueError(op)


def _start(rng: random.Random, name: str, obj: str, nums: Numbers) -> tuple[str, int, list[str]]:
    kind, qt, at = rng.choice(STARTS)
    if kind == "plain":
        a = rng.randint(*nums.plain_start)
        return qt.format(who=name, a=a, obj=obj), a, []
    if kind == "mul":
        b = rng.randint(2, 9)
        a = rng.randint(12, 99)
    else:
        a, b = rng.randint(*nums.sum_start), rng.randint(10, 99)
    calc, x = _calc(a, kind, b)
    return qt.format(who=name, a=a, b=b, obj=obj), x, [at.format(who=name, calc=calc, obj=obj)]


def generate_problem(rng: random.Random, nums: Numbers = HARD) -> Problem:
    """One story whose solution takes MIN_STEPS to MAX_STEPS lines (drawn again until it does)."""
    while True:
        p = _draw_story(rng, nums)
        if p is not None:
            return p


def _draw_story(rng: random.Random, nums: Numbers) -> Problem | None:
    budget = rng.randint(MIN_STEPS, MAX_STEPS)  # answer lines this story may need
    obj = rng.choice(OBJECTS)
    picks = rng.sample(NAMES, rng.choice((2, 2, 3)))
    people = []
    sentences: list[str] = []
    for name, *_pronouns in picks:
        s, x, lines = _start(rng, name, obj, nums)
        sentences.append(s)
        people.append(_Person(name, x, list(lines)))
    target = people[0]
    together = rng.random() < 0.35
    followed = [target, people[1]] if together else [target]

    def needed() -> int:
        return sum(len(p.lines) for p in followed) + (1 if together else 0)

    events_left = rng.randint(2, 6)
    while events_left > 0:
        events_left -= 1
        if rng.random() < 0.25:
            giver, taker = rng.sample(people, 2)
            b = _operand(rng, giver.value, "sub", nums)
            if b is None or taker.value + b >= nums.max_value:
                continue
            cost = (giver in followed) + (taker in followed)
            if needed() + cost > budget:
                continue
            sentences.append(TRANSFER[0].format(giver=giver.name, taker=taker.name, b=b, obj=obj))
            calc, giver.value = _calc(giver.value, "sub", b)
            giver.lines.append(TRANSFER[1].format(giver=giver.name, calc=calc, obj=obj))
            calc, taker.value = _calc(taker.value, "add", b)
            taker.lines.append(TRANSFER[2].format(taker=taker.name, calc=calc, obj=obj))
            continue
        who = rng.choice(people)
        if who in followed and needed() + 1 > budget:
            who = rng.choice([p for p in people if p not in followed] or [who])
            if who in followed:
                continue
        options = [(op, q, a, b) for op, q, a in EVENTS if (b := _operand(rng, who.value, op, nums)) is not None]
        if not options:
            continue
        kinds = sorted({o[0] for o in options})
        kind = rng.choice(kinds)
        op, q, a, b = rng.choice([o for o in options if o[0] == kind])
        sentences.append(q.format(who=who.name, b=b, obj=obj))
        calc, who.value = _calc(who.value, op, b)
        who.lines.append(a.format(who=who.name, calc=calc, obj=obj))
    if rng.random() < DISTRACTOR_CHANCE:
        for _ in range(rng.randint(1, 2)):
            who = rng.choice(people)
            d = rng.choice(DISTRACTORS).format(who=who.name, n=rng.randint(10, 99))
            sentences.insert(rng.randint(1, len(sentences)), d)
    lines = [ln for p in followed for ln in p.lines]
    if together:
        calc, answer = _calc(target.value, "add", people[1].value)
        lines.append(TOGETHER_LINE.format(calc=calc, obj=obj))
        sentences.append(QUESTION_TOGETHER.format(obj=obj, who=target.name, other=people[1].name))
    else:
        answer = target.value
        sentences.append(rng.choice(QUESTIONS_ONE).format(obj=obj, who=target.name))
    if not MIN_STEPS <= len(lines) <= MAX_STEPS:
        return None
    lines.append(f"#### {answer}")
    return Problem(" ".join(sentences), "\n".join(lines), str(answer))


def iter_problems(split: str, seed: int | None = None, nums: Numbers = HARD) -> Iterator[Problem]:
    """Endless stream of distinct problems of one split ("train" or "test")."""
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r} (expected 'train' or 'test')")
    want_test = split == "test"
    rng = random.Random((TEST_SEED if want_test else TRAIN_SEED) if seed is None else seed)
    seen: set[str] = set()
    while True:
        p = generate_problem(rng, nums)
        if is_test_question(p.question) != want_test or p.question in seen:
            continue
        seen.add(p.question)
        yield p


def generate_split(split: str, n: int, seed: int | None = None, nums: Numbers = HARD) -> list[Problem]:
    it = iter_problems(split, seed, nums)
    return [next(it) for _ in range(n)]


def load_items(split: str = "test", limit: int | None = None):
    """(items of `split`, train items usable as few-shot examples); test has TEST_SIZE fixed items."""
    from moebench.suites.base import Item

    split = {"validation": "test"}.get(split, split)
    size = TEST_SIZE if split == "test" else TRAIN_SIZE
    n = size if limit is None else min(limit, size)
    items = [Item(id=f"{SUITE_ID}/{split}/{i}", question=p.question, answer=p.answer, target=p.target)
             for i, p in enumerate(generate_split(split, n))]
    shots = items if split == "train" else [
        Item(id=f"{SUITE_ID}/train/{i}", question=p.question, answer=p.answer, target=p.target)
        for i, p in enumerate(generate_split("train", 64))]
    return items, shots[:64]
