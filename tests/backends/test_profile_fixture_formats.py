"""The reconstructed server logs (SGLang 0.5.23, vLLM 0.34.0: written from upstream's format strings,
no GPU here) say what upstream prints: every line cites the format string it comes from ("#@ fmt
file:lines" above it), the folder keeps a copy of that string (formats.toml), and the line must be
what the string can produce, whole, inside the engine's own log-line format."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from repo_paths import FIXTURES

LOGS = FIXTURES / "engine_logs"
RECONSTRUCTED = sorted(p.parent for p in LOGS.glob("*/formats.toml"))
_PERCENT = re.compile(r"%(?:\([^)]*\))?[-+ #0]*\d*(?:\.\d+)?([sdfrxi%])")


def format_regex(fmt: str, message_group: bool = False) -> re.Pattern:
    """A regex for what a format string can print: its literal text exactly, each value
    ({expression} of an f-string, %s / %.2f / %(name)s of %-style) as any text. With
    `message_group`, %(message)s becomes the group the message is read from."""
    parts, i = [], 0
    while i < len(fmt):
        if fmt.startswith("{{", i) or fmt.startswith("}}", i):
            parts.append(re.escape(fmt[i]))
            i += 2
        elif fmt[i] == "{":
            end = fmt.index("}", i)
            parts.append("(?:.*?)")
            i = end + 1
        elif (m := _PERCENT.match(fmt, i)) is not None:
            if m.group(0) == "%%":
                parts.append("%")
            elif message_group and m.group(0) == "%(message)s":
                parts.append("(?P<message>.*)")
            else:
                parts.append("(?:.*?)")
            i = m.end()
        else:
            parts.append(re.escape(fmt[i]))
            i += 1
    return re.compile("".join(parts))


def _formats(folder: Path) -> dict:
    return tomllib.loads((folder / "formats.toml").read_text())


def _cited_lines(folder: Path):
    """(file, line number, the key it cites or None, the line) for every log line of the folder."""
    for log in sorted(folder.glob("*.log")):
        previous = ""
        for number, line in enumerate(log.read_text().splitlines(), 1):
            if line.startswith("#@") or line.startswith("# moebench:") or not line.strip():
                previous = line
                continue
            key = previous[len("#@ fmt "):] if previous.startswith("#@ fmt ") else None
            yield log.name, number, key, line
            previous = line


def test_every_written_fixture_folder_keeps_its_format_strings():
    """A folder whose logs say they were written (not captured) must cite and keep its strings."""
    written = {log.parent for log in LOGS.glob("*/*.log")
               if re.search(r"^#@ (Reconstructed|Written) from the format strings", log.read_text(), re.M)}
    assert written and written == set(RECONSTRUCTED)


@pytest.mark.parametrize("folder", RECONSTRUCTED, ids=lambda p: p.name)
def test_every_line_is_what_the_format_string_it_cites_prints(folder):
    stored = _formats(folder)
    line_format = format_regex(stored["line"], message_group=True)
    formats = stored["format"]
    used = set()
    for name, number, key, line in _cited_lines(folder):
        where = f"{folder.name}/{name}:{number}"
        assert key is not None, f"{where}: no '#@ fmt <file:lines>' note above {line[:80]!r}"
        assert key in formats, f"{where}: cites {key!r}, which formats.toml does not keep"
        outer = line_format.fullmatch(line)
        assert outer is not None, f"{where}: not in the engine's log-line format: {line[:100]!r}"
        message = outer.group("message")
        assert format_regex(formats[key]).fullmatch(message), f"{where}: {message[:160]!r} is not what {key} prints"
        used.add(key)
    assert used == set(formats), f"stored but never cited: {sorted(set(formats) - used)}"


def test_the_lines_the_old_fixtures_had_are_refused():
    """The two SGLang lines the fixtures used to hold: a prefill line with the decode pool's
    fields and no throughput ending, and a capture line in the prefill capture's shape."""
    formats = _formats(LOGS / "sglang-0.5.23")["format"]
    prefill = format_regex(formats["sglang/srt/managers/scheduler_components/metrics_reporter.py:753-762,782-783"])
    old = ("Prefill batch, #new-seq: 4, #new-token: 3012, #cached-token: 0, #full token: 3012, full token usage: "
           "0.00, mamba num: 4, mamba usage: 0.01, #running-req: 0, #queue-req: 0, #pending-token: 0, ")
    assert not prefill.fullmatch(old)
    assert prefill.fullmatch("Prefill batch, #new-seq: 4, #new-token: 3012, #cached-token: 0, full token usage: 0.00, "
                             "mamba usage: 0.01, #running-req: 0, #queue-req: 0, #pending-token: 0, cuda graph: "
                             "False, input throughput (token/s): 1534.18")
    capture = format_regex(formats["sglang/srt/model_executor/model_runner_components/cuda_graph_setup.py:787-792"])
    assert not capture.fullmatch("Capture decode CUDA graph end. elapsed=18.22 s, mem usage=0.88 GB, avail mem=9.71 GB.")


def test_format_regex_reads_both_styles():
    assert format_regex("took %.2f GiB, %d%%").fullmatch("took 0.91 GiB, 40%")
    assert not format_regex("took %.2f GiB").fullmatch("took 0.91 MiB")
    assert format_regex("bs={runner.capture_bs}, x={a:.2f}.").fullmatch("bs=[1, 2], x=3.00.")
    assert format_regex("[%(asctime)s{p}] %(message)s", message_group=True).fullmatch("[t TP0] hi").group("message") == "hi"
