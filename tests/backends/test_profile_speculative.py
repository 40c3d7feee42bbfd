"""External engines' speculative configurations (issue 32): their evidence must tell "speculation
ran and drafts were accepted" from "the flag was accepted and nothing happened". Judged on the
recorded output in tests/fixtures/engine_logs: vLLM 0.34.0 and SGLang 0.5.23 written from their
format strings (not run: no GPU here), llama.cpp recorded from a real llama-server."""

from __future__ import annotations

from pathlib import Path

import pytest

from moebench.backends.discrimination import judge
from moebench.backends.evidence import evaluate
from moebench.backends.profiles import load_profiles
from moebench.backends.recorded import load_observation
from moebench.cli.profiles import check_profile
from repo_paths import FIXTURES, REPO

LOGS = FIXTURES / "engine_logs"
VLLM = REPO / "profiles" / "vllm-speculative-gpu.toml"
SGLANG = REPO / "profiles" / "sglang-ling3-dgx-spark.toml"


def _errors(profile, obs) -> list[str]:
    return [e for when in ("start", "end") for e in evaluate(profile.evidence, when, obs)[1]]


def _profile(path: Path, name: str):
    return next(p for p in load_profiles(path).profiles if p.name == name)


def test_vllm_ngram_configured_but_never_drafting_is_refused_by_every_counter():
    """The flag was accepted (the engine-config line names the ngram config), but no step drafted:
    the SpecDecoding line is absent and the counters read 0. Each of those items alone refuses it."""
    ngram = _profile(VLLM, "ngram")
    no_op = load_observation(LOGS / "vllm-0.34.0-speculative", "ngram.no-drafts")
    errors = _errors(ngram, no_op)
    assert any("no match for 'SpecDecoding metrics" in e for e in errors)
    assert any("vllm:spec_decode_num_draft_tokens_total is 0.0, expected at_least 1" in e for e in errors)
    assert any("vllm:spec_decode_num_accepted_tokens_total is 0.0, expected at_least 1" in e for e in errors)
    # the config line holds on the no-op: it proves the flag was parsed, nothing more
    assert not any("speculative_config=SpeculativeConfig" in e for e in errors)


def test_vllm_mtp_drafting_with_nothing_accepted_is_refused():
    mtp = _profile(VLLM, "mtp")
    rejected = load_observation(LOGS / "vllm-0.34.0-speculative", "mtp.none-accepted")
    errors = _errors(mtp, rejected)
    assert any("vllm:spec_decode_num_accepted_tokens_total is 0.0" in e for e in errors)
    assert not any("spec_decode_num_draft_tokens_total" in e for e in errors)  # it did draft
    assert any("no match for 'SpecDecoding metrics" in e for e in errors)  # "Accepted: 0 tokens" is not enough


def test_evidence_resting_on_the_flag_alone_is_caught_by_profiles_check(tmp_path):
    """A profile that proves ngram only by vLLM's config line passes discrimination against the
    baseline, yet accepts the output where nothing was drafted: `profiles check` fails it."""
    text = VLLM.read_text()
    start = text.index('[[profile]]\nname = "ngram"')
    end = text.index("# MTP:")
    weak = ('[[profile]]\nname = "ngram"\nargs = ["--speculative-config", \'{"method": "ngram"}\']\n'
            "[profile.evidence]\n"
            "log_must = [\"with config: .*speculative_config=SpeculativeConfig\\\\(method='ngram', \"]\n\n")
    path = tmp_path / "weak.toml"
    path.write_text((text[:start] + weak + text[end:]).replace('recorded = "../tests', f'recorded = "{REPO}/tests'))
    weak_ngram = _profile(path, "ngram")
    verdict = judge(weak_ngram, {"baseline": load_observation(LOGS / "vllm-0.34.0-speculative", "baseline")},
                    load_profiles(path).profiles, "baseline")
    assert not verdict.refused and verdict.echo_proved == ["ngram"]  # it discriminates, by echo alone
    problems = check_profile(path, echo=lambda _: None)
    assert any("profile 'ngram': 'ngram' is proved only by the server repeating its arguments" in p for p in problems)
    accepts = [p for p in problems if "profile 'ngram': its evidence accepts" in p]
    assert len(accepts) == 1 and accepts[0].endswith("ngram.no-drafts.log, output recorded as not proving it")


def test_vllm_speculative_items_all_fail_on_the_baseline():
    """Judged against the baseline alone every item proves speculative decoding; judged against
    the other method too, what tells n-gram from MTP drafts is the config line alone (echo), which
    the profile marks echo_only with its reason."""
    folder = LOGS / "vllm-0.34.0-speculative"
    pf = load_profiles(VLLM)
    for name in ("ngram", "mtp"):
        profile = _profile(VLLM, name)
        verdict = judge(profile, {"baseline": load_observation(folder, "baseline")}, pf.profiles, "baseline")
        assert verdict.ok is False and not verdict.shared and len(verdict.proving) == 4  # marked, yet all runtime
        every = {n: load_observation(folder, n) for n in ("baseline", "ngram", "mtp")}
        verdict = judge(profile, every, pf.profiles, "baseline")
        assert verdict.ok and verdict.echo_proved == [name] and profile.echo_only
        assert [i.kind for i in verdict.proofs[name]] == ["echo"]
        assert {i.kind for i in verdict.proofs["speculative-decoding"]} == {"runtime"}


def test_sglang_mtp_log_line_needs_a_nonzero_acceptance_rate():
    mtp = _profile(SGLANG, "moe-runner+mtp")
    pattern = next(p for p in mtp.evidence.log_must if "accept rate" in p)
    folder = LOGS / "sglang-0.5.23"
    errors = _errors(mtp, load_observation(folder, "moe-runner+mtp.no-drafts-accepted"))
    assert f"server log has no match for {pattern!r}" in "\n".join(errors)
    assert not _errors(mtp, load_observation(folder, "moe-runner+mtp"))
    import re

    for line, holds in (("accept len: 1.00, accept rate: 0.00, ", False), ("accept len: 1.01, accept rate: 0.01, ", True),
                        ("accept len: 2.00, accept rate: 1.00, ", True), ("accept len: 1.42, accept rate: 0.42, ", True)):
        assert bool(re.search(pattern, "Decode batch, #running-req: 4, " + line)) is holds, line


@pytest.mark.parametrize("path", [VLLM, SGLANG], ids=lambda p: p.name)
def test_speculative_profiles_say_they_were_not_run_here(path):
    assert "not run" in load_profiles(path).checked["engine"] or "not run here" in path.read_text()


def test_llamacpp_lookup_whose_window_never_matches_is_refused():
    """Recorded from a real llama-server: the type accepted, the slot speculative, no draft made."""
    lcpp = REPO / "profiles" / "llamacpp-speculative-cpu.toml"
    ngram = _profile(lcpp, "ngram")
    folder = LOGS / "llamacpp-0.3.36-speculative"
    no_op = load_observation(folder, "ngram.window-never-matches")
    errors = _errors(ngram, no_op)
    assert any("llamacpp:spec_decode_num_draft_tokens_total is 0.0, expected at_least 1" in e for e in errors)
    assert any("no match for 'draft acceptance" in e for e in errors)
    assert not any("0.speculative" in e for e in errors)  # /slots says speculative: the flag alone proves nothing
    assert not _errors(ngram, load_observation(folder, "ngram"))
