"""The bundled MoE runtime: load a checkpoint, batch requests, decode greedily, record every step."""

from moebench.engine.config import ModelConfig, RuntimeConfig
from moebench.engine.loader import load_checkpoint
from moebench.engine.llm_engine import Completion, Engine, Request, StepRecord

__all__ = ["ModelConfig", "RuntimeConfig", "load_checkpoint", "Engine", "Request", "Completion", "StepRecord"]
