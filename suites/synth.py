"""Synthetic GSM-style word problems in GSM8K's answer format.

Every problem is a short story about one quantity (objects, money, or an amount of some
stuff) that changes over 1 to 5 reasoning steps.  Each step is one reasoning line with a
GSM8K calculator annotation ``<<a+b=c>>c`` and the solution ends with ``#### N``.

The distribution is made for a tiny model that must do the arithmetic itself, digit by
digit: every operand, intermediate and final value stays below ``MAX_VALUE`` (100), so
every number has one or two digits; the second operand of every step is one digit, so
steps are 2-digit +/- 1-digit, at most 2-digit x 1-digit, and exact division by one digit.

The split is by a hash of the question text, so train and test never share a problem:
test items come from the test bucket of one fixed seed stream, train items from the train
bucket of another.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Iterator

SUITE_ID = "gsm-synth"
MAX_VALUE = 100          # every intermediate and final value is below this
TEST_SEED = 1_000_003
TRAIN_SEED = 7
TEST_SIZE = 1000
TRAIN_SIZE = 20000       # size of the fixed train split (the few-shot pool)
TEST_BUCKETS = 8         # sha256(question) % TEST_BUCKETS == 0 -> test bucket
STEP_WEIGHTS = (0.32, 0.26, 0.18, 0.13, 0.11)  # 1..5 reasoning steps

NAMES = [
    ("Tom", "he", "his", "him"), ("Anna", "she", "her", "her"), ("Liam", "he", "his", "him"),
    ("Mia", "she", "her", "her"), ("Noah", "he", "his", "him"), ("Emma", "she", "her", "her"),
    ("Omar", "he", "his", "him"), ("Sara", "she", "her", "her"), ("Ben", "he", "his", "him"),
    ("Lily", "she", "her", "her"), ("Jack", "he", "his", "him"), ("Zoe", "she", "her", "her"),
    ("Leo", "he", "his", "him"), ("Ava", "she", "her", "her"), ("Sam", "he", "his", "him"),
    ("Nina", "she", "her", "her"), ("Max", "he", "his", "him"), ("Rosa", "she", "her", "her"),
    ("Ivan", "he", "his", "him"), ("Maya", "she", "her", "her"), ("Carlos", "he", "his", "him"),
    ("Grace", "she", "her", "her"), ("Ken", "he", "his", "him"), ("Julia", "she", "her", "her"),
]

OBJECTS = ["apples", "marbles", "stickers", "pencils", "cookies", "books", "cards", "shells",
           "stamps", "beads", "balloons", "eggs", "oranges", "crayons", "toy cars", "candies"]
STUFF = [("liters", "water"), ("pounds", "flour"), ("meters", "rope"), ("cups", "sugar"),
         ("ounces", "juice"), ("kilograms", "rice"), ("feet", "ribbon"), ("gallons", "paint")]

# Template fields: {name} {pron} {poss} {obj_pron} {obj} (plural noun or unit), {stuff},
# {a} {b} operands in the question, {calc} the annotated computation in the answer.
# Each frame: starts (kind, question, answer), ops (kind, question, answer), questions.
FRAMES = {
    "objects": {
        "start": [
            ("plain", "{name} has {a} {obj}.", None),
            ("mul", "{name} buys {a} bags of {obj} with {b} {obj} in each bag.",
             "{Name} buys {calc} {obj}."),
            ("add", "{name} has {a} red {obj} and {b} blue {obj}.",
             "{Name} has {calc} {obj} in total."),
        ],
        "op": [
            ("add", "Then {pron} buys {b} more {obj}.", "After buying more, {pron} has {calc} {obj}."),
            ("add", "A friend gives {obj_pron} {b} {obj}.", "With the gift, {pron} has {calc} {obj}."),
            ("add", "{Pron} finds {b} {obj} in a drawer.", "After finding some, {pron} has {calc} {obj}."),
            ("sub", "{Pron} gives {b} {obj} to a neighbor.", "After giving some away, {pron} has {calc} {obj}."),
            ("sub", "{Pron} loses {b} {obj} on the way home.", "After losing some, {pron} has {calc} {obj}."),
            ("sub", "{Pron} uses {b} {obj} for a school project.", "After the project, {pron} has {calc} {obj}."),
            ("mul", "Then {pron} collects until {pron} has {b} times as many {obj}.",
             "Now {pron} has {calc} {obj}."),
            ("mul", "{Pron} trades each of {poss} {obj} for {b} new ones.",
             "After trading, {pron} has {calc} {obj}."),
            ("div", "{Pron} splits the {obj} into {b} equal piles and keeps one pile.",
             "One pile has {calc} {obj}."),
            ("div", "{Pron} shares the {obj} equally with {b} children, {obj_pron}self included, and keeps one share.",
             "Each share is {calc} {obj}."),
        ],
        "question": ["How many {obj} does {name} have now?", "How many {obj} does {name} have at the end?"],
    },
    "money": {
        "start": [
            ("plain", "{name} has ${a} in a wallet.", None),
            ("mul", "{name} sells {a} cups of lemonade for ${b} each.", "{Name} earns {calc} dollars."),
            ("add", "{name} has ${a} in a wallet and ${b} in a piggy bank.", "{Name} has {calc} dollars in total."),
        ],
        "op": [
            ("add", "{Pron} earns ${b} for mowing a lawn.", "After mowing, {pron} has {calc} dollars."),
            ("add", "{Poss_cap} grandmother gives {obj_pron} ${b}.", "With the gift, {pron} has {calc} dollars."),
            ("add", "{Pron} sells an old toy for ${b}.", "After the sale, {pron} has {calc} dollars."),
            ("sub", "{Pron} spends ${b} on a book.", "After buying the book, {pron} has {calc} dollars."),
            ("sub", "{Pron} pays ${b} for lunch.", "After lunch, {pron} has {calc} dollars."),
            ("sub", "{Pron} gives ${b} to charity.", "After the donation, {pron} has {calc} dollars."),
            ("mul", "A savings plan makes {poss} money grow to {b} times as much.",
             "Now {pron} has {calc} dollars."),
            ("mul", "{Pron} works extra shifts and ends up with {b} times as much money.",
             "After the shifts, {pron} has {calc} dollars."),
            ("div", "{Pron} splits the money equally into {b} envelopes and keeps one envelope.",
             "One envelope holds {calc} dollars."),
            ("div", "{Pron} shares the money equally among {b} friends, {obj_pron}self included.",
             "Each friend gets {calc} dollars."),
        ],
        "question": ["How much money does {name} have now?", "How many dollars does {name} have at the end?"],
    },
    "stuff": {
        "start": [
            ("plain", "{name} has {a} {obj} of {stuff}.", None),
            ("mul", "{name} fills {a} jars with {b} {obj} of {stuff} each.", "{Name} uses {calc} {obj} of {stuff}."),
            ("add", "{name} has {a} {obj} of {stuff} in one bin and {b} {obj} in another.",
             "{Name} has {calc} {obj} of {stuff} in total."),
        ],
        "op": [
            ("add", "{Pron} buys {b} more {obj} of {stuff}.", "After buying more, {pron} has {calc} {obj}."),
            ("add", "A neighbor brings {obj_pron} {b} {obj} of {stuff}.", "With the extra, {pron} has {calc} {obj}."),
            ("sub", "{Pron} uses {b} {obj} of {stuff} for a job.", "After the job, {pron} has {calc} {obj}."),
            ("sub", "{Pron} spills {b} {obj} of {stuff}.", "After the spill, {pron} has {calc} {obj}."),
            ("mul", "A delivery leaves {obj_pron} with {b} times as much {stuff}.", "Now {pron} has {calc} {obj}."),
            ("div", "{Pron} divides the {stuff} equally into {b} buckets and keeps one bucket.",
             "One bucket has {calc} {obj}."),
        ],
        "question": ["How many {obj} of {stuff} does {name} have now?", "How many {obj} of {stuff} are left at the end?"],
    },
}

TEMPLATE_COUNT = sum(len(f["start"]) + len(f["op"]) + len(f["question"]) for f in FRAMES.values())

_OPS = {"add": "+", "sub": "-", "mul": "*", "div": "/"}


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str
    target: str


def _calc(x: int, op: str, b: int) -> tuple[str, int]:
    r = {"add": x + b, "sub": x - b, "mul": x * b, "div": x // b if b else 0}[op]
    return f"<<{x}{_OPS[op]}{b}={r}>>{r}", r


def _operand(rng: random.Random, x: int, op: str) -> int | None:
    """A one-digit second operand for `x op b` that keeps every value below MAX_VALUE."""
    if op == "add":
        hi = min(9, MAX_VALUE - 1 - x)
        return rng.randint(2, hi) if hi >= 2 else None
    if op == "sub":
        hi = min(9, x - 1)
        return rng.randint(1, hi) if hi >= 1 else None
    if op == "mul":
        choices = [b for b in range(2, 10) if x * b < MAX_VALUE]
        return rng.choice(choices) if choices else None
    if op == "div":
        choices = [b for b in range(2, 10) if x % b == 0 and x // b >= 2]
        return rng.choice(choices) if choices else None
    raise ValueError(op)


def generate_problem(rng: random.Random) -> Problem:
    steps = rng.choices(range(1, 6), weights=STEP_WEIGHTS)[0]
    frame_name = rng.choice(sorted(FRAMES))
    frame = FRAMES[frame_name]
    name, pron, poss, obj_pron = rng.choice(NAMES)
    if frame_name == "objects":
        obj, stuff = rng.choice(OBJECTS), ""
    elif frame_name == "money":
        obj, stuff = "dollars", ""
    else:
        obj, stuff = rng.choice(STUFF)
    fields = dict(name=name, Name=name, pron=pron, Pron=pron.capitalize(), poss=poss,
                  Poss_cap=poss.capitalize(), obj_pron=obj_pron, obj=obj, stuff=stuff)

    qs: list[str] = []
    lines: list[str] = []
    kind, qt, at = rng.choice(frame["start"])
    if kind == "plain":
        x = rng.randint(5, 60)
        qs.append(qt.format(a=x, **fields))
    else:
        if kind == "mul":
            b = rng.randint(2, 9)
            a = rng.randint(2, (MAX_VALUE - 1) // b)
        else:
            a = rng.randint(2, 60)
            b = rng.randint(2, 9)
        calc, x = _calc(a, kind, b)
        qs.append(qt.format(a=a, b=b, **fields))
        lines.append(at.format(calc=calc, **fields))
    used: set[int] = set()
    while len(lines) < steps:
        options = []
        for i, (op, oq, oa) in enumerate(frame["op"]):
            if i in used:
                continue
            b = _operand(rng, x, op)
            if b is not None:
                options.append((i, op, oq, oa, b))
        if not options:
            break
        # pick the operation kind first (uniform over feasible kinds), then a template
        kinds = sorted({o[1] for o in options})
        k = rng.choice(kinds)
        i, op, oq, oa, b = rng.choice([o for o in options if o[1] == k])
        used.add(i)
        calc, x = _calc(x, op, b)
        qs.append(oq.format(b=b, **fields))
        lines.append(oa.format(calc=calc, **fields))
    qs.append(rng.choice(frame["question"]).format(**fields))
    lines.append(f"#### {x}")
    return Problem(" ".join(qs), "\n".join(lines), str(x))


def is_test_question(question: str) -> bool:
    h = hashlib.sha256(question.encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") % TEST_BUCKETS == 0


def iter_problems(split: str, seed: int | None = None) -> Iterator[Problem]:
    """Endless stream of distinct problems of one split ("train" or "test")."""
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r} (expected 'train' or 'test')")
    want_test = split == "test"
    if seed is None:
        seed = TEST_SEED if want_test else TRAIN_SEED
    rng = random.Random(seed)
    seen: set[str] = set()
    while True:
        p = generate_problem(rng)
        if is_test_question(p.question) != want_test or p.question in seen:
            continue
        seen.add(p.question)
        yield p


def generate_split(split: str, n: int, seed: int | None = None) -> list[Problem]:
    it = iter_problems(split, seed)
    return [next(it) for _ in range(n)]


def load_synth_items(split: str = "test", limit: int | None = None):
    """(items of `split`, train items usable as few-shot examples).

    The test split has 1,000 fixed items; the train split has TRAIN_SIZE fixed items.
    """
    from moebench.suites.base import Item

    split = {"validation": "test"}.get(split, split)
    size = TEST_SIZE if split == "test" else TRAIN_SIZE
    n = size if limit is None else min(limit, size)
    items = [Item(id=f"{SUITE_ID}/{split}/{i}", question=p.question, answer=p.answer, target=p.target)
             for i, p in enumerate(generate_split(split, n))]
    shots_src = items if split == "train" else None
    if shots_src is None:
        shots_src = [Item(id=f"{SUITE_ID}/train/{i}", question=p.question, answer=p.answer, target=p.target)
                     for i, p in enumerate(generate_split("train", 64))]
    return items, shots_src[:64]


_ANNOT = re.compile(r"<<([^<>=]+)=([^<>]+)>>(-?\d+)")


def check_answer(answer: str) -> bool:
    """Re-evaluate every <<expr=r>>r annotation; the final #### must equal the last result."""
    last = None
    for expr, res, after in _ANNOT.findall(answer):
        m = re.fullmatch(r"(\d+)([+\-*/])(\d+)", expr)
        if not m:
            return False
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        if op == "/" and (b == 0 or a % b):
            return False
        val = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]
        if str(val) != res or res != after:
            return False
        last = val
    m = re.search(r"#### (-?\d+)\s*$", answer)
    return m is not None and last is not None and int(m.group(1)) == last


def format_prompt(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def format_training_text(question: str, answer: str) -> str:
    return f"Question: {question}\nAnswer: {answer}"
