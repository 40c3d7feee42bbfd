"""Answer extraction and exact match for GSM8K-style outputs.

The verdicts must equal lm-eval's gsm8k / gsm8k_cot tasks (lm-eval 0.4.x), so accuracy
from moebench and from lm-eval can be compared item by item. The patterns below are the
ones in lm-eval's task YAML files; tests/suites/test_extract_vs_lmeval.py runs lm-eval's own
filters and metric on a few hundred outputs and checks that every verdict agrees.
"""

from __future__ import annotations

import re

import numpy as np

# What lm-eval's regex filter answers when nothing matches. It takes part in the exact
# match like any other prediction (and so is never correct for a numeric reference).
NO_MATCH = "[invalid]"

# gsm8k "strict-match": the number after the first "#### ".
STRICT_GSM8K = r"#### (\-?[0-9\.\,]+)"
# gsm8k_cot "strict-match". The final "." is an unescaped wildcard: it needs one more
# character of any kind except a newline, so "The answer is 5" at the very end of the
# output does not match, and "The answer is 1234" yields "123".
STRICT_COT = r"The answer is (\-?[0-9\.\,]+)."
# "flexible-extract" (both tasks): the LAST number-like run in the output.
FLEXIBLE = r"(-?[$0-9.,]{2,})|(-?[0-9]+)"

# exact_match's regexes_to_ignore, removed in this order from prediction and reference
# alike. "(?s).*#### " turns a full reference solution into its final answer.
IGNORE_PATTERNS = (",", r"\$", r"(?s).*#### ", r"\.$")


def find_answer(text: str, pattern: str, which: int) -> str | None:
    """The `which`-th match of `pattern` in `text`, stripped; None when nothing matches.

    A pattern with several groups (FLEXIBLE) yields the first group that matched.
    """
    matches = re.findall(pattern, text)
    if not matches:
        return None
    match = matches[which]
    if isinstance(match, tuple):
        groups = [group for group in match if group]
        if not groups:
            return None
        match = groups[0]
    return match.strip()


def strict_answer(text: str, pattern: str = STRICT_GSM8K) -> str | None:
    """The strict-match answer: the first match of the format's strict pattern."""
    return find_answer(text, pattern, 0)


def flexible_answer(text: str) -> str | None:
    """The flexible-extract answer: the last number-like run in the text."""
    return find_answer(text, FLEXIBLE, -1)


def normalize(text: str) -> str:
    """The form exact_match compares: ignored patterns removed, then lower-cased."""
    for pattern in IGNORE_PATTERNS:
        # lm-eval keeps the texts in numpy string arrays between substitutions, and
        # numpy string arrays drop trailing NUL characters.
        text = re.sub(pattern, "", text).rstrip("\x00")
    # Lower-cased the way lm-eval's numpy string array is: like str.lower, but cut back
    # to the original length where lower-casing lengthens the text ("İ" -> "i", not "i̇").
    return str(np.char.lower(np.array(text)))


def exact_match(prediction: str | None, reference: str) -> bool:
    """lm-eval's exact_match with gsm8k's settings; None stands for NO_MATCH."""
    if prediction is None:
        prediction = NO_MATCH
    return normalize(prediction) == normalize(reference)
