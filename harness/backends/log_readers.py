"""Numbers read from a server's whole log where no single line holds them: a profile's
`[[profile.evidence.log_value]]` names a reader here (`reader = "..."`) and a condition on what it
returns. Each reader is a pure function of the log text, judged on recorded real logs in the tests.
"""

from __future__ import annotations

import re
from collections.abc import Callable

# llama.cpp's slot lines (tools/server/server-common.h:26-30):
# "slot %12.*s: id %2d | task %d | <message>", after the common log's own prefix (time, level)
_LLAMACPP_SLOT = re.compile(r"\bslot [ \w():]{12}: id +(\d+) \| task (-?\d+) \| (.*)$")


def llamacpp_prompts_joining_decoding(log: str) -> float | None:
    """Prompts that llama-server started while another slot was already generating: what
    continuous batching does and what `--no-cont-batching` forbids (server-context.cpp:3090, a
    prompt joins the batch only when `cont_batching` is on or the batch holds no sampled token).

    Read from four slot lines of llama.cpp 0.5.0-dev (llama-cpp-python 0.3.36), all logged at
    `-lv 4`: "init sampler" (server-context.cpp:388; the slot's whole prompt is in the batch being
    built, so the decode that follows samples its first token), "processing task"
    (server-context.cpp:1810; the task was given a slot, between two update_slots passes),
    "new prompt" (server-context.cpp:3126; its prompt starts going into a batch) and "stop
    processing" (server-context.cpp:518; the slot is released).

    A prompt B counts when some other slot A logged "init sampler" before B's task was even
    launched and had not stopped when B's prompt started: a decode ran between A's prompt and B's
    launch (the queue launches tasks only between update_slots passes, and a pass that put A's
    prompt in a batch decodes it), so A was generating; without continuous batching A's sampled
    token in the batch keeps B's prompt out until A stops. Prompts that start together in one
    pass (a static batch, which --no-cont-batching still makes) never count.

    None where no task was launched while another sequence was generating: requests that all
    arrived together (or one at a time) give continuous batching nothing to do, and the evidence
    is "not exercised", never proof either way."""
    # a slot serves one task after another: a sequence is (slot, task), so a slot that finished
    # and took a new task in the same pass is not the sequence that was running at the launch
    generating: set[tuple[int, int]] = set()  # past "init sampler", not yet stopped
    running_at_launch: dict[int, set[tuple[int, int]]] = {}  # slot -> sequences generating when its task launched
    joined = chances = 0
    for line in log.splitlines():
        match = _LLAMACPP_SLOT.search(line)
        if match is None:
            continue
        slot, task, message = int(match.group(1)), int(match.group(2)), match.group(3)
        if message.startswith("init sampler"):
            generating.add((slot, task))
        elif message.startswith("processing task"):
            running_at_launch[slot] = {seq for seq in generating if seq[0] != slot}
            chances += bool(running_at_launch[slot])
        elif message.startswith("new prompt"):
            if running_at_launch.pop(slot, set()) & generating:
                joined += 1
        elif message.startswith("stop processing"):
            generating.discard((slot, task))
    return float(joined) if chances else None


# a reader returns None where the workload gave the optimization no chance to show itself
READERS: dict[str, Callable[[str], float | None]] = {
    "llamacpp_prompts_joining_decoding": llamacpp_prompts_joining_decoding,
}


def log_number(pattern: str, log: str) -> float | None:
    """The largest number the first group of `pattern` captured anywhere in the log (thousands
    separators dropped), or None where it never matched a number."""
    best = None
    for match in re.finditer(pattern, log, re.MULTILINE):
        try:
            value = float(match.group(1).replace(",", ""))
        except (TypeError, ValueError):
            continue
        best = value if best is None else max(best, value)
    return best
