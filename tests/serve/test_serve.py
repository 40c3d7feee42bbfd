"""`moebench serve` for real: server processes on a free loopback port, driven over HTTP.

Greedy outputs must equal the in-process engine's on gsm-synth items, with requests sent
concurrently, under both schedulers; streaming follows the OpenAI/vLLM event format; bad
requests get a 4xx with an OpenAI-style JSON error body; the queue limit answers 429; a client
that goes away frees its slot. Every server is killed at the end and the test checks that its
process group is gone."""

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys

import httpx
import pytest
import torch

from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
from moebench.measuring.run import bundled_model_path
from moebench.serve.app import ServeProcess
from moebench.suites import load_suite

N_ITEMS = 24


def _gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def suite():
    return load_suite("gsm-synth", limit=N_ITEMS)



@pytest.fixture(scope="module")
def expected(suite, tokenizer):
    """The in-process engine's completions (static batching, naive kernel: the baseline)."""
    path = bundled_model_path()
    engine = Engine(load_checkpoint(path, dtype=torch.float32), tokenizer,
                    RuntimeConfig(kernel="naive", scheduler="static", batch_size=16, max_new_tokens=256))
    requests = [Request(item.id, suite.prompt(item), None, tuple(suite.stop)) for item in suite.items]
    return engine.generate(requests).completions


def _server(args):
    server = ServeProcess(args)
    server.__enter__()
    try:
        yield server
    finally:
        server.__exit__(None, None, None)
        assert server.proc.poll() is not None and _gone(server.proc.pid), "a server process was left behind"


@pytest.fixture(scope="module")
def static_server():
    yield from _server(["--scheduler", "static", "--batch-size", "8"])


@pytest.fixture(scope="module")
def continuous_server():
    yield from _server(["--scheduler", "continuous", "--batch-size", "4", "--kernel", "fused", "--max-queue", "64"])


async def _complete_all(url, prompts, stop, stream):
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(prompt):
            body = {"model": "bundled", "prompt": prompt, "max_tokens": 256, "stop": stop, "temperature": 0}
            if not stream:
                r = await client.post(url + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                return choice["text"], choice["finish_reason"], r.json()["usage"]["completion_tokens"]
            body.update(stream=True, stream_options={"include_usage": True})
            text, finish, usage = [], None, None
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        usage = chunk.get("usage") or usage
                        for c in chunk["choices"]:
                            text.append(c["text"])
                            finish = c["finish_reason"] or finish
            return "".join(text), finish, usage["completion_tokens"]

        return await asyncio.gather(*(one(p) for p in prompts))


@pytest.mark.parametrize("which", ["static_server", "continuous_server"])
def test_greedy_outputs_equal_the_in_process_engine_under_concurrent_requests(which, request, suite, tokenizer,
                                                                                expected):
    server = request.getfixturevalue(which)
    stop = list(suite.stop)
    # half the prompts as text, half as token ids; half streamed, half not
    prompts = [suite.prompt(item) if i % 2 else tokenizer.encode(suite.prompt(item)).ids
               for i, item in enumerate(suite.items)]
    half = N_ITEMS // 2

    async def both():
        return await asyncio.gather(_complete_all(server.url, prompts[:half], stop, stream=False),
                                    _complete_all(server.url, prompts[half:], stop, stream=True))

    plain, streamed = asyncio.run(both())
    got = plain + streamed
    assert [g[0] for g in got] == [c.text for c in expected]
    assert [g[1] for g in got] == [c.finish_reason for c in expected]
    assert [g[2] for g in got] == [len(c.output_ids) for c in expected]

    evidence = httpx.get(server.url + "/v1/moebench/evidence").json()
    assert evidence["activation_errors"] == []
    if which == "continuous_server":
        assert evidence["switches"] == {"kernel": "fused", "scheduler": "continuous", "prefetch": "off"}
        assert evidence["evidence"]["scheduler"]["admissions_mid_flight"] > 0
        assert sum(evidence["evidence"]["kernel"]["backends"].values()) > 0
    else:
        assert evidence["evidence"]["scheduler"]["batches"] >= N_ITEMS // 8
    metrics = httpx.get(server.url + "/metrics").text
    assert "moebench:stream_text_mismatch_total 0" in metrics
    assert "moebench:requests_in_server 0" in metrics


def _events(response) -> list[str]:
    lines = [line for line in response.text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [line[6:] for line in lines]


def test_streaming_format_usage_chunk_and_chat(static_server, suite):
    url = static_server.url
    prompt = suite.prompt(suite.items[0])
    body = {"prompt": prompt, "max_tokens": 40, "stop": list(suite.stop)}
    full = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    assert full["object"] == "text_completion" and full["model"] == "bundled"

    r = httpx.post(url + "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}},
                   timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["id"] == chunks[0]["id"] and c["object"] == "text_completion" for c in chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]
    content = chunks[:-1]
    assert len(content) > 1  # pieces as tokens are made, not one block at the end
    assert "".join(c["choices"][0]["text"] for c in content) == full["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in content][-1] == full["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])

    no_usage = _events(httpx.post(url + "/v1/completions", json={**body, "stream": True}, timeout=60))
    assert all("usage" not in json.loads(e) for e in no_usage[:-1])

    messages = [{"role": "user", "content": prompt}]
    chat = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 40,
                                                          "stop": list(suite.stop)}, timeout=60).json()
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": full["choices"][0]["text"]}
    events = _events(httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 40,
                                                                    "stop": list(suite.stop), "stream": True},
                                timeout=60))
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == full["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]


def test_a_list_of_prompts_gives_one_choice_each(static_server, suite):
    prompts = [suite.prompt(item) for item in suite.items[:3]]
    one_by_one = [httpx.post(static_server.url + "/v1/completions", json={"prompt": p, "max_tokens": 30},
                             timeout=60).json()["choices"][0]["text"] for p in prompts]
    r = httpx.post(static_server.url + "/v1/completions", json={"prompt": prompts, "max_tokens": 30}, timeout=60)
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["text"] for c in choices] == one_by_one


@pytest.mark.parametrize("body, status, code", [
    ({"prompt": "Question: 1\nAnswer:", "temperature": -0.5}, 400, "invalid_sampling"),
    ({"prompt": "Question: 1\nAnswer:", "temperature": 0.7, "top_p": 0}, 400, "invalid_sampling"),
    ({"prompt": "Question: 1\nAnswer:", "temperature": 0.7, "top_k": -3}, 400, "invalid_sampling"),
    ({"prompt": "Question: 1\nAnswer:", "temperature": 0.7, "seed": 1 << 70}, 400, "invalid_seed"),
    ({"prompt": "Question: 1\nAnswer:", "temperature": "hot"}, 400, "invalid_parameter"),
    ({"prompt": "Question: 1\nAnswer:", "n": 2}, 400, "unsupported_parameter"),
    ({"prompt": "Question: 1\nAnswer:", "logprobs": 1, "echo": True}, 400, "unsupported_parameter"),
    ({"prompt": "Question: 1\nAnswer:", "max_tokens": 0}, 400, "invalid_parameter"),
    ({"prompt": "Question: 1\nAnswer:", "max_tokens": "ten"}, 400, "invalid_parameter"),
    ({"prompt": "Question: 1\nAnswer:", "max_tokens": 10_000}, 400, "context_length_exceeded"),
    ({"prompt": [5] * 600}, 400, "context_length_exceeded"),
    ({"prompt": [1, 2, 100_000]}, 400, "invalid_prompt"),
    ({"prompt": ""}, 400, "invalid_prompt"),
    ({"prompt": 7}, 400, "invalid_prompt"),
    ({}, 400, "missing_prompt"),
    ({"prompt": "x", "stop": [""]}, 400, "invalid_stop"),
    ({"prompt": "x", "stream": "yes"}, 400, "invalid_parameter"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model_not_found"),
])
def test_bad_requests_get_a_4xx_with_a_json_error_body(static_server, body, status, code):
    r = httpx.post(static_server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]


def test_malformed_json_unknown_paths_and_bad_chat_messages(static_server):
    url = static_server.url
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.get(url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_messages"


def test_queue_limit_answers_429_and_a_client_that_leaves_frees_its_slot(continuous_server, suite):
    url = continuous_server.url
    r = httpx.post(url + "/v1/completions", json={"prompt": ["Question: 1\nAnswer:"] * 65, "max_tokens": 4})
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    assert 'moebench:requests_total{outcome="rejected"} 65' in httpx.get(url + "/metrics").text

    body = {"prompt": [7] * 8, "max_tokens": 400, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
        next(response.iter_lines())
    for _ in range(100):
        metrics = httpx.get(url + "/metrics").text
        if "moebench:requests_in_server 0" in metrics:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert "moebench:requests_in_server 0" in metrics
    # that prompt runs to its 400 tokens (seconds) when nobody leaves: it was taken out, not finished
    assert 'moebench:requests_total{outcome="aborted"} 1' in metrics, metrics


def test_a_port_in_use_is_a_one_line_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "moebench", "serve", "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "cannot listen on 127.0.0.1" in r.stderr


def test_streamed_pieces_add_up_to_the_final_text_and_never_show_a_stop_string():
    """TextStream against the engine's rule (the text up to the first stop string), on random
    texts over a small alphabet where stop strings and their prefixes come up all the time."""
    import random

    from moebench.serve.app import TextStream

    class CharTokenizer:  # one character per token id
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    rng = random.Random(0)
    for _ in range(2000):
        stops = tuple("".join(rng.choice("ab:Q") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3)))
        ids = [ord(rng.choice("ab:Qx")) for _ in range(rng.randint(1, 30))]
        stream, shown = TextStream(CharTokenizer(), stops), ""
        for n in range(1, len(ids) + 1):
            text = "".join(map(chr, ids[:n]))
            cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
            if cut >= 0:
                text = text[:cut]
                break
            shown += stream.advance(ids[:n])
            assert not any(s in shown for s in stops) and text.startswith(shown)
        rest, ok = stream.finish(text)
        assert ok and shown + rest == text


ENGINE_FAILS_AFTER_20_STEPS = """
import sys
from moebench.engine import llm_engine
step, steps = llm_engine.EngineSession.step, [0]
def failing_step(self, *args, **kwargs):
    steps[0] += 1
    if steps[0] > 20:
        raise RuntimeError("injected engine failure")
    return step(self, *args, **kwargs)
llm_engine.EngineSession.step = failing_step
sys.argv = ["moebench", "serve", "--port", "0"]
from moebench.cli.app import main
main()
"""


@contextlib.contextmanager
def _server_that_may_die(argv):
    """A server started by hand (not ServeProcess, whose exit this test wants to see), healthy on
    entry; killed with its process group on exit if still alive, and the group checked gone."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        url = None
        while url is None:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            if "listening on " in line:
                url = line.split("listening on ")[1].strip()
        for _ in range(300):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            asyncio.run(asyncio.sleep(0.1))
        yield proc, url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        assert _gone(proc.pid)


def test_an_engine_failure_reaches_the_client_and_ends_the_server():
    """The runtime raising mid-request (a real server whose engine is made to fail): the stream
    ends with an error event, and the server exits with status 2 instead of looking alive."""
    with _server_that_may_die([sys.executable, "-c", ENGINE_FAILS_AFTER_20_STEPS]) as (proc, url):
        r = httpx.post(url + "/v1/completions", json={"prompt": [7] * 8, "max_tokens": 100, "stream": True},
                       timeout=60)
        events = _events(r)
        assert json.loads(events[-2])["error"]["code"] == "engine_failed" and events[-1] == "[DONE]"
        assert proc.wait(timeout=30) == 2
        assert "moebench: error: engine failed: injected engine failure" in proc.stderr.read()


def test_a_killed_engine_process_fails_its_requests_and_ends_the_server():
    """The engine runs in a process of its own: killing it (as the OOM killer would) mid-stream
    gives the client an error event, and the front end exits with status 2 instead of looking alive."""
    with _server_that_may_die([sys.executable, "-m", "moebench", "serve", "--port", "0"]) as (proc, url):
        engine_pid = httpx.get(url + "/v1/moebench/evidence").json()["runtime"]["engine_process"]
        assert engine_pid != proc.pid and os.getpgid(engine_pid) == proc.pid
        body = {"prompt": [7] * 8, "max_tokens": 400, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(lines)
            os.kill(engine_pid, 9)
            events = [x[len("data: "):] for x in lines if x.startswith("data: ")]
        assert json.loads(events[-2])["error"]["code"] == "engine_failed" and events[-1] == "[DONE]"
        assert proc.wait(timeout=30) == 2
        assert "engine process died" in proc.stderr.read()
