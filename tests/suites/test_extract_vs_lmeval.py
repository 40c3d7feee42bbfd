"""Our GSM8K verdicts equal lm-eval's, case by case.

lm-eval's side is built from the installed task YAML files (filter_list, metric_list,
doc_to_target) and run through its own registered filters and exact_match metric, so a
change in either lm-eval or our code shows up here.
"""

import itertools
from pathlib import Path

import pytest

from moebench.suites import Item, Suite
from moebench.suites.prompts import GSM8K, GSM8K_COT

yaml = pytest.importorskip("yaml")
lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.registry import get_filter, get_metric  # noqa: E402
from lm_eval.utils import apply_template  # noqa: E402

import lm_eval.filters  # noqa: E402,F401,F811  (registers the filters)

TASK_DIR = Path(lm_eval.__file__).parent / "tasks" / "gsm8k"

# Number spellings a model might produce.
NUMBERS = [
    "18", "-3", "0", "007", "1,000", "1,000,000", "12,50", "$5", "$1,250.50", "3.5", "0.50",
    ".5", "18.", "18.00", "1.2.3", "-$5", "$-5", "5,", "-0.25", "1e3", "42",
]
# Ways the number might sit in an output.
TEMPLATES = [
    "{n}",
    "#### {n}",
    "She has 3 + 4 = 7 apples.\n#### {n}",
    "#### {n}\n\nQuestion: Tom has 12 pens.",
    "#### {n} and then 3 more",
    "####{n}",
    "#### #### {n}",
    "The answer is {n}.",
    "The answer is {n}",
    "The answer is {n}\n",
    "The answer is {n}. Q: 9",
    "So the total is {n} dollars.",
    "First 3 + 4 = 7. Then {n}",
    "Answer: {n}.\n",
    "{n} is what 2 * 9 gives",
    "The answer is {n}.\n#### 99",
    "She pays ${n} in total.",
]
# Outputs without a usable answer, and oddities that stress the normalisation.
SPECIAL_OUTPUTS = [
    "", "no number here", "####", "#### ", "The answer is .", "#### -", "$", "$$", "..", ",,",
    "The answer is seven.", "#### 1 2", "-", "5\x00", "İ 5", "[INVALID]", " 18 ", "18\n",
]
# Reference final answers, as GSM8K writes them after "####".
FINALS = ["18", "-3", "1,000", "5", "3.5", "42", "0", "1000000", "-0.25", "7"]


def references(final: str) -> dict:
    return {"question": "How many?", "answer": f"3 + 4 = <<3+4=7>>7\nSo {final}.\n#### {final}"}


def cases() -> list[tuple[str, dict]]:
    outputs = [t.format(n=n) for t, n in itertools.product(TEMPLATES, NUMBERS)] + SPECIAL_OUTPUTS
    found = []
    for i, output in enumerate(outputs):
        # Each output is judged against a reference it may match and one it likely does not.
        n = NUMBERS[i % len(NUMBERS)] if i < len(TEMPLATES) * len(NUMBERS) else FINALS[i % len(FINALS)]
        same = n.replace("$", "").rstrip(".") or "0"
        found.append((output, references(same)))
        found.append((output, references(FINALS[i % len(FINALS)])))
    # References that only the normalisation can tell apart.
    for final in ["[invalid]", "[İNVALID]", "Σ", "18\x00", "18.\x00"]:
        found += [(output, references(final)) for output in SPECIAL_OUTPUTS]
    return found


CASES = cases()


def lmeval_verdicts(task_yaml: str, outputs: list[str], docs: list[dict]) -> dict:
    """{filter name: (filtered answers, exact_match per case)} from lm-eval itself."""
    config = yaml.safe_load((TASK_DIR / task_yaml).read_text())
    (metric,) = config["metric_list"]
    metric_kwargs = {k: v for k, v in metric.items() if k not in ("metric", "aggregation", "higher_is_better")}
    exact_match = get_metric(metric["metric"])
    golds = [apply_template(config["doc_to_target"], doc) for doc in docs]
    verdicts = {}
    for pipeline in config["filter_list"]:
        responses = [[output] for output in outputs]
        for step in pipeline["filter"]:
            kwargs = {k: v for k, v in step.items() if k != "function"}
            responses = get_filter(step["function"])(**kwargs).apply(responses, docs)
        answers = list(responses)
        scores = [
            bool(exact_match(references=[gold], predictions=[answer], **metric_kwargs)["exact_match"])
            for gold, answer in zip(golds, answers)
        ]
        verdicts[pipeline["name"]] = (answers, scores)
    return verdicts


def as_lmeval(answer: str | None) -> str:
    # We report "no answer" as None where lm-eval writes its fallback text.
    return "[invalid]" if answer is None else answer


@pytest.mark.parametrize("format_, task_yaml", [(GSM8K, "gsm8k.yaml"), (GSM8K_COT, "gsm8k-cot.yaml")])
def test_verdicts_equal_lmeval(format_, task_yaml):
    outputs = [output for output, _ in CASES]
    docs = [doc for _, doc in CASES]
    items = [
        Item(id=f"case/{i}", question=doc["question"], answer=doc["answer"], target="unused")
        for i, doc in enumerate(docs)
    ]
    suite = Suite(name="cases", source="cases", split="test", items=items, prompt_format=format_, num_fewshot=0)
    scores = [suite.score(output, item) for output, item in zip(outputs, items)]
    expected = lmeval_verdicts(task_yaml, outputs, docs)

    flexible_answers, flexible_correct = expected["flexible-extract"]
    strict_answers, strict_correct = expected["strict-match"]
    for i, score in enumerate(scores):
        where = f"case {i}: output {outputs[i]!r}, reference {docs[i]['answer']!r}"
        assert as_lmeval(score.answer) == flexible_answers[i], where
        assert score.correct == flexible_correct[i], where
        assert as_lmeval(score.answer_strict) == strict_answers[i], where
        assert score.correct_strict == strict_correct[i], where

    assert len(CASES) >= 200
    # The cases exercise both verdicts of both filters.
    assert 0 < sum(flexible_correct) < len(CASES)
    assert 0 < sum(strict_correct) < len(CASES)
