"""Evidence that discriminates: a configuration's must-match evidence is judged against
the baseline's own output too, and evidence that holds there is refused in one line, unless marked
shared. Judged here on the recorded output of SGLang 0.5.23 and vLLM 0.34.0 (reconstructed from
their format strings, tests/fixtures/engine_logs), on a real HTTP server at warm-up, and on the
bundled runtime's own evidence."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moebench.backends.discrimination import bundled_problems, judge, refuse_non_discriminating
from moebench.backends.evidence import evaluate
from moebench.backends.profiles import load_profiles
from moebench.backends.recorded import load_observation
from moebench.errors import MoebenchError
from moebench.cli.profiles import check_profile
from repo_paths import FIXTURES, REPO

LOGS = FIXTURES / "engine_logs"
SGLANG = LOGS / "sglang-0.5.23"
VLLM = LOGS / "vllm-0.34.0"


def _moebench(*args):
    return subprocess.run([sys.executable, "-m", "moebench", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def _profile_text(tmp_path, body: str, recorded: Path, command: str = '["true"]') -> Path:
    path = tmp_path / "p.toml"
    path.write_text(f'[checked]\nengine = "test"\nrecorded = "{recorded}"\n[server]\ncommand = {command}\n'
                    + textwrap.dedent(body))
    return path


@pytest.mark.parametrize("path", sorted((REPO / "profiles").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_profile_passes_its_check(path):
    pf = load_profiles(path)
    assert pf.checked.get("engine") and pf.recorded_dir is not None and pf.recorded_dir.is_dir()
    lines = []
    assert check_profile(path, echo=lines.append) == [], "\n".join(lines)
    # every configuration was recorded, so its evidence was also checked on its own output
    assert not any("no recorded output of this configuration" in line for line in lines)
    negatives = sorted(pf.recorded_dir.glob("*.*.log"))
    assert sum("refuses " in line for line in lines) == len(negatives)


def test_profiles_check_fails_evidence_that_accepts_output_recorded_as_not_proving(tmp_path):
    """The old vLLM pattern '(?i)graph captur' discriminates from the eager baseline, yet accepts
    the output where capture was skipped: profiles check refuses it in one line."""
    old = (REPO / "profiles" / "vllm-qwen3-moe-gpu.toml").read_text()
    new = "{ pattern = '(?<!Encoder )Graph capturing finished in \\d+ secs', kind = \"runtime\" },\n            { pattern = 'with config: .*enable_prefix"
    assert new in old
    path = tmp_path / "old-vllm.toml"
    path.write_text(old.replace(new, "{ pattern = '(?i)graph captur', kind = \"runtime\" },\n            { pattern = 'with config: .*enable_prefix")
                    .replace("log_must_not = ['Traceback', 'Skipping encoder and decoder CUDA graph capture']\n",
                             "log_must_not = ['Traceback']\n", 1)
                    .replace('recorded = "../tests', f'recorded = "{REPO}/tests'))
    result = _moebench("profiles", "check", path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"profile 'cuda-graphs': its evidence accepts {VLLM / 'cuda-graphs.capture-skipped.log'}" in result.stderr


def test_the_old_fp8_lm_head_evidence_is_refused_in_one_line(tmp_path):
    """Before: '(?i)lm_head.*fp8|fp8.*lm_head' counted the FP8 LM head as on; SGLang's one-line
    server_args dump (enable_fp32_lm_head ... fp8_gemm_runner_backend) matches it in every server."""
    path = _profile_text(tmp_path, """
        [[profile]]
        name = "baseline"
        [[profile]]
        name = "moe-runner+fp8-lm-head"
        [profile.evidence]
        log_must = ['The server is fired up and ready to roll', '(?i)lm_head.*fp8|fp8.*lm_head']
    """, SGLANG)
    result = _moebench("profiles", "check", path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert "profile 'moe-runner+fp8-lm-head'" in result.stderr and "also holds for the baseline" in result.stderr
    assert "does NOT prove it" in result.stdout
    # what the baseline showed: its server_args line
    baseline = load_observation(SGLANG, "baseline")
    pf = load_profiles(path)
    verdict = judge(pf.profiles[1], {"baseline": baseline}, pf.profiles, "baseline")
    assert {i.pattern for i, _, _ in verdict.refused} == {'The server is fired up and ready to roll',
                                                          '(?i)lm_head.*fp8|fp8.*lm_head'}
    import re

    server_args = next(line for line in baseline.log.splitlines() if "] server_args={" in line)
    assert dict((i.pattern, s) for i, _, s in verdict.refused)['(?i)lm_head.*fp8|fp8.*lm_head'] in server_args
    # not only through the checkpoint's name and quantization: the field names alone match
    names_only = server_args.replace("FP8", "x").replace("'fp8'", "'x'")
    match = re.search('(?i)lm_head.*fp8|fp8.*lm_head', names_only)
    assert match.group(0).startswith("lm_head': False") and names_only[match.end():].startswith("_gemm_runner_backend")


def test_marking_evidence_shared_is_not_enough_without_evidence_of_its_own(tmp_path):
    path = _profile_text(tmp_path, """
        [[profile]]
        name = "baseline"
        [[profile]]
        name = "moe-runner"
        [profile.evidence]
        log_must = [{ pattern = 'The server is fired up and ready to roll', shared = true }]
    """, SGLANG)
    with pytest.raises(MoebenchError, match="has no evidence that the baseline 'baseline' lacks"):
        base, other = load_profiles(path).profiles
        refuse_non_discriminating(path, base, [other], load_observation(SGLANG, "baseline"))
    problems = check_profile(path, echo=lambda _: None)
    assert "no evidence that the baseline" in problems[0]
    # and the readiness line alone accepts output where another MoE kernel was loaded
    assert problems[1:] and all("moe-runner.other-kernel.log" in p for p in problems[1:])


def test_an_auto_baseline_would_make_the_moe_runner_step_a_no_op(tmp_path):
    """The checkpoint decides what "auto" means: for Ling-3.0-flash FP8 (MXFP4 experts) on GB10 it
    resolves to flashinfer_mxfp4, so a baseline of "auto" already is the optimized runner. A
    recorded auto baseline (the moe-runner configuration's own output) refuses the step."""
    pf = load_profiles(REPO / "profiles" / "sglang-ling3-dgx-spark.toml")
    moe_runner = next(p for p in pf.profiles if p.name == "moe-runner")
    auto_baseline = load_observation(SGLANG, "moe-runner")
    verdict = judge(moe_runner, {"baseline": auto_baseline}, pf.profiles, "baseline")
    assert [i.check.field if i.check else i.pattern for i, _, _ in verdict.refused] == [
        'Preparing DSv4 MXFP4 experts for FlashInfer SM120 CUTLASS W4A8 \\(layer: ', "moe_runner_backend"]
    assert judge(moe_runner, {"baseline": load_observation(SGLANG, "baseline")}, pf.profiles, "baseline").ok


def test_mtp_evidence_fails_where_speculative_decoding_did_not_run():
    pf = load_profiles(REPO / "profiles" / "sglang-ling3-dgx-spark.toml")
    mtp = next(p for p in pf.profiles if p.name == "moe-runner+mtp")
    no_spec = load_observation(SGLANG, "moe-runner")  # same server without the speculative flags
    errors = evaluate(mtp.evidence, "start", no_spec)[1] + evaluate(mtp.evidence, "end", no_spec)[1]
    assert any("speculative_algorithm is None" in e for e in errors)
    assert any("speculative_num_draft_tokens is None" in e for e in errors)
    assert any("no field 'internal_states.0.avg_spec_accept_length'" in e for e in errors)
    # drafts never accepted: the bonus token alone reads 1.0, which is not above 1
    rejected = load_observation(SGLANG, "moe-runner+mtp")
    rejected.payloads["end"]["/server_info"]["internal_states"][0]["avg_spec_accept_length"] = 1.0
    assert any("avg_spec_accept_length is 1.0, expected above 1.0" in e for e in evaluate(mtp.evidence, "end", rejected)[1])


def test_vllm_skipped_graph_capture_does_not_count_as_graphs():
    """Before: '(?i)graph captur' also matched the warning that capture was skipped."""
    pf = load_profiles(REPO / "profiles" / "vllm-qwen3-moe-gpu.toml")
    graphs = next(p for p in pf.profiles if p.name == "cuda-graphs")
    skipped = load_observation(VLLM, "cuda-graphs.capture-skipped")
    errors = evaluate(graphs.evidence, "end", skipped)[1]
    assert any("no match for '(?<!Encoder )Graph capturing finished in" in e for e in errors)
    assert any("forbidden 'Skipping encoder and decoder CUDA graph capture'" in e for e in errors)
    import re

    assert re.search("(?i)graph captur", skipped.log)  # the old pattern passed it
    assert evaluate(graphs.evidence, "end", load_observation(VLLM, "cuda-graphs"))[1] == []


def test_vllm_configurations_check_what_they_must_not_change():
    """Each configuration's shared patterns fail on output where that setting did change: the
    fp8-kv run's output fails prefix-cache's kv_cache_dtype=auto, the prefix-cache run's fails
    cuda-graphs' enable_prefix_caching=False."""
    pf = load_profiles(REPO / "profiles" / "vllm-qwen3-moe-gpu.toml")
    by_name = {p.name: p for p in pf.profiles}
    errors = evaluate(by_name["cuda-graphs+prefix-cache"].evidence, "end",
                      load_observation(VLLM, "cuda-graphs+prefix-cache+fp8-kv"))[1]
    assert errors == ["server log has no match for 'with config: .*kv_cache_dtype=auto, ' "
                      f"({VLLM / 'cuda-graphs+prefix-cache+fp8-kv.log'} and cuda-graphs+prefix-cache+fp8-kv.endpoints.json)"]
    errors = evaluate(by_name["cuda-graphs"].evidence, "end", load_observation(VLLM, "cuda-graphs+prefix-cache"))[1]
    assert len(errors) == 1 and "enable_prefix_caching=False" in errors[0]


def test_the_old_fallback_pattern_would_fail_a_healthy_server():
    """'(?i)fall(ing)? ?back' as must-not: SGLang logs unrelated fallbacks (a Triton MoE config
    file, an attention backend); the narrowed pattern names the one that replaces a MoE runner."""
    import re

    line = ("[2026-12-02 10:00:20 TP0] Config file not found at /x.json. Fallback to triton version 3.5.1 and use "
            "MoE kernel config from /y.json. Performance might be sub-optimal!")  # fused_moe_triton_config.py:137
    assert re.search("(?i)fall(ing)? ?back", line)
    pf = load_profiles(REPO / "profiles" / "sglang-ling3-dgx-spark.toml")
    for profile in pf.profiles:
        assert not any(re.search(p, line) for p in profile.evidence.log_must_not)
    override = "[2026-12-02 10:00:01] mxfp8 quantization supports only cutlass, deep_gemm backends. Overriding 'triton'."
    assert all(any(re.search(p, override) for p in profile.evidence.log_must_not) for profile in pf.profiles)


@pytest.mark.parametrize("body, message", [
    ("[[profile]]\nname='a'\n[profile.evidence]\nlog_must=[{pattern='x', shared='yes'}]\n", "shared must be true or false"),
    ("[[profile]]\nname='a'\n[profile.evidence]\nlog_must=[{regex='x'}]\n", "needs 'pattern'"),
    ("[[profile]]\nname='a'\n[[profile.evidence.endpoint]]\npath='/p'\nfield='x'\nabove='1'\n", "above needs a number"),
    ("[[profile]]\nname='a'\n[[profile.evidence.endpoint]]\npath='/p'\nfield='x'\nequals=1\nshare=true\n",
     "unknown key(s) share"),
    ("[checked]\nversion='1'\n[[profile]]\nname='a'\n", "[checked] takes engine"),
])
def test_bad_discrimination_keys_are_one_line_errors(tmp_path, body, message):
    path = tmp_path / "bad.toml"
    path.write_text("[server]\ncommand=['x']\n" + body)
    with pytest.raises(MoebenchError) as e:
        load_profiles(path)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_profiles_check_without_recorded_output_is_one_line(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("[server]\ncommand=['x']\n[[profile]]\nname='a'\n")
    result = _moebench("profiles", "check", path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "give --recorded DIR" in result.stderr


# ----------------------------------------------------------- a real server, at warm-up

def test_warm_up_refuses_evidence_the_baseline_server_also_shows(tmp_path):
    """A real HTTP server per configuration (the standard library's, serving a JSON file): the
    second configuration's endpoint check holds for the baseline's server too, and the warm-up
    stops with one line naming the profile entry, before that configuration's server starts."""
    from moebench.backends.http import HttpBackend
    from moebench.backends.openai import ClientOptions
    from moebench.backends.server import Placeholders

    docroot = tmp_path / "www"
    docroot.mkdir()
    (docroot / "health").write_text("ok")
    (docroot / "props").write_text(json.dumps({"slots": 4}))
    command = f'["{{python}}", "-m", "http.server", "{{port}}", "--bind", "{{host}}", "--directory", "{docroot}"]'
    path = _profile_text(tmp_path, """
        startup_timeout_s = 30
        [[profile]]
        name = "baseline"
        [[profile]]
        name = "slots"
        [profile.evidence]
        log_must = ['GET /props']
        [[profile.evidence.endpoint]]
        path = "/props"
        field = "slots"
        equals = 4
    """, tmp_path, command)
    pf = load_profiles(path)
    backend = HttpBackend(ClientOptions(), tmp_path / "run", pf, served_model="m",
                          placeholders=Placeholders("127.0.0.1", None, None, 1))
    with pytest.raises(MoebenchError) as e:
        backend.warm_up(None, 0)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{path}: profile 'slots': evidence ")
    assert "also holds for the baseline 'baseline'" in message
    # the baseline's server was asked /props for the other configuration; 'slots' never started
    assert "GET /props" in (tmp_path / "run" / "servers" / "baseline-warmup.log").read_text()
    assert not (tmp_path / "run" / "servers" / "slots-warmup.log").exists()


# ----------------------------------------------------------- the bundled runtime

def test_bundled_switch_evidence_must_fail_on_the_baseline(tmp_path):
    """Real evidence of two runs of the bundled runtime (naive and fused kernel): the fused
    configuration's evidence discriminates from a naive baseline; a baseline whose evidence shows
    fused calls (its switch was ignored) makes the kernel configuration's evidence refused."""
    from typer.testing import CliRunner
    import typer

    from moebench.ablation import point
    from moebench.cli.run import run_command

    app = typer.Typer()
    app.command("run")(run_command)
    app.command("noop")(lambda: None)
    evidence = {}
    for kernel in ("naive", "fused"):
        result = CliRunner().invoke(app, ["run", "--kernel", kernel, "--limit", "2", "--max-new-tokens", "4",
                                          "--warmup", "0", "--out", str(tmp_path), "--run-id", kernel])
        assert result.exit_code == 0, result.output
        trial = json.loads((tmp_path / kernel / "trials.jsonl").read_text().splitlines()[0])
        evidence[kernel] = trial["evidence"]
    base, fused = point("naive", "static", "off"), point("fused", "static", "off")
    assert bundled_problems([base, fused], {"baseline": evidence["naive"], "kernel": evidence["fused"]}, 2, 16) == []
    problems = bundled_problems([base, fused], {"baseline": evidence["fused"], "kernel": evidence["fused"]}, 2, 16)
    assert problems == ["config 'kernel': the evidence of kernel=fused holds for the baseline 'baseline' too, "
                        "so it cannot tell the two apart"]


def test_vllm_settings_check_left_unmarked_is_refused_in_one_line(tmp_path):
    """cuda-graphs' check that prefix caching stayed off holds for the baseline too: unmarked,
    it would count as proof of CUDA graphs."""
    text = (REPO / "profiles" / "vllm-qwen3-moe-gpu.toml").read_text()
    marked = "{ pattern = 'with config: .*enable_prefix_caching=False, ', shared = true }"
    assert text.count(marked) == 1
    path = tmp_path / "unmarked.toml"
    path.write_text(text.replace(marked, "'with config: .*enable_prefix_caching=False, '")
                    .replace('recorded = "../tests', f'recorded = "{REPO}/tests'))
    result = _moebench("profiles", "check", path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert ("profile 'cuda-graphs': evidence log ~ 'with config: .*enable_prefix_caching=False, ' also holds "
            "for the baseline 'baseline' (there: \"with config: model='Qwen/Qwen3-30B-A3B'") in result.stderr
