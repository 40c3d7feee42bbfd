"""A full disk names the file it could not write, and `report` leaves no 0-byte plot behind;
a malformed JSON line says where in the line."""

import subprocess
import sys

import pytest

from moebench.errors import MoebenchError
from moebench.fileio import read_jsonl
from repo_paths import REPO


# Runs `args` as `moebench` under a file-size limit: writes past it fail as on a full disk (EFBIG).
LIMITED = """
import resource, sys
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY))
sys.argv = ["moebench", *sys.argv[1:]]
from moebench.cli.app import main
main()
"""


def _limited(limit: int, *args):
    return subprocess.run([sys.executable, "-c", LIMITED.format(limit=limit), *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)


def test_an_atomic_write_that_fails_names_its_file(tmp_path):
    script = ("import resource\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))\n"
              "from moebench.fileio import atomic_write_bytes, append_jsonl\n"
              "for write in (lambda: atomic_write_bytes(%r, b'x' * 5000), lambda: append_jsonl(%r, {'x': 'y' * 5000})):\n"
              "    try:\n"
              "        write()\n"
              "    except OSError as e:\n"
              "        print(e.filename)\n" % (str(tmp_path / "a.bin"), str(tmp_path / "b.jsonl")))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == [str(tmp_path / "a.bin"), str(tmp_path / "b.jsonl")], result.stderr
    assert not (tmp_path / "a.bin").exists() and not list(tmp_path.glob(".a.bin.*"))


def test_report_on_a_full_disk_leaves_no_empty_plot(tmp_path):
    from fixtures.make_run import make_run

    run_dir = make_run(tmp_path / "run", configs=("baseline", "kernel"))
    out = tmp_path / "report"
    result = _limited(4096, "report", run_dir, "--out", out)  # far less than one plot
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and ".png" in lines[0] and str(out) in lines[0], result.stderr
    assert [p.name for p in out.glob("*.png") if p.stat().st_size == 0] == []
    assert not list(out.glob(".*.tmp"))


def test_a_malformed_json_line_says_where(tmp_path):
    f = tmp_path / "samples.jsonl"
    bad = '{"output": "tab\there"}'
    f.write_text('{"a": 1}\n' + bad + "\n")
    with pytest.raises(MoebenchError) as e:
        read_jsonl(f)
    column = bad.index("\t") + 1
    assert str(e.value).endswith(f"samples.jsonl:2: malformed JSON line (Invalid control character at column {column})")
