"""Backends: what turns a suite's requests into completions with per-token timestamps and
reports evidence of what ran. The bundled runtime in-process (`bundled`) and any
OpenAI-compatible server over HTTP (`openai`, optionally started from a profile file) are two
backends; the measurement loop drives both through one small interface:

    backend.configs                      the configurations to measure (baseline first)
    with backend.session(cfg) as engine: an engine ready to run one configuration
        engine.generate(requests, on_complete) -> a result with completions, steps, evidence,
                                                  activation_errors, wall_s
    backend.describe()                   what the manifest records about the engine
    backend.close()                      stop whatever the backend started

Modules import their heavy dependencies lazily so that `moebench --help` stays quick.
"""
