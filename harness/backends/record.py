"""Record what a profile's servers print and answer, one configuration at a time, into the files
`moebench profiles check` reads (moebench.backends.recorded): each configuration's server is
started as a run's warm-up starts it, asked every endpoint any configuration's evidence reads
(when healthy, and again after a few requests), and its log and the bodies are written out."""

from __future__ import annotations

import json
from pathlib import Path

from moebench.backends.discrimination import observed_paths
from moebench.backends.profiles import ProfileFile


def _body(text):
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def record_profiles(pf: ProfileFile, out: Path, placeholders, requests, options, tokenizer=None,
                    echo=print) -> list[Path]:
    """Write `<config>.log` and `<config>.endpoints.json` for every configuration into `out`."""
    from moebench.backends.openai import OpenAIEngine
    from moebench.backends.server import ServerProcess

    out.mkdir(parents=True, exist_ok=True)
    observe = observed_paths(pf.profiles)
    written = []
    served = pf.server.get("served_model")
    for profile in pf.profiles:
        log = out / f"{profile.name}.log"
        log.unlink(missing_ok=True)  # the server appends; a recording holds one start
        server = ServerProcess(profile, placeholders, log, pf.health, pf.startup_timeout_s)
        server.observe = observe
        try:
            server.start()
            start = server.evidence("start")
            result = OpenAIEngine(server.base_url, options, served, tokenizer, server, start).generate(requests)
        finally:
            server.stop()
        failed = result.failed_requests
        bodies = {when: {path: _body(text) for path, text in sorted(server.observed.payloads.get(when, {}).items())}
                  for when in ("start", "end")}
        endpoints = out / f"{profile.name}.endpoints.json"
        endpoints.write_text(json.dumps(bodies, indent=1) + "\n")
        status = "evidence holds" if not result.activation_errors else "; ".join(result.activation_errors)
        echo(f"{profile.name}: {len(requests) - failed}/{len(requests)} requests answered, {status} -> {log}")
        written += [log, endpoints]
    return written
