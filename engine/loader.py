"""Load a Hugging Face MoE checkpoint directory (safetensors only) into the engine's weight layout.

Experts are stacked per layer as w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], the
layout every MoE kernel in `moebench.kernels` takes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from moebench.engine.config import ModelConfig
from moebench.engine import memory
from moebench.engine.memory import to_huge_pages
from moebench.errors import MoebenchError


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    router: torch.Tensor | None = None  # [E, H]
    w13: torch.Tensor | None = None  # [E, 2I, H]
    w2: torch.Tensor | None = None  # [E, H, I]
    dense_w13: torch.Tensor | None = None  # [2I, H] for non-MoE layers
    dense_w2: torch.Tensor | None = None
    # q, k and v projections stacked: one matmul instead of three (q_proj etc. are views into it)
    qkv_proj: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None

    def stack_qkv(self) -> None:
        sizes = [self.q_proj.shape[0], self.k_proj.shape[0], self.v_proj.shape[0]]
        self.qkv_proj = to_huge_pages(torch.cat([self.q_proj, self.k_proj, self.v_proj]))
        self.q_proj, self.k_proj, self.v_proj = self.qkv_proj.split(sizes)
        if self.q_bias is not None:
            self.qkv_bias = torch.cat([self.q_bias, self.k_bias, self.v_bias])
            self.q_bias, self.k_bias, self.v_bias = self.qkv_bias.split(sizes)


@dataclass
class Checkpoint:
    path: Path
    config: ModelConfig
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    layers: list[LayerWeights]
    checkpoint_dtype: torch.dtype
    files: list[Path] = field(default_factory=list)
    # where each expert's tensors live on disk: (layer, expert) -> [(file, tensor name), ...]
    expert_sources: dict = field(default_factory=dict)
    # the dtype the attention projections, the dense MLPs and an untied LM head are held in: the
    # file's bfloat16 where the CPU kernels stream it (keeps_dense_in_checkpoint_dtype), else the
    # compute dtype. Embeddings, norms, biases and routers are always in the compute dtype.
    dense_dtype: torch.dtype = torch.float32
    # the multi-token-prediction head (engine/mtp.py), read the first time --speculative mtp asks
    mtp_weights: object = None

    @property
    def num_params(self) -> int:
        total = self.embed.numel() + self.final_norm.numel()
        if self.lm_head.data_ptr() != self.embed.data_ptr():
            total += self.lm_head.numel()
        for layer in self.layers:
            for name, value in vars(layer).items():
                if isinstance(value, torch.Tensor) and name not in ("qkv_proj", "qkv_bias"):  # q/k/v are views
                    total += value.numel()
            if layer.w13 is None and layer.router is not None:  # experts left in the files (disk tier)
                total += self.config.num_experts * self.config.expert_param_count
        return total


class TensorIndex:
    """Name -> file map over one file or a sharded `*.safetensors.index.json` set."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._handles: dict[Path, object] = {}
        index_files = sorted(directory.glob("*.safetensors.index.json"))
        if index_files:
            try:
                weight_map = json.loads(index_files[0].read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise MoebenchError(f"{index_files[0]}: malformed index file ({e})") from None
            self.name_to_file = {name: directory / fname for name, fname in weight_map.items()}
        else:
            files = sorted(directory.glob("*.safetensors"))
            if not files:
                raise MoebenchError(f"{directory}: no *.safetensors files (only safetensors checkpoints are loaded)")
            self.name_to_file = {}
            for f in files:
                for name in self._open(f).keys():
                    self.name_to_file[name] = f

    def _open(self, f: Path):
        if f not in self._handles:
            if not f.exists():
                raise MoebenchError(f"{f}: missing shard named by the checkpoint index")
            try:
                self._handles[f] = safe_open(str(f), framework="pt")
            except (SafetensorError, OSError) as e:
                raise MoebenchError(f"{f}: unreadable safetensors file ({e})") from None
        return self._handles[f]

    def __contains__(self, name: str) -> bool:
        return name in self.name_to_file

    def file_of(self, name: str):
        f = self.name_to_file.get(name)
        if f is None:
            raise MoebenchError(f"{self.directory}: missing tensor '{name}'")
        return f

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        f = self.file_of(name)
        handle = self._open(f)
        try:
            actual = tuple(handle.get_slice(name).get_shape())
            if actual != tuple(shape):
                raise MoebenchError(f"{f}: tensor '{name}' has shape {list(actual)}, expected {list(shape)}")
            return handle.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise MoebenchError(f"{f}: cannot read tensor '{name}' ({e}); the file may be truncated") from None

    def files(self) -> list[Path]:
        return sorted(set(self.name_to_file.values()))


def _expert_names(cfg: ModelConfig, layer: int, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) tensor names of one expert in the checkpoint's own naming."""
    if cfg.family == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
        return f"{p}.w1.weight", f"{p}.w3.weight", f"{p}.w2.weight"
    p = f"model.layers.{layer}.mlp.experts.{expert}"
    return f"{p}.gate_proj.weight", f"{p}.up_proj.weight", f"{p}.down_proj.weight"


def _router_name(cfg: ModelConfig, layer: int) -> str:
    block = "block_sparse_moe" if cfg.family == "mixtral" else "mlp"
    return f"model.layers.{layer}.{block}.gate.weight"


def keeps_dense_in_checkpoint_dtype(stored: torch.dtype, device: str, dtype: torch.dtype, overrides=None) -> bool:
    """Whether a checkpoint's dense matrices (attention projections, dense MLPs, an untied LM head)
    stay in the file's dtype: a bfloat16 checkpoint computed in float32 on the CPU, where the
    extension's dense kernel streams bfloat16 rows and widens them in registers. Widening is exact
    (every bfloat16 value is a float32 value), so the results are those of the float32 copy while a
    decode step reads half the bytes. Elsewhere (no extension, the dense override, CUDA) a bfloat16
    matrix would be widened on every call: it is widened once, at load. The dense_weights override
    (engine/overrides.py) widens at load anyway (for A/B measurements)."""
    from moebench.engine.overrides import DEFAULT

    overrides = overrides or DEFAULT
    if not (device == "cpu" and dtype == torch.float32 and stored == torch.bfloat16):
        return False
    if overrides.dense_weights == "float32" or overrides.dense != "kernel":
        return False
    from moebench.kernels.cpu_dense import dense_kernel_enabled

    return dense_kernel_enabled()


def load_transformer_checkpoint(directory: Path, cfg: ModelConfig, index: TensorIndex, device: str,
                                dtype: torch.dtype, experts_in_checkpoint_dtype: bool = False,
                                load_experts: bool = True, overrides=None) -> Checkpoint:
    """A Qwen3-MoE or Mixtral checkpoint (engine/families.py's load_checkpoint picks the loader by family).
    `experts_in_checkpoint_dtype`: keep routed experts on the CPU in the file's own dtype (the store
    holds them so, or converts only those it holds). `load_experts=False`: routed experts stored one
    tensor per expert stay in the files (w13/w2 None, their places in `expert_sources`): the disk
    tier reads them, and no copy of them is held. Dense matrices stay bfloat16 where
    `keeps_dense_in_checkpoint_dtype` says (Checkpoint.dense_dtype records it); routers do not: they
    are <1% of a step's bytes (128 x 1024 per layer against 12 MB of attention projections), and the
    prefetcher folds them with the norms into its float32 early-routing matrices (engine/store/prefetch.py)."""

    def get(name: str, *shape: int) -> torch.Tensor:
        return index.get(name, shape).to(device=device, dtype=dtype)

    H, hd, I = cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    embed_name = "model.embed_tokens.weight"
    checkpoint_dtype = index._open(index.name_to_file[embed_name]).get_slice(embed_name).get_dtype() if embed_name in index else "F32"
    stored = _SAFETENSORS_DTYPES.get(checkpoint_dtype, torch.float32)
    dense_dtype = stored if keeps_dense_in_checkpoint_dtype(stored, device, dtype, overrides) else dtype

    def matrix(name: str, *shape: int) -> torch.Tensor:
        """A dense matrix in `dense_dtype` (a tensor stored in another dtype is converted to it)."""
        return index.get(name, shape).to(device=device, dtype=dense_dtype)

    embed = get(embed_name, cfg.vocab_size, H)
    if cfg.tie_word_embeddings or "lm_head.weight" not in index:
        if not cfg.tie_word_embeddings:
            raise MoebenchError(f"{directory}: missing tensor 'lm_head.weight'")
        lm_head = embed  # float32, as the embedding rows the decode step copies (csrc/decode_layer.cpp)
    else:
        lm_head = matrix("lm_head.weight", cfg.vocab_size, H)

    layers = []
    expert_sources = {}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        attn = f"{p}.self_attn"
        layer = LayerWeights(
            input_norm=get(f"{p}.input_layernorm.weight", H),
            post_attention_norm=get(f"{p}.post_attention_layernorm.weight", H),
            q_proj=matrix(f"{attn}.q_proj.weight", q_out, H),
            k_proj=matrix(f"{attn}.k_proj.weight", kv_out, H),
            v_proj=matrix(f"{attn}.v_proj.weight", kv_out, H),
            o_proj=matrix(f"{attn}.o_proj.weight", H, q_out),
        )
        if cfg.attention_bias:
            layer.q_bias = get(f"{attn}.q_proj.bias", q_out)
            layer.k_bias = get(f"{attn}.k_proj.bias", kv_out)
            layer.v_bias = get(f"{attn}.v_proj.bias", kv_out)
        if cfg.qk_norm:
            layer.q_norm = get(f"{attn}.q_norm.weight", hd)
            layer.k_norm = get(f"{attn}.k_norm.weight", hd)
        if cfg.is_moe_layer(i):
            E = cfg.num_experts
            layer.router = get(_router_name(cfg, i), E, H)
            fused_gate_up = f"{p}.mlp.experts.gate_up_proj"
            if fused_gate_up in index:  # transformers' in-memory fused layout, if a checkpoint was saved that way
                layer.w13 = to_huge_pages(get(fused_gate_up, E, 2 * I, H))
                layer.w2 = to_huge_pages(get(f"{p}.mlp.experts.down_proj", E, H, I))
            else:
                raw = experts_in_checkpoint_dtype
                e_device, e_dtype = ("cpu", index.get(_expert_names(cfg, i, 0)[0], (I, H)).dtype) if raw else (device, dtype)
                expert = (lambda n, *shape: index.get(n, shape)) if raw else get
                layer.w13 = memory.empty((E, 2 * I, H), e_dtype, e_device) if load_experts else None
                layer.w2 = memory.empty((E, H, I), e_dtype, e_device) if load_experts else None
                for e in range(E):
                    gate, up, down = _expert_names(cfg, i, e)
                    expert_sources[(i, e)] = [(index.file_of(n), n) for n in (gate, up, down)]
                    if load_experts:
                        layer.w13[e, :I] = expert(gate, I, H)
                        layer.w13[e, I:] = expert(up, I, H)
                        layer.w2[e] = expert(down, H, I)
        else:
            D = cfg.dense_intermediate_size
            m = f"{p}.mlp"
            layer.dense_w13 = torch.cat([matrix(f"{m}.gate_proj.weight", D, H), matrix(f"{m}.up_proj.weight", D, H)])
            layer.dense_w2 = matrix(f"{m}.down_proj.weight", H, D)
        layers.append(layer)

    for layer in layers:
        layer.stack_qkv()
        for name, value in vars(layer).items():
            if isinstance(value, torch.Tensor) and name not in _PLACED:
                setattr(layer, name, to_huge_pages(value))
    return assemble_checkpoint(directory, cfg, embed, lm_head, get("model.norm.weight", H), layers,
                               checkpoint_dtype, index.files(), expert_sources, dense_dtype)


def assemble_checkpoint(directory, cfg, embed, lm_head, final_norm, layers, checkpoint_dtype, files,
                        expert_sources, dense_dtype: torch.dtype | None = None) -> "Checkpoint":
    """The loaded pieces as a Checkpoint, embeddings in huge pages (a tied head shares them)."""
    tied = lm_head is embed
    embed = to_huge_pages(embed)
    return Checkpoint(
        path=directory,
        config=cfg,
        embed=embed,
        final_norm=final_norm,
        lm_head=embed if tied else to_huge_pages(lm_head),
        layers=layers,
        checkpoint_dtype=_SAFETENSORS_DTYPES.get(checkpoint_dtype, torch.float32),
        files=files,
        expert_sources=expert_sources,
        dense_dtype=embed.dtype if dense_dtype is None else dense_dtype,
    )


# placed in huge pages already: the experts (allocated there) and the stacked attention projections
_PLACED = ("w13", "w2", "qkv_proj", "qkv_bias", "q_proj", "k_proj", "v_proj", "q_bias", "k_bias", "v_bias")

_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    f = Path(path) / "tokenizer.json"
    if not f.exists():
        raise MoebenchError(f"{f}: no such file (the checkpoint needs a tokenizer.json)")
    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise MoebenchError(f"{f}: unreadable tokenizer ({str(e).splitlines()[0]})") from None
