"""Recorded server output: what a server printed and answered for each configuration of a profile,
kept as files so that a profile's evidence can be judged without the server (its GPU, its
checkpoint), by `moebench profiles check` and by the tests.

A folder holds, per configuration name:
    <name>.log              the server's log; lines starting with "#@" are notes (the engine version,
                            the source file and line each line's format string comes from) and
                            are dropped
    <name>.endpoints.json   optional: {"start": {path: body}, "end": {path: body}}, a JSON body as
                            JSON, a Prometheus body as a string
`<config>.<what>.log` (with its optional `.endpoints.json`) holds output that must NOT prove that
configuration (`cuda-graphs.capture-skipped.log`: eager off, yet no graph captured); `moebench
profiles check` requires that the configuration's evidence refuses it.
"""

from __future__ import annotations

import json
from pathlib import Path

from moebench.backends.evidence import Observation
from moebench.errors import MoebenchError

NOTE = "#@"


def read_log(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines(keepends=True)
    return "".join(line for line in lines if not line.startswith(NOTE))


def load_observation(folder: Path, label: str) -> Observation | None:
    """The recorded observation `label` in `folder`, or None where there is no `<label>.log`."""
    log = folder / f"{label}.log"
    if not log.is_file():
        return None
    obs = Observation(read_log(log), source=str(log))
    endpoints = folder / f"{label}.endpoints.json"
    if endpoints.is_file():
        try:
            raw = json.loads(endpoints.read_text())
        except json.JSONDecodeError as e:
            raise MoebenchError(f"{endpoints}: not valid JSON ({e})") from None
        if not isinstance(raw, dict) or not all(isinstance(raw.get(w, {}), dict) for w in ("start", "end")):
            raise MoebenchError(f'{endpoints}: expected {{"start": {{path: body}}, "end": {{path: body}}}}')
        obs.payloads = {"start": dict(raw.get("start", {})), "end": dict(raw.get("end", {}))}
        obs.source = f"{log} and {endpoints.name}"
    return obs


def recorded_folder(folder: Path | None) -> Path:
    if folder is None:
        raise MoebenchError("no recorded server output to check against: give --recorded DIR (a folder of "
                            "<config>.log and <config>.endpoints.json), or name one in the profile's "
                            "[checked] recorded = '...'")
    if not folder.is_dir():
        raise MoebenchError(f"{folder}: no such folder of recorded server output")
    return folder
