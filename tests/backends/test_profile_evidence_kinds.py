"""Two classes of evidence: runtime (it changes only when the optimization ran) and echo (the server
repeating its arguments). An optimization proved by echo alone is refused, by `profiles check` and at
a run's warm-up, in one line naming the configuration, unless the profile marks it echo_only with a
reason (kept in the run's manifest for the report); and each piece of evidence counts only against
every configuration that lacks the optimization, not only the baseline."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moebench.backends.discrimination import judge
from moebench.backends.log_readers import log_number
from moebench.backends.profiles import load_profiles
from moebench.backends.recorded import load_observation
from moebench.cli.profiles import check_profile
from moebench.errors import MoebenchError
from repo_paths import FIXTURES, REPO

LOGS = FIXTURES / "engine_logs"
VLLM = REPO / "profiles" / "vllm-qwen3-moe-gpu.toml"
SGLANG = REPO / "profiles" / "sglang-ling3-dgx-spark.toml"


def _moebench(*args):
    return subprocess.run([sys.executable, "-m", "moebench", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def _edited(tmp_path, source: Path, old: str, new: str) -> Path:
    text = source.read_text()
    assert text.count(old) == 1, old
    path = tmp_path / source.name
    path.write_text(text.replace(old, new).replace('recorded = "../tests', f'recorded = "{REPO}/tests'))
    return path


def test_fp8_kv_proved_by_its_config_line_alone_is_refused(tmp_path):
    """vLLM's kv_cache_dtype=fp8 in the engine-config line only repeats the flag: without the KV
    capacity line, profiles check exits 2 naming the configuration."""
    profile = VLLM.read_text()
    start = profile.index("# the KV cache allocated at one byte an element")
    end = profile.index("[[profile.evidence.endpoint]]", start)
    path = tmp_path / "echo.toml"
    path.write_text((profile[:start] + profile[end:]).replace('recorded = "../tests', f'recorded = "{REPO}/tests'))
    result = _moebench("profiles", "check", path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert (f"{path}: profile 'cuda-graphs+prefix-cache+fp8-kv': 'fp8-kv' is proved only by the server repeating "
            "its arguments (echo: log ~ 'with config: .*kv_cache_dtype=fp8, ')") in result.stderr
    assert "fp8-kv: runtime 0, echo 1" in result.stdout


def test_inherited_evidence_does_not_prove_the_step_that_adds_nothing(tmp_path):
    """Before: fp8-kv counted the graph, prefix-cache and eager items it inherits as its own proof.
    Judged against every configuration without fp8-kv, they prove the predecessors' optimizations
    only, and the step has nothing left."""
    profile = VLLM.read_text()
    start = profile.index("log_must = ['with config: .*kv_cache_dtype=fp8, ', ")
    path = tmp_path / "inherited.toml"
    body = profile[:start] + profile[start:].replace("'with config: .*kv_cache_dtype=fp8, ', ", "", 1)
    cut = body.index("# the KV cache allocated at one byte an element")
    body = body[:cut] + body[body.index("[[profile.evidence.endpoint]]", cut):]
    path.write_text(body.replace('recorded = "../tests', f'recorded = "{REPO}/tests'))
    pf = load_profiles(path)
    fp8 = pf.profiles[-1]
    observations = {p.name: load_observation(LOGS / "vllm-0.34.0", p.name) for p in pf.profiles}
    against_baseline = judge(fp8, {"baseline": observations["baseline"]}, pf.profiles, "baseline")
    # against the baseline alone each inherited item seems to prove every optimization of the step
    assert against_baseline.proofs.get("fp8-kv") and not against_baseline.unproved
    verdict = judge(fp8, observations, pf.profiles, "baseline")
    assert verdict.unproved == ["fp8-kv"] and not verdict.refused
    assert verdict.problem().startswith("profile 'cuda-graphs+prefix-cache+fp8-kv' has no evidence of 'fp8-kv' "
                                        "that the configurations without it lack")


def test_an_item_that_a_configuration_without_the_optimization_shows_is_refused(tmp_path):
    """llama.cpp's stack claims continuous batching and flash attention; declared as one
    optimization of its own, its slot count holds for cont-batching and its flash-attention line
    for flash-attn, neither of which is the baseline."""
    path = _edited(tmp_path, REPO / "profiles" / "llamacpp-cpu.toml",
                   'enables = ["cont-batching", "flash-attn"]\n', 'enables = ["stack"]\n')
    path.write_text(path.read_text().replace('proves = "cont-batching"\n', ""))
    problems = check_profile(path, echo=lambda _: None)
    assert any(p.startswith(f"{path}: profile 'stack': evidence log ~ 'load_model: initializing, n_slots = 16, ' "
                            "also holds for 'cont-batching'") for p in problems), problems
    # and the other way round: cont-batching's slot count holds for a stack that claims only "stack"
    assert problems[0].startswith(f"{path}: profile 'cont-batching': evidence log ~ 'load_model: initializing, "
                                  "n_slots = 16, ' also holds for 'stack'")


def test_echo_only_marks_are_printed_and_kept_in_the_manifest_entry():
    lines = []
    assert check_profile(REPO / "profiles" / "llamacpp-cpu.toml", echo=lines.append) == []
    out = "\n".join(lines)
    assert "flash-attn: runtime 0, echo 1" in out and "cont-batching: runtime 1, echo 3" in out
    assert "echo-only (marked): llama-server logs the flash-attention setting it resolved" in out
    assert out.count("echo-only, marked in the profile: flash-attn (flash-attn: ") == 1
    flash = next(p for p in load_profiles(REPO / "profiles" / "llamacpp-cpu.toml").profiles if p.name == "flash-attn")
    entry = flash.to_dict()
    assert entry["echo_only"].startswith("llama-server logs") and entry["enables"] == ["flash-attn"]


@pytest.mark.parametrize("path", sorted((REPO / "profiles").glob("*.toml")), ids=lambda p: p.name)
def test_no_shipped_configuration_is_proved_by_echo_unless_marked(path):
    pf = load_profiles(path)
    observations = {p.name: o for p in pf.profiles if (o := load_observation(pf.recorded_dir, p.name))}
    for profile in pf.profiles[1:]:
        verdict = judge(profile, observations, pf.profiles, pf.baseline.name)
        assert verdict.ok, verdict.problem()
        assert bool(verdict.echo_proved) == bool(profile.echo_only), profile.name


def test_a_mark_on_a_configuration_with_runtime_proof_is_refused(tmp_path):
    path = _edited(tmp_path, SGLANG, 'name = "moe-runner"\n',
                   'name = "moe-runner"\necho_only = true\necho_only_reason = "none"\n')
    problems = check_profile(path, echo=lambda _: None)
    assert problems == [f"{path}: profile 'moe-runner' is marked echo_only, yet every optimization it enables has "
                        "runtime evidence; drop echo_only and echo_only_reason"]


@pytest.mark.parametrize("body, message", [
    ("[[profile]]\nname='b'\n[[profile]]\nname='a'\necho_only=true\n", "echo_only = true needs echo_only_reason"),
    ("[[profile]]\nname='b'\n[[profile]]\nname='a'\necho_only_reason='x'\n", "echo_only_reason without echo_only"),
    ("[[profile]]\nname='b'\necho_only=true\necho_only_reason='x'\n[[profile]]\nname='a'\n", "cannot be echo_only"),
    ("[[profile]]\nname='b'\nenables=['x']\n[[profile]]\nname='a'\n", "the baseline enables nothing"),
    ("[[profile]]\nname='b'\n[[profile]]\nname='a'\nenables=[]\n", "enables must name at least one"),
    ("[[profile]]\nname='b'\n[[profile]]\nname='a'\n[profile.evidence]\nlog_must=[{pattern='x', kind='live'}]\n",
     "kind must be one of 'runtime', 'echo'"),
    ("[[profile]]\nname='b'\n[[profile]]\nname='a'\n[[profile.evidence.log_value]]\npattern='x'\nat_least=1\n",
     "the pattern needs a group"),
    ("[[profile]]\nname='b'\n[[profile]]\nname='a'\n[[profile.evidence.log_value]]\nreader='nope'\nat_least=1\n",
     "no log reader 'nope'"),
    ("[[profile]]\nname='b'\n[[profile]]\nname='a'\n[[profile.evidence.log_value]]\npattern='(x)'\n",
     "give exactly one of equals, at_least, above"),
    ("[[profile]]\nname='b'\n[[profile]]\nname='a'\n[profile.evidence]\nlog_must=[{pattern='x', proves='z'}]\n",
     "proves 'z', which it does not enable (a)"),
])
def test_bad_kind_keys_are_one_line_errors(tmp_path, body, message):
    path = tmp_path / "bad.toml"
    path.write_text("[server]\ncommand=['x']\n" + body)
    with pytest.raises(MoebenchError) as e:
        load_profiles(path)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_log_number_reads_the_largest_capture():
    log = "GPU KV cache size: 87,376 tokens, x\nGPU KV cache size: 174,752 tokens, y\n"
    assert log_number(r"GPU KV cache size: ([\d,]+) tokens, ", log) == 174752
    assert log_number(r"CPU KV cache size: ([\d,]+) tokens", log) is None


def test_warm_up_refuses_a_configuration_proved_by_echo_alone(tmp_path):
    """Real HTTP servers (the standard library's): 'slots' proves itself only by a field that
    repeats its argument; the run stops at warm-up with exit 2 and one line naming it, before any
    trial. Marked echo_only with a reason, the same profile passes the warm-up."""
    roots = {}
    for name, slots in (("baseline", 1), ("slots", 4)):  # each configuration's server answers its own slots
        roots[name] = tmp_path / name
        roots[name].mkdir()
        (roots[name] / "health").write_text("ok")
        (roots[name] / "props").write_text(json.dumps({"slots": slots}))
    body = textwrap.dedent(f"""
        [server]
        command = ["{{python}}", "-m", "http.server", "{{port}}", "--bind", "{{host}}"]
        startup_timeout_s = 30
        [[profile]]
        name = "baseline"
        args = ["--directory", "{roots['baseline']}"]
        [[profile]]
        name = "slots"
        args = ["--directory", "{roots['slots']}"]
        MARK
        [profile.evidence]
        [[profile.evidence.endpoint]]
        path = "/props"
        field = "slots"
        equals = 4
    """)
    from moebench.backends.http import HttpBackend
    from moebench.backends.openai import ClientOptions
    from moebench.backends.server import Placeholders

    def warm(mark: str):
        path = tmp_path / "p.toml"
        path.write_text(body.replace("MARK", mark))
        backend = HttpBackend(ClientOptions(), tmp_path / "run", load_profiles(path), served_model="m",
                              placeholders=Placeholders("127.0.0.1", None, None, 1))
        backend.warm_up(None, 0)
        return path

    with pytest.raises(MoebenchError) as e:
        warm("")
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path / 'p.toml'}: profile 'slots': 'slots' is proved only by the server "
                              "repeating its arguments (echo: /props slots equals 4 (start))")
    warm('echo_only = true\n        echo_only_reason = "this test server has nothing else to show"')


def test_the_report_prints_the_echo_only_reason_beside_the_configuration():
    from moebench.results.report import Table, _activation_blocks

    def config(name, **extra):
        return {"name": name, "activation": {"ok": True, "errors": [], "evidence": {}}, **extra}

    blocks = _activation_blocks({"configs": [config("baseline"),
                                             config("flash-attn", echo_only="no counter names the kernel")]})
    table = next(b for b in blocks if isinstance(b, Table))
    assert table.rows[1][:2] == ["flash-attn", "yes (echo only: no counter names the kernel)"]
    assert table.rows[0][:2] == ["baseline", "yes"]
