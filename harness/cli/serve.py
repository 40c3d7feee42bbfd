"""`moebench serve`: its options, checked before the model loads; the server itself is moebench.serve.app."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from moebench.cli.options import (ADMISSION, BATCH_SIZE, DEVICE, EXPERT_BUDGET, KERNEL, OFFLOAD_TIER, PREFETCH, SCHEDULER,
                                  TEMPERATURE, THREADS, TOP_K, TOP_P, WEIGHTS)
from moebench.errors import MoebenchError


def serve_command(
    model: Optional[Path] = typer.Option(None, "--model", help="Checkpoint directory (config.json, *.safetensors, tokenizer.json). Default: the bundled gsm-synth MoE."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (loopback unless you say otherwise)."),
    port: int = typer.Option(8000, "--port", help="TCP port; 0 picks a free one (printed on stdout)."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", help="The model id clients send (default: 'bundled' for the bundled model, else the directory name)."),
    kernel: str = KERNEL,
    scheduler: str = SCHEDULER,
    prefetch: str = PREFETCH,
    batch_size: int = BATCH_SIZE,
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="max_tokens of a request that gives none (capped by the context left)."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Prompt plus max_tokens limit per request (default: the model's max_position_embeddings)."),
    max_queue: int = typer.Option(256, "--max-queue", help="Requests the server holds at once (running and waiting); more get HTTP 429."),
    batch_window_ms: Optional[float] = typer.Option(None, "--batch-window-ms", help="After an idle spell, wait this long for a batch to fill before the first step (default: 10 with --scheduler static, 0 with continuous)."),
    expert_budget: Optional[str] = EXPERT_BUDGET,
    offload_tier: str = OFFLOAD_TIER,
    admission: str = ADMISSION,
    device: str = DEVICE,
    threads: Optional[int] = THREADS,
    log_requests: bool = typer.Option(False, "--log-requests", help="Log one line per request on stderr."),
    temperature: float = TEMPERATURE,
    top_p: Optional[float] = TOP_P,
    top_k: Optional[int] = TOP_K,
    weights: str = WEIGHTS,
):
    """Serve the runtime behind an OpenAI-compatible HTTP API (completions, chat, streaming)."""
    import socket

    from moebench.engine import RuntimeConfig
    from moebench.engine.sampling import check_sampling_options
    from moebench.measuring.run import _parse_budget, bundled_model_path
    from moebench.serve.app import build_app
    from moebench.serve.client import EngineClient
    from moebench.serve.core import CoreOptions
    from moebench.serve.protocol import RequestParser, load_chat_template

    if not 0 <= port <= 65535:
        raise MoebenchError(f"--port must be in 0..65535, got {port}")
    check_sampling_options(temperature, top_p, top_k)
    if max_queue < 1:
        raise MoebenchError(f"--max-queue must be >= 1, got {max_queue}")
    if threads is not None and threads < 0:
        raise MoebenchError(f"--threads must be >= 0, got {threads}")
    if batch_window_ms is not None and batch_window_ms < 0:
        raise MoebenchError(f"--batch-window-ms must be >= 0, got {batch_window_ms}")
    try:  # before the model loads: a port in use is a quick one-line error
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise MoebenchError(f"cannot listen on {host}:{port} ({e.strerror})") from None
    bound = sock.getsockname()[1]
    from moebench.engine.store.factory import resolve_tier

    from moebench.engine.overrides import Overrides

    runtime = RuntimeConfig(kernel=kernel, scheduler=scheduler, prefetch=prefetch, device=device,
                            batch_size=batch_size, max_new_tokens=max_new_tokens, admission=admission,
                            expert_budget=_parse_budget(expert_budget or "1.0"),
                            offload_tier=resolve_tier(offload_tier, device), weights=weights,
                            overrides=Overrides.from_environment(os.environ))  # read once, here
    from moebench.engine.weight_evidence import activations_refusal

    refusal = activations_refusal(runtime.overrides.activations, [runtime])
    if refusal:
        raise MoebenchError(refusal)
    if threads is None and device == "cpu":
        threads = 1
    if max_model_len is not None and max_model_len < 2:
        raise MoebenchError(f"--max-model-len must be >= 2, got {max_model_len}")
    model_path = Path(model or bundled_model_path())
    if not (model_path / "config.json").is_file():
        raise MoebenchError(f"{model_path}: not a checkpoint directory (no config.json)")
    window = (10.0 if scheduler == "static" else 0.0) if batch_window_ms is None else batch_window_ms
    options = CoreOptions(str(model_path), runtime, max_model_len, max_queue, window / 1000, threads)
    serving = EngineClient(options, model_path, close_fds=(sock.fileno(),))
    served = served_model_name or ("bundled" if model is None else model_path.resolve().name)
    from moebench.engine.sampling import SamplingParams

    # the defaults of requests that leave them out (seed: per request, or drawn by the server)
    defaults = SamplingParams(temperature, 1.0 if top_p is None else top_p, top_k)
    parser = RequestParser(serving.tokenizer, serving.vocab_size, served, serving.max_model_len, max_new_tokens,
                           load_chat_template(model_path), defaults)
    app = build_app(serving, parser, served, log_requests)

    import uvicorn

    print(f"moebench serve: model '{served}' ({model_path}), switches {runtime.switches()}, "
          f"engine process {serving.proc.pid}, listening on http://{host}:{bound}", flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    serving.on_failure = lambda: setattr(server, "should_exit", True)  # a dead engine must not look alive
    try:
        server.run(sockets=[sock])
    finally:
        serving.stop()
    if serving.failed is not None:
        raise MoebenchError(f"engine failed: {serving.failed}")
