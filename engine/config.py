"""Model configuration (parsed from a checkpoint's config.json) and runtime configuration (the switches)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moebench.engine.overrides import Overrides
from moebench.errors import MoebenchError


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qk_norm: bool
    attention_bias: bool
    sliding_window: int | None
    dense_layers: tuple[int, ...] = ()
    dense_intermediate_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 32768

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    @property
    def expert_param_count(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    def to_dict(self) -> dict:
        return asdict(self)


def _require(raw: dict, key: str, path: Path):
    if key not in raw:
        raise MoebenchError(f"{path}: missing field '{key}'")
    return raw[key]


def _rope_theta(raw: dict) -> float:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise MoebenchError(f"config.json: rope type '{rope_type}' is not supported (only default RoPE)")
    return float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))


def read_config_json(path: Path) -> dict:
    """`config.json` as a dict; a missing or malformed file is a one-line error naming it."""
    if not Path(path).parent.is_dir():
        raise MoebenchError(f"{Path(path).parent}: not a directory (expected a checkpoint with config.json and "
                            "*.safetensors)")
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise MoebenchError(f"{path}: no such file (a checkpoint directory needs config.json)") from None
    except json.JSONDecodeError as e:
        raise MoebenchError(f"{path}: malformed JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(raw, dict):
        raise MoebenchError(f"{path}: expected a JSON object")
    return raw


def parse_transformer_config(raw: dict, path: Path) -> ModelConfig:
    """A Qwen3-MoE or Mixtral `config.json` (engine/families.py picks the parser by model_type); a
    missing field is a one-line error naming the file."""
    family = raw.get("model_type")
    hidden = int(_require(raw, "hidden_size", path))
    heads = int(_require(raw, "num_attention_heads", path))
    num_layers = int(_require(raw, "num_hidden_layers", path))
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    common = dict(
        family=family,
        vocab_size=int(_require(raw, "vocab_size", path)),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        top_k=int(_require(raw, "num_experts_per_tok", path)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        eos_token_ids=eos_ids,
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
    )
    num_experts = raw.get("num_experts", raw.get("num_local_experts"))
    if num_experts is None:
        raise MoebenchError(f"{path}: missing field 'num_experts'")
    if family == "qwen3_moe":
        sparse_step = int(raw.get("decoder_sparse_step", 1))
        mlp_only = set(raw.get("mlp_only_layers") or [])
        dense = tuple(
            i for i in range(num_layers) if i in mlp_only or not (int(num_experts) > 0 and (i + 1) % sparse_step == 0)
        )
        use_window = raw.get("use_sliding_window", False)
        return ModelConfig(
            **common,
            num_experts=int(num_experts),
            moe_intermediate_size=int(_require(raw, "moe_intermediate_size", path)),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            qk_norm=True,
            sliding_window=raw.get("sliding_window") if use_window else None,
            dense_layers=dense,
            dense_intermediate_size=int(raw.get("intermediate_size", 0)),
        )
    return ModelConfig(  # mixtral
        **common,
        num_experts=int(num_experts),
        moe_intermediate_size=int(_require(raw, "intermediate_size", path)),
        norm_topk_prob=True,
        qk_norm=False,
        sliding_window=raw.get("sliding_window"),
    )


# --expert-budget sizes: longest units first (GIB before GB)
BUDGET_UNITS = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3}
BUDGET_FORMS = "a fraction such as 0.5 or a size such as 8GB (GB, MB, KB, GiB, MiB, KiB)"


def parse_budget(text) -> float | str:
    """--expert-budget, the one parser of it (the ablation matrix, serve, lm-eval and the store
    factory read budgets through it): a fraction in (0, 1], or a size kept as its text (8GB)."""
    text = str(text).strip()
    try:
        value = float(text)
    except ValueError:
        budget_bytes(text)  # a size: its unit and number checked here, once
        return text
    if not 0 < value <= 1:
        raise MoebenchError(f"--expert-budget: a fraction must be in (0, 1], got {value}")
    return value


def budget_bytes(text: str) -> float:
    """The bytes of a size budget (parse_budget's text form)."""
    t = str(text).strip().upper().replace(" ", "")
    for unit, scale in BUDGET_UNITS.items():
        if t.endswith(unit):
            try:
                return float(t[: -len(unit)]) * scale
            except ValueError:
                break
    raise MoebenchError(f"--expert-budget: expected {BUDGET_FORMS}, got '{text}'")


KERNELS = ("naive", "fused")
SCHEDULERS = ("static", "continuous")
PREFETCHERS = ("off", "lookahead")
DECODE_PATHS = ("auto", "native", "chained", "eager")  # engine/decode_path.py CHOICES
LM_HEADS = ("f32", "bf16", "int8", "fp8")  # the LM head's weight precision (engine/quantize.py); approximate
# the other streamed weights' precision (--weights; engine/quantize.py: weights_in); int8 and int4 are approximate
WEIGHT_PRECISIONS = ("f32", "int8", "int4")


@dataclass(frozen=True)
class StoreTuning:
    """The expert store's and the lookahead prefetcher's developer settings: benchmarks and tests vary
    them, no command exposes them (docs/prefetch.md has the measurements behind each default)."""

    readers: int = 3  # disk tier: parallel readers (and load workers)
    host_workers: int = 1  # host tier: copy workers
    loader_cpus: str = "auto"  # cores of the native loader threads: auto, any, or a list such as "1,2"
    loader_spin_us: int = 2000  # an idle native loader thread spins this long before it sleeps
    lookahead_early: bool = True  # also guess each layer's experts from the previous layer's MoE input
    lookahead_governor: bool = True  # stop guessing for a while where guesses cost more than they save
    lookahead_window: int = 48  # plans the governor weighs at a time
    lookahead_keep: int = 8
    lookahead_extra: int = 1  # experts guessed beyond top-k per token


@dataclass(frozen=True)
class RuntimeConfig:
    """One point of the ablation matrix plus the settings every config shares."""

    kernel: str = "naive"
    scheduler: str = "static"
    prefetch: str = "off"
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    batch_size: int = 16
    max_new_tokens: int = 256
    max_tokens_per_step: int = 4096
    kv_block_size: int = 16
    admission: str = "affinity"
    expert_budget: float | str = 1.0
    offload_tier: str = "host"
    # native | chained | eager | auto: how a decode step runs its ops (engine/decode_path.py), an
    # axis of its own that no switch above changes
    decode_path: str = "auto"
    # speculative decoding (engine/speculative.py): off | ngram, drafts per verify step, and the
    # batch size above which a step runs without drafts (None: any)
    speculative: str = "off"
    spec_tokens: int = 4
    spec_max_batch: int | None = None
    lm_head: str = "f32"  # f32: the checkpoint's own head; bf16, int8, fp8 change answers (approximate)
    # the precision of the matrices a decode step streams besides the LM head: f32 the checkpoint's
    # own, int8 per output row (engine/quantize.py: weights_in; approximate, docs/int8.md)
    weights: str = "f32"
    store: StoreTuning = field(default_factory=StoreTuning)
    # how single ops run where a measurement or a machine asks for another implementation
    # (engine/overrides.py): read once at a command's entry, recorded in the manifest
    overrides: Overrides = field(default_factory=Overrides)

    def __post_init__(self):
        for name, value, allowed in (
            ("kernel", self.kernel, KERNELS),
            ("scheduler", self.scheduler, SCHEDULERS),
            ("prefetch", self.prefetch, PREFETCHERS),
            ("decode path", self.decode_path, DECODE_PATHS),
            ("LM head precision", self.lm_head, LM_HEADS),
            ("weight precision", self.weights, WEIGHT_PRECISIONS),
        ):
            if value not in allowed:
                raise MoebenchError(f"unknown {name} '{value}' (choose from: {', '.join(allowed)})")
        from moebench.engine.speculative import check_spec

        check_spec(self.speculative, self.spec_tokens, self.spec_max_batch)
        if self.device not in ("cpu", "cuda"):
            raise MoebenchError(f"unknown device '{self.device}' (choose cpu or cuda)")
        if self.weights != "f32" and self.device != "cpu":
            raise MoebenchError(f"--weights {self.weights} runs on the CPU kernels only (not {self.device})")
        if self.batch_size < 1:
            raise MoebenchError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.max_new_tokens < 1:
            raise MoebenchError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def torch_dtype(self):
        import torch

        if self.dtype is not None:
            return getattr(torch, self.dtype)
        return torch.bfloat16 if self.device == "cuda" else torch.float32

    def switches(self) -> dict:
        return {"kernel": self.kernel, "scheduler": self.scheduler, "prefetch": self.prefetch}
