"""`moebench models synth`: random checkpoints with a named model's structure, scaled to this machine.

A shape keeps what decides how an MoE decodes (the layer-type pattern, experts per active expert,
expert groups and how many are kept, the shared expert, the router's kind) and reduces widths,
depth and expert count. The checkpoint is written by `transformers` itself, with a model card
beside it (README.md and model_card.json) that states the scale and what random weights mean for
any figure measured on them: a random router routes almost uniformly, so expert reuse between
tokens (what caches and prefetchers live on) is lower than a trained model's.

torch, transformers and tokenizers are imported inside the functions: `moebench --help` must not
pay for them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path



from moebench.errors import MoebenchError


# Ling-3.0-flash (inclusionAI, model_type bailing_hybrid) as the issue and its config give it
LING3_FLASH = dict(
    num_hidden_layers=42, layer_group_size=6, first_k_dense_replace=2, hidden_size=2560, intermediate_size=6144,
    moe_intermediate_size=768, num_attention_heads=32, head_dim=128, kv_lora_rank=512, qk_rope_head_dim=64,
    qk_nope_head_dim=128, v_head_dim=128, num_local_experts=512, num_experts_per_tok=8, n_group=8, topk_group=4,
    n_shared_experts=1, routed_scaling_factor=2.5, num_mtp_layers=1, vocab_size=157184,
)

SHAPES = {
    "ling3-flash-scaled": dict(
        family="bailing_hybrid",
        reference=("Ling-3.0-flash", LING3_FLASH),
        # kept: layer groups of 6 (5 KDA + 1 MLA), 64 experts per active expert (128 top-2 vs 512 top-8),
        # 8 expert groups with 4 kept (32 candidates per active expert, as 256 / 8), one shared expert
        # of the routed experts' width, sigmoid routing with expert bias and scaling 2.5, dense first
        # layer(s), MLA and KDA per-head widths (128 / 64 rotary / 128), KDA width 1.6x hidden.
        # reduced: hidden 2560 -> 640, heads 32 -> 8, expert and dense widths /4, experts /4,
        # depth 42 -> 12 (2 dense -> 1), kv_lora_rank 512 -> 128; no MTP layer (plain decoding
        # never reads it); vocabulary from the tokenizer.
        config=dict(
            num_hidden_layers=12, layer_group_size=6, first_k_dense_replace=1, hidden_size=640,
            intermediate_size=1536, moe_intermediate_size=192, num_attention_heads=8, num_key_value_heads=8,
            head_dim=128, kv_lora_rank=128, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
            v_head_dim=128, short_conv_kernel_size=4, num_local_experts=128, num_experts_per_tok=2, n_group=8,
            topk_group=4, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, num_mtp_layers=0,
            max_position_embeddings=8192, tie_word_embeddings=False, rope_theta=6_000_000.0,
            # transformers' default 0.02 makes a random model repeat one token, routing the same
            # experts every step; wider weights make tokens and routing vary
            initializer_range=0.1,
        ),
        # the router's expert bias is zero at initialisation; a small random one exercises it
        expert_bias_std=0.02,
    ),
}

RANDOM_ROUTING_NOTE = ("random weights: the routers route almost uniformly, so expert reuse across tokens "
                       "and requests (what expert caches, prefetch and affinity scheduling exploit) is lower than "
                       "in a trained model; speedups from those optimizations on this checkpoint understate or "
                       "misstate what a trained Ling-3.0-flash gives")


def gsm8k_bpe_tokenizer(data_dir: Path, vocab_size: int, out: Path) -> int:
    """A byte-level BPE tokenizer trained on the GSM8K train split in `data_dir` (train.jsonl):
    GSM8K prompts get realistic lengths. Returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    train = data_dir / "train.jsonl"
    if not train.is_file():
        raise MoebenchError(f"{train}: no such file (--data needs GSM8K's train.jsonl to train the tokenizer)")
    texts = []
    with train.open() as f:
        for n, line in enumerate(f, 1):
            try:
                row = json.loads(line)
                texts.append(f"{row['question']}\n{row['answer']}")
            except (json.JSONDecodeError, KeyError, TypeError):
                raise MoebenchError(f"{train}:{n}: malformed row (expected JSON with question and answer)") from None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out / "tokenizer.json"))
    return tok.get_vocab_size()


def make_synth_model(shape: str, out: Path, data_dir: Path | None, seed: int = 0, dtype: str = "bfloat16",
                     tokenizer_vocab: int = 8192) -> Path:
    if shape not in SHAPES:
        raise MoebenchError(f"unknown shape '{shape}' (choose from: {', '.join(SHAPES)})")
    if dtype not in ("bfloat16", "float32"):
        raise MoebenchError(f"--dtype {dtype}: choose bfloat16 or float32")
    import torch
    from transformers import BailingHybridConfig, BailingHybridForCausalLM

    spec = SHAPES[shape]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MoebenchError(f"--out {out}: cannot create it ({e.strerror or e})") from None
    if data_dir is None:
        vocab, special = _bundled_tokenizer(out)
        tokenizer_note = f"the bundled gsm-synth-moe model's byte-level BPE ({vocab} tokens; no --data given)"
        print(f"moebench: no GSM8K data given (--data or $MOEBENCH_GSM8K_DIR): using the bundled model's "
              f"tokenizer ({vocab} tokens, trained on gsm-synth); GSM8K prompts tokenize longer with it than "
              "with one trained on GSM8K's train split, which --data gives", file=sys.stderr, flush=True)
    else:
        vocab = gsm8k_bpe_tokenizer(Path(data_dir), tokenizer_vocab, out)
        special = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": None}
        tokenizer_note = f"byte-level BPE trained on {Path(data_dir) / 'train.jsonl'}"
    config = dict(spec["config"], vocab_size=vocab, **special)
    torch.manual_seed(seed)
    model = BailingHybridForCausalLM(BailingHybridConfig(**config))
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.normal_(0.0, spec["expert_bias_std"])
    model = model.to(getattr(torch, dtype)).eval()
    model.save_pretrained(out)
    if data_dir is not None:  # the bundled tokenizer came with its own tokenizer_config.json
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "eos_token": "<|endoftext|>",
             "clean_up_tokenization_spaces": False}, indent=2))
    params = sum(p.numel() for p in model.parameters())
    _write_card(out, shape, spec, config, params, seed, dtype, tokenizer_note)
    _readable_like_the_rest(out)
    return out


def _bundled_tokenizer(out: Path) -> tuple[int, dict]:
    """The bundled model's tokenizer, copied: a checkpoint without any GSM8K data at hand. Returns
    its vocabulary size and the special tokens' ids as the bundled config gives them."""
    import shutil

    from moebench.models.bundled import bundled_model_path

    bundled = bundled_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(bundled / name, out / name)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    raw = json.loads((bundled / "config.json").read_text())
    return vocab, {k: raw.get(k) for k in ("pad_token_id", "eos_token_id", "bos_token_id")}


def _readable_like_the_rest(out: Path) -> None:
    """Files as a plain write leaves them (0666 less the umask): the safetensors writer makes its
    file through a private temporary (0600), which another user of a shared checkpoint cannot read."""
    mask = os.umask(0)
    os.umask(mask)
    for f in out.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~mask)


def _write_card(out: Path, shape: str, spec: dict, config: dict, params: int, seed: int, dtype: str,
                tokenizer_note: str) -> None:
    ref_name, ref = spec["reference"]
    kept = ["num_hidden_layers", "layer_group_size", "first_k_dense_replace", "hidden_size", "moe_intermediate_size",
            "num_attention_heads", "kv_lora_rank", "num_local_experts", "num_experts_per_tok", "n_group", "topk_group",
            "n_shared_experts", "routed_scaling_factor", "num_mtp_layers", "vocab_size"]
    scale = {k: {"reference": ref[k], "this": config[k]} for k in kept}
    card = {
        "schema": "moebench.model_card/1",
        "shape": shape,
        "family": spec["family"],
        "reference_model": ref_name,
        "synthetic": True,
        "random_weights_note": RANDOM_ROUTING_NOTE,
        "parameters": params,
        "dtype": dtype,
        "seed": seed,
        "tokenizer": tokenizer_note,
        "scale": scale,
    }
    (out / "model_card.json").write_text(json.dumps(card, indent=2) + "\n")
    rows = "\n".join(f"| `{k}` | {v['reference']} | {v['this']} |" for k, v in scale.items())
    (out / "README.md").write_text(
        f"# {shape}: random weights with {ref_name}'s structure, scaled\n\n"
        f"Written by `moebench models synth --shape {shape}` (seed {seed}, {dtype}, {params / 1e6:.0f}M "
        f"parameters), with `transformers`' own `{spec['family']}` model.\n\n"
        f"**Not a trained model.** {RANDOM_ROUTING_NOTE[0].upper() + RANDOM_ROUTING_NOTE[1:]}. Outputs are "
        "meaningless text; GSM8K accuracy on it is zero by construction, and speed is what it measures.\n\n"
        f"| field | {ref_name} | this checkpoint |\n| --- | --- | --- |\n{rows}\n\n"
        "Kept: the layer pattern (groups of 6: five KDA linear-attention layers, then one MLA layer), 64 "
        "experts per active expert, 8 expert groups with 4 kept, one shared expert, sigmoid routing with "
        "expert bias and routed scaling 2.5, dense first layer(s), the per-head widths of MLA and KDA. "
        "Reduced: depth, widths, head count, expert count and top-k (in proportion). No MTP layer: plain "
        "decoding never reads it.\n")
