"""llama.cpp's `llama-batched-bench` as bench-engine's yardstick: its output table read by column
name (on a recorded output of the real binary), its command line, a real run where the binary is
cached for this CPU, and the build cache that makes it beside llama-server (one cmake --build for
both targets; an older cache with only the server builds only the missing one)."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from moebench.backends import llamacpp
from moebench.backends.batched_bench import batched_bench_argv, parse_batched_bench_table, run_batched_bench
from moebench.errors import MoebenchError
from repo_paths import FIXTURES

FIXTURE = FIXTURES / "llama_batched_bench_output.txt"


def _within_rounding(rate: float, tokens: int, seconds: float) -> bool:
    """rate = tokens / seconds, where seconds was printed to the millisecond."""
    return tokens / (seconds + 5e-4) <= rate <= tokens / max(seconds - 5e-4, 1e-9)


def test_recorded_output_parses_to_its_rows():
    """The fixture is llama-batched-bench's whole output (stdout and stderr) for `-npp 128 -ntg 63
    -npl 1,16` on the tiny test checkpoint's F32 GGUF, one thread."""
    rows = parse_batched_bench_table(FIXTURE.read_text())
    assert [(r.prompt_tokens, r.decode_steps, r.batch) for r in rows] == [(128, 63, 1), (128, 63, 16)]
    assert [r.decode_tok_s for r in rows] == [2464.79, 4271.89]
    for r in rows:
        # the columns are where the header says: S_TG is B * TG / T_TG, N_KV is B * (PP + TG)
        assert _within_rounding(r.decode_tok_s, r.batch * r.decode_steps, r.decode_s)
        assert _within_rounding(r.prefill_tok_s, r.batch * r.prompt_tokens, r.prefill_s)
        assert r.kv_cells == r.batch * (r.prompt_tokens + r.decode_steps)
        assert r.total_s == pytest.approx(r.prefill_s + r.decode_s, abs=1.5e-3)


def test_columns_are_found_by_name_not_position():
    text = FIXTURE.read_text().splitlines()
    at = next(i for i, line in enumerate(text) if "S_TG t/s" in line)
    swap = lambda line: "|".join((lambda c: c[:7] + [c[8], c[7]] + c[9:])(line.split("|")))  # T_TG <-> S_TG
    swapped = text[:at] + [swap(line) if line.startswith("|") else line for line in text[at:]]
    original, moved = parse_batched_bench_table("\n".join(text)), parse_batched_bench_table("\n".join(swapped))
    assert moved == original


@pytest.mark.parametrize("text, needle", [
    ("main: n_kv_max = 2048\nllama_perf_context_print: load time = 1 ms\n", "no results table"),
    ("|    PP |     TG |    B | S_TG t/s |\n|-------|--------|------|----------|\n|  1 | 2 | 1 | 3.0 |\n", "lacks the columns"),
])
def test_output_without_a_table_is_an_error(text, needle):
    with pytest.raises(MoebenchError, match=needle):
        parse_batched_bench_table(text)


def test_unreadable_or_missing_rows_are_errors():
    text = FIXTURE.read_text().splitlines()
    at = next(i for i, line in enumerate(text) if "S_TG t/s" in line)
    bad = text[:at + 2] + [text[at + 2].replace(text[at + 2].split("|")[8], " nan? ")]
    with pytest.raises(MoebenchError, match="S_TG t/s is 'nan\\?'"):
        parse_batched_bench_table("\n".join(bad))
    with pytest.raises(MoebenchError, match="no rows"):
        parse_batched_bench_table("\n".join(text[:at + 2] + [""]))


def test_argv_is_one_cell_with_weights_in_memory_and_an_f32_cache():
    argv = batched_bench_argv(Path("/bin/llama-batched-bench"), Path("m.gguf"), 2, 128, 63, 16)
    value = lambda flag: argv[argv.index(flag) + 1]
    assert value("--load-mode") == "none" and value("-t") == value("-tb") == "2"
    assert value("-ctk") == value("-ctv") == "f32"
    assert (value("-npp"), value("-ntg"), value("-npl")) == ("128", "63", "16")
    assert int(value("-c")) >= 16 * (128 + 63)  # else batched-bench skips the cell silently


def test_real_run_on_a_tiny_gguf(tmp_path):
    """Where llama-batched-bench is cached for this CPU: one cell of a tiny checkpoint's GGUF."""
    try:
        binary = llamacpp.llama_batched_bench_path(build=False)
    except MoebenchError as e:
        pytest.skip(f"llama-batched-bench is not built for this CPU ({e}); "
                    "`moebench engines build-llamacpp` builds it (about 10 CPU-minutes)")
    from moebench.models.export_gguf import export_gguf
    from tiny_models import make_tiny_checkpoint, write_char_tokenizer

    model = write_char_tokenizer(make_tiny_checkpoint(tmp_path / "tiny"), 211)
    gguf = export_gguf(model, tmp_path / "tiny.gguf", "f32")
    run = run_batched_bench(binary, gguf, 1, 12, 5, 2)
    assert (run.row.prompt_tokens, run.row.decode_steps, run.row.batch) == (12, 5, 2)
    # its table prints seconds to the millisecond: 5 steps of a tiny model can print 0.000 s, its rate stays positive
    assert run.row.decode_tok_s > 0 and run.row.decode_s >= 0
    assert run.argv[run.argv.index("--load-mode") + 1] == "none"


# ------------------------------------------------------------------------------ the build cache


@pytest.fixture
def fake_toolchain(monkeypatch, tmp_path):
    """build_llama_binaries with pip and cmake replaced: pip leaves a source distribution holding a
    vendored tree, `cmake --build` leaves a binary for every --target it was given. Records argv."""
    monkeypatch.setenv("MOEBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MOEBENCH_LLAMA_SERVER", raising=False)
    monkeypatch.delenv("MOEBENCH_LLAMA_BATCHED_BENCH", raising=False)
    monkeypatch.setattr(llamacpp, "_toolchain", lambda: {"cmake": "cmake", "C compiler": "cc", "C++ compiler": "c++"})
    calls: list[list[str]] = []

    def run_logged(argv, log, what, cwd=None):
        calls.append(argv)
        if "download" in argv:
            sdist = Path(argv[argv.index("-d") + 1]) / f"llama_cpp_python-{llamacpp.LLAMA_CPP_PYTHON_VERSION}.tar.gz"
            with tarfile.open(sdist, "w:gz") as archive:
                info = tarfile.TarInfo(f"llama_cpp_python-{llamacpp.LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/CMakeLists.txt")
                info.size = 0
                archive.addfile(info, io.BytesIO(b""))
        elif "--build" in argv:
            bin_dir = Path(argv[argv.index("--build") + 1]) / "bin"
            bin_dir.mkdir(parents=True, exist_ok=True)
            for i, arg in enumerate(argv):
                if arg == "--target":
                    (bin_dir / argv[i + 1]).write_text("#!/bin/sh\n")

    monkeypatch.setattr(llamacpp, "_run_logged", run_logged)
    return calls


def _builds(calls):
    return [[a[i + 1] for i, x in enumerate(a) if x == "--target"] for a in calls if "--build" in a]


def test_cold_cache_builds_both_targets_in_one_cmake_build(fake_toolchain):
    server = llamacpp.llama_server_path()
    assert _builds(fake_toolchain) == [["llama-server", "llama-batched-bench"]]
    assert llamacpp.llama_batched_bench_path() == server.with_name("llama-batched-bench")
    assert len(_builds(fake_toolchain)) == 1  # the second binary was already there
    records = json.loads((server.parent.parent / "build.json").read_text())
    assert set(records) == {"llama-server", "llama-batched-bench"}
    assert records["llama-server"]["built_with"] == ["llama-server", "llama-batched-bench"]


def test_old_cache_with_only_the_server_builds_only_the_bench(fake_toolchain):
    dest = llamacpp.build_dir()
    (dest / "bin").mkdir(parents=True)
    (dest / "bin" / "llama-server").write_text("old")
    (dest / "build.json").write_text(json.dumps({"llama_cpp_python": "0.3.36", "minutes": 14.0}))  # the old flat record
    with pytest.raises(MoebenchError, match="no llama-batched-bench built"):
        llamacpp.llama_batched_bench_path(build=False)
    assert llamacpp.llama_batched_bench_path() == dest / "bin" / "llama-batched-bench"
    assert _builds(fake_toolchain) == [["llama-batched-bench"]]
    assert (dest / "bin" / "llama-server").read_text() == "old"  # not rebuilt
    records = json.loads((dest / "build.json").read_text())
    assert records["llama-server"]["minutes"] == 14.0 and records["llama-batched-bench"]["built_with"] == ["llama-batched-bench"]


def test_override_names_a_binary_you_built(fake_toolchain, tmp_path, monkeypatch):
    mine = tmp_path / "my-batched-bench"
    mine.write_text("#!/bin/sh\n")
    os.chmod(mine, 0o755)
    monkeypatch.setenv("MOEBENCH_LLAMA_BATCHED_BENCH", str(mine))
    assert llamacpp.llama_batched_bench_path() == mine and not _builds(fake_toolchain)
    monkeypatch.setenv("MOEBENCH_LLAMA_BATCHED_BENCH", str(tmp_path / "absent"))
    with pytest.raises(MoebenchError, match="not an executable file"):
        llamacpp.llama_batched_bench_path()


def test_a_run_whose_table_never_reached_its_output_is_run_again(tmp_path, capsys):
    """llama.cpp's log thread is not flushed at exit: a clean exit without the table is retried,
    loudly; a table that never comes is an error, not a rate."""
    table = FIXTURE.read_text().replace("|   128 |     63 |   16 |", "|    12 |      5 |    2 |")
    rows_of = [line for line in table.splitlines() if line.startswith("|   128 |     63 |    1 |")]
    table = table.replace(rows_of[0] + "\n", "")
    (tmp_path / "table.txt").write_text(table)
    fake = tmp_path / "llama-batched-bench"
    # prints nothing on its first run, the table on the next ones
    fake.write_text(f"#!/bin/sh\nif [ -e {tmp_path}/ran ]; then cat {tmp_path}/table.txt; fi\ntouch {tmp_path}/ran\n")
    os.chmod(fake, 0o755)
    run = run_batched_bench(fake, tmp_path / "m.gguf", 1, 12, 5, 2)
    assert run.attempts == 2 and run.row.decode_tok_s == 4271.89
    assert "running the cell again" in capsys.readouterr().err
    fake.write_text("#!/bin/sh\necho loading\n")
    with pytest.raises(MoebenchError, match="in 3 runs of"):
        run_batched_bench(fake, tmp_path / "m.gguf", 1, 12, 5, 2)
    fake.write_text("#!/bin/sh\necho 'error: unable to load model'\nexit 1\n")
    with pytest.raises(MoebenchError, match="exited with code 1; its output ends: error: unable to load model"):
        run_batched_bench(fake, tmp_path / "m.gguf", 1, 12, 5, 2)
