"""Shared pytest fixtures."""

import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Every test module runs with one torch thread, whatever an earlier module left set: two
    OpenMP threads on a busy two-core machine wait on each other at every barrier (tens of times
    slower on these tiny shapes), and one thread changes no result."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer():
    """The bundled model's tokenizer (a module that needs another defines its own)."""
    from moebench.engine.loader import load_tokenizer
    from moebench.models.bundled import bundled_model_path

    return load_tokenizer(bundled_model_path())


@pytest.fixture(scope="module")
def checkpoints():
    """The bundled model loaded as `moebench run` loads it, one load per expert budget."""
    from moebench.measuring.run import _load_model
    from moebench.models.bundled import bundled_model_path

    cache = {}

    def get(runtime):
        if runtime.expert_budget not in cache:
            cache[runtime.expert_budget] = _load_model(bundled_model_path(), runtime)[0]
        return cache[runtime.expert_budget]
    return get


@pytest.fixture
def gsm8k_dir() -> Path:
    """The offline GSM8K copy (test.jsonl, train.jsonl) next to the repository."""
    path = (REPO / ".." / "shared" / "data" / "gsm8k").resolve()
    if not (path / "test.jsonl").is_file():
        pytest.skip(f"offline GSM8K data not found at {path}")
    return path


@pytest.fixture(scope="module")
def llama_server(request) -> Path:
    """llama.cpp's llama-server for this CPU (built and cached on first use). Where it cannot be
    built, CI fails and elsewhere the test is skipped with a warning that names what went untested."""
    from moebench.backends.llamacpp import llama_server_path
    from moebench.errors import MoebenchError

    try:
        try:
            return llama_server_path(build=False)
        except MoebenchError:  # not built for this CPU yet: the first test run builds it, for minutes
            with _uncaptured(request.config):
                return _announced_build(request, llama_server_path)
    except MoebenchError as e:
        if os.environ.get("CI"):
            pytest.fail(f"llama-server could not be built in CI: {e}")
        message = f"LLAMA.CPP TESTS NOT RUN ({request.module.__name__}): llama-server could not be built here: {e}"
        warnings.warn(message)
        pytest.skip(message)


@contextmanager
def _uncaptured(config):
    """Output straight to the terminal: pytest holds a fixture's output back until a test fails,
    so a build of many minutes would otherwise look like a hung progress bar."""
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is None:
        yield
        return
    with capture.global_and_fixture_disabled():
        yield


def _announced_build(request, build):
    from moebench.backends.llamacpp import BUILD_ESTIMATE, build_dir

    users = sorted({item.module.__name__ for item in request.session.items
                    if "llama_server" in getattr(item, "fixturenames", ())})
    print(f"\nmoebench tests: llama.cpp's llama-server is not built for this CPU yet; building it now, once "
          f"({BUILD_ESTIMATE}), because the tests in {', '.join(users) or request.module.__name__} drive it for real; "
          f"cached in {build_dir()}, so later test runs skip this", file=sys.stderr, flush=True)
    return build()


def pytest_configure(config):
    # The tests run tiny models: one thread avoids OpenMP hand-off stalls on a busy 2-core machine.
    import torch

    torch.set_num_threads(1)
