"""Profile files and the server processes moebench starts from them: parsing, one-line errors,
evidence read from a real server's log and endpoint, and no process left behind."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from moebench.backends.openai import request_seed, union_seconds
from moebench.backends.profiles import load_profiles
from moebench.backends.server import Placeholders, ServerProcess, json_field, prometheus_value
from moebench.errors import MoebenchError
from repo_paths import REPO


# A real HTTP server (the standard library's) stands in for a serving engine where only the
# process handling is under test: it logs each request, answers /health from a file, and serves
# a JSON file as an "endpoint".
SERVER = textwrap.dedent("""
    [server]
    command = ["{python}", "-m", "http.server", "{port}", "--bind", "{host}", "--directory", "DOCROOT"]
    health = "/health"
    startup_timeout_s = 30

    [[profile]]
    name = "plain"

    [[profile]]
    name = "checked"
    args = []
    env = { MOEBENCH_TEST_FLAG = "on" }
    [profile.evidence]
    log_must = ['GET /props']
    log_must_not = ['Traceback']
    [[profile.evidence.endpoint]]
    path = "/props"
    field = "slots.0.n_ctx"
    equals = 4096
    [[profile.evidence.endpoint]]
    path = "/metrics"
    metric = "requests_total"
    at_least = 3

    [[profile]]
    name = "wrong"
    approximate = true
    [profile.evidence]
    log_must = ['this line never appears']
    [[profile.evidence.endpoint]]
    path = "/props"
    field = "slots.0.n_ctx"
    equals = 8192
""")


@pytest.fixture
def profile_file(tmp_path):
    docroot = tmp_path / "www"
    docroot.mkdir()
    (docroot / "health").write_text("ok")
    (docroot / "props").write_text(json.dumps({"slots": [{"n_ctx": 4096}]}))
    (docroot / "metrics").write_text('# TYPE requests_total counter\nrequests_total{kind="a"} 2\nrequests_total{kind="b"} 1\n')
    path = tmp_path / "p.toml"
    path.write_text(SERVER.replace("DOCROOT", str(docroot)))
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purpose
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_profiles_parse_with_baseline_first(profile_file):
    pf = load_profiles(profile_file)
    assert [p.name for p in pf.profiles] == ["plain", "checked", "wrong"]
    assert pf.profiles[1].env["MOEBENCH_TEST_FLAG"] == "on"
    assert pf.profiles[2].approximate and not pf.profiles[0].approximate
    assert pf.profiles[1].evidence.endpoints[1].metric == "requests_total"
    assert len(pf.sha256) == 64
    pf.select(["plain", "wrong"])
    assert [p.name for p in pf.profiles] == ["plain", "wrong"]


@pytest.mark.parametrize("body, message", [
    ("[[profile]]\nname='a'\n", "missing the [server] table"),
    ("[server]\ncommand=[]\n[[profile]]\nname='a'\n", "server.command"),
    ("[server]\ncommand=['x']\n", "no [[profile]]"),
    ("[server]\ncommand=['x']\n[[profile]]\nname='a'\nflags=1\n", "unknown key(s) flags"),
    ("[server]\ncommand=['x']\n[[profile]]\nname='a'\n[[profile]]\nname='a'\n", "duplicate profile names"),
    ("[server]\ncommand=['x']\n[[profile]]\nname='a'\n[profile.evidence]\nlog_must=['(']\n", "bad regex"),
    ("[server]\ncommand=['x']\n[[profile]]\nname='a'\n[[profile.evidence.endpoint]]\npath='/p'\nfield='x'\n",
     "exactly one of equals"),
    ("[server]\ncommand=['x']\n[[profile]]\nname='a'\napproximate=true\n", "cannot be approximate"),
    ("[server\n", "not valid TOML"),
])
def test_bad_profile_files_are_one_line_errors(tmp_path, body, message):
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(MoebenchError) as e:
        load_profiles(path)
    assert message in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_unknown_profile_selected_is_an_error(profile_file):
    with pytest.raises(MoebenchError, match="no profile named 'nope'"):
        load_profiles(profile_file).select(["nope"])


def test_placeholder_without_value_is_an_error():
    with pytest.raises(MoebenchError, match=r"\{model\} has no value \(give --model\)"):
        Placeholders("127.0.0.1", None, None, 1).fill("{model}")


def test_evidence_from_a_real_server_and_no_process_left(profile_file, tmp_path):
    pf = load_profiles(profile_file)
    placeholders = Placeholders("127.0.0.1", None, None, 1)
    checked = ServerProcess(pf.profiles[1], placeholders, tmp_path / "logs" / "checked.log", pf.health,
                            pf.startup_timeout_s)
    wrong = ServerProcess(pf.profiles[2], placeholders, tmp_path / "logs" / "wrong.log", pf.health,
                          pf.startup_timeout_s)
    try:
        checked.start()
        wrong.start()
        assert checked.port != wrong.port
        seen, errors = checked.evidence("start")
        assert errors == [] and seen["/props slots.0.n_ctx equals 4096"] == 4096
        assert seen["/metrics requests_total at_least 3"] == 3.0
        seen, errors = checked.evidence("end")  # the log now holds the GET /props of the start check
        assert errors == [], errors
        _, errors = wrong.evidence("start")
        assert any("n_ctx is 4096, expected equals 8192" in e for e in errors)
        _, errors = wrong.evidence("end")
        assert any("no match for 'this line never appears'" in e for e in errors)
        pids = [checked.proc.pid, wrong.proc.pid]
    finally:
        checked.stop()
        wrong.stop()
    assert not any(_alive(pid) for pid in pids)
    assert "# moebench:" in (tmp_path / "logs" / "checked.log").read_text()


def test_server_that_exits_early_is_a_clear_error(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('[server]\ncommand = ["{python}", "-c", "import sys; print(\'boom\'); sys.exit(3)"]\n'
                    'startup_timeout_s = 20\n[[profile]]\nname = "a"\n')
    pf = load_profiles(path)
    server = ServerProcess(pf.profiles[0], Placeholders("127.0.0.1", None, None, 1), tmp_path / "a.log",
                           pf.health, pf.startup_timeout_s)
    with pytest.raises(MoebenchError, match="exited with code 3 before it was healthy.*boom"):
        server.start()


def test_server_dies_with_a_killed_parent(profile_file, tmp_path):
    """kill -9 of moebench itself leaves no server behind (the kernel's parent-death signal)."""
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from moebench.backends.profiles import load_profiles
        from moebench.backends.server import Placeholders, ServerProcess
        pf = load_profiles(Path({str(profile_file)!r}))
        s = ServerProcess(pf.profiles[0], Placeholders("127.0.0.1", None, None, 1), Path({str(tmp_path / 'k.log')!r}),
                          pf.health, pf.startup_timeout_s)
        s.start()
        print(s.proc.pid, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(parent.stdout.readline())
        assert _alive(server_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server_pid)
    finally:
        parent.kill()


def test_helpers():
    assert union_seconds([(0, 2), (1, 3), (5, 6)]) == 4
    assert union_seconds([]) == 0
    assert request_seed(0, "a") == request_seed(0, "a") != request_seed(1, "a")
    assert json_field({"a": [{"b": 1}]}, "a.0.b") == 1
    assert prometheus_value("x_total 1\nx_total{a=\"b\"} 2.5\ny 3\n", "x_total") == 3.5
    assert prometheus_value("y 3\n", "x_total") is None


@pytest.mark.parametrize("path", sorted((REPO / "profiles").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_profiles_parse_and_name_their_evidence(path):
    pf = load_profiles(path)
    assert len(pf.profiles) >= 2
    for profile in pf.profiles:
        assert not profile.evidence.empty, f"{path.name}: profile {profile.name} proves nothing"
