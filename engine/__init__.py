"""The bundled MoE runtime: load a checkpoint, batch requests, decode (greedy or sampled), record every step."""

# The names below resolve on first use (PEP 562): `moebench.engine.config` (the switch names)
# then imports without torch, which keeps the CLI's --help and usage errors instant.
_EXPORTS = {
    "ModelConfig": "config", "RuntimeConfig": "config", "load_checkpoint": "families",
    "Engine": "llm_engine", "Request": "llm_engine", "Completion": "llm_engine", "StepRecord": "llm_engine",
}

__all__ = ["ModelConfig", "RuntimeConfig", "load_checkpoint", "Engine", "Request", "Completion", "StepRecord"]


def __getattr__(name: str):
    import importlib

    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
