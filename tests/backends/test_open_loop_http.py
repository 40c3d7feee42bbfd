"""The OpenAI client (moebench.backends.openai) in open loop against a real server process: the
synthetic server of tests/fixtures/synthetic_server.py, whose timings are known and which records
what it received. Only properties that hold however loaded the machine is are checked here; how
punctual and how accurate the client is, benchmarks/client_accuracy.py measures."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from moebench.backends.openai import ClientOptions, OpenAIEngine
from moebench.engine.sequence import Request
from repo_paths import FIXTURES

SERVER = FIXTURES / "synthetic_server.py"
TTFT, INTERVAL = 0.05, 0.005


@pytest.fixture(scope="module")
def server():
    proc = subprocess.Popen([sys.executable, str(SERVER), "--port", "0", "--ttft", str(TTFT),
                             "--token-interval", str(INTERVAL)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("listening http://"), f"the synthetic server did not start: {line!r}"
        yield line.split(" ", 1)[1]
    finally:
        proc.terminate()
        proc.wait(10)


def _records(url: str) -> dict:
    return httpx.get(url + "/synthetic/requests", timeout=30).json()


def _generate(url: str, requests, concurrency: int, arrivals=None):
    httpx.post(url + "/synthetic/reset", timeout=30)
    engine = OpenAIEngine(url, ClientOptions(concurrency=concurrency), served_model="synthetic")
    return engine.generate(requests, arrivals=arrivals), _records(url)


def _check_streams(completions, tokens: int) -> None:
    for c in completions:
        assert c.error is None, c.error
        assert c.output_tokens == tokens and len(c.token_times) == tokens
        assert c.text == "".join(f" t{k}" for k in range(tokens))
        assert c.finish_reason == "length"
        # the server never writes a token before its deadline, counted from when it read the request
        assert c.ttft_s >= TTFT
        assert c.latency_s >= TTFT + (tokens - 1) * INTERVAL


def test_open_loop_sends_every_request_on_schedule(server):
    arrivals = [0.0, 0.0, 0.02, 0.05, 0.05, 0.05, 0.1, 0.18, 0.2, 0.3]
    requests = [Request(f"r{i}", f"r{i}", 6) for i in range(len(arrivals))]
    result, seen = _generate(server, requests, concurrency=1, arrivals=arrivals)

    assert [c.id for c in result.completions] == [r.id for r in requests]
    assert sorted(r["prompt"] for r in seen["requests"]) == sorted(r.id for r in requests)
    _check_streams(result.completions, 6)
    assert [c.scheduled_s for c in result.completions] == arrivals
    for c in result.completions:
        assert c.sent_s >= c.scheduled_s - 1e-3
        assert c.attempts == 1
    sent = [c.sent_s for c in result.completions]
    assert sent == sorted(sent), "requests went out in another order than their schedule"


def test_open_loop_is_not_gated_by_concurrency(server):
    # eight requests due at once, each streaming for over 0.1 s: with concurrency 1 a closed loop
    # would hold seven back; the open loop sends them all
    requests = [Request(f"burst{i}", f"burst{i}", 20) for i in range(8)]
    result, seen = _generate(server, requests, concurrency=1, arrivals=[0.0] * 8)

    _check_streams(result.completions, 20)
    assert seen["max_in_flight"] > 1
    latest_send = max(c.sent_s for c in result.completions)
    first_done = min(c.sent_s + c.latency_s for c in result.completions)
    assert latest_send < first_done, "a request was sent only after another had finished"


def test_closed_loop_unchanged(server):
    requests = [Request(f"c{i}", f"c{i}", 5) for i in range(6)]
    result, seen = _generate(server, requests, concurrency=2)

    assert [c.id for c in result.completions] == [r.id for r in requests]
    _check_streams(result.completions, 5)
    assert all(c.scheduled_s is None for c in result.completions)
    assert all(c.sent_s is not None and c.sent_s >= 0 for c in result.completions)
    assert seen["max_in_flight"] <= 2
    assert len(seen["requests"]) == 6


def test_arrivals_must_fit_the_requests():
    engine = OpenAIEngine("http://127.0.0.1:9", ClientOptions(), served_model="synthetic")
    requests = [Request("a", "a", 2), Request("b", "b", 2)]
    with pytest.raises(ValueError, match="2 requests"):
        engine.generate(requests, arrivals=[0.0])
    with pytest.raises(ValueError, match="non-decreasing"):
        engine.generate(requests, arrivals=[0.5, 0.1])
