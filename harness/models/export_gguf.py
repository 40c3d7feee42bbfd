"""`moebench export gguf`: write a supported checkpoint (qwen3_moe, mixtral) as a GGUF file that
llama.cpp loads, tokenizer included, so llama.cpp's server can be measured on the same model.

The weights come from the engine's own safetensors loader, so the file holds exactly the numbers
the bundled runtime computes with. llama.cpp's own converter identifies a BPE pre-tokenizer by the
hash of its output on a sample text and refuses unknown ones; here the pre-tokenizer is read from
tokenizer.json's description instead and mapped to the llama.cpp pre-tokenizer with the same
splitting rules (see `_pre_tokenizer_name`).

torch and gguf are imported inside the functions: `moebench --help` must not pay for them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path



from moebench.errors import MoebenchError


# Hugging Face model_type -> llama.cpp architecture name (Mixtral is llama.cpp's llama with experts)
GGUF_ARCHITECTURES = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}
# --dtype: the type of every matrix but the routers (norms and routers stay F32 in every file). bf16
# holds a bfloat16 checkpoint's values exactly; q8_0 is llama.cpp's blocks of 32 int8 with a float16
# scale (the gguf package's quantizer), approximate. q4_0 holds the very bytes the runtime computes
# with under --weights int4 (engine/quantize.py: pack_int4_rows, Q4_0's layout and rule) for the
# attention and expert matrices; the LM head is Q8_0 (the format nearest --lm-head int8) and the
# embeddings F32 as the runtime keeps them (a tied head is the embeddings: Q8_0), docs/int4.md.
WEIGHT_DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
_EOS_NAMES = ("<|endoftext|>", "</s>", "<|im_end|>", "<eos>")  # the engine's fallback list
# bumped whenever the exporter's output for the same checkpoint changes (keys cached GGUF files)
EXPORT_FORMAT_VERSION = 1


def _gpt2_byte_alphabet() -> dict[int, str]:
    """Byte -> the printable character byte-level BPE vocabularies spell it with: printable
    Latin-1 bytes stand for themselves, the remaining bytes take code points from 256 upwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in alphabet:
            alphabet[b] = chr(256 + extra)
            extra += 1
    return alphabet


def _is_byte_level(component: dict | None) -> bool:
    return bool(component) and component.get("type") == "ByteLevel"


def _pre_tokenizer_name(pre: dict | None, clean_spaces: bool, source: Path) -> str:
    """The llama.cpp pre-tokenizer (`tokenizer.ggml.pre`) that splits text as `pre` does and
    cleans up spaces on decoding as `clean_up_tokenization_spaces` says.

    llama.cpp knows pre-tokenizers by model name; several names share the same splitting rules
    and differ only in that flag, so the name is picked by rules and flag, not by model:
    - ByteLevel with the GPT-2 regex: "gpt-2" (cleans spaces) or "trillion" (keeps them).
    - Digits(individual_digits) then ByteLevel: llama.cpp splits by `\\p{N}` first, then by the GPT-2
      regex inside each piece, as that sequence does: "refact" (cleans) or "command-r" (keeps).
    """
    def byte_level(part: dict | None) -> bool:
        return _is_byte_level(part) and part.get("use_regex", True) and not part.get("add_prefix_space", False)

    if byte_level(pre):
        return "gpt-2" if clean_spaces else "trillion"
    if pre and pre.get("type") == "Sequence":
        parts = pre.get("pretokenizers", [])
        if (len(parts) == 2 and parts[0].get("type") == "Digits" and parts[0].get("individual_digits")
                and byte_level(parts[1])):
            return "refact" if clean_spaces else "command-r"
    raise MoebenchError(
        f"{source}: pre-tokenizer {json.dumps(pre)[:120]} has no llama.cpp equivalent known to the exporter "
        "(supported: ByteLevel, or Digits(individual_digits) then ByteLevel)")


def tokenizer_fields(model_dir: Path, vocab_size: int) -> dict:
    """The GGUF tokenizer description of `model_dir/tokenizer.json`: {model, pre, tokens, types,
    merges, bos, eos, pad}. Byte-level BPE becomes llama.cpp's "gpt2" tokenizer; a word-level
    vocabulary of single characters (the random test models') becomes "gpt2" without merges, its
    characters spelled in the byte-level alphabet so llama.cpp maps each character to its token."""
    from gguf import TokenType

    source = model_dir / "tokenizer.json"
    try:
        spec = json.loads(source.read_text())
    except FileNotFoundError:
        raise MoebenchError(f"{source}: no such file (the GGUF needs the checkpoint's tokenizer)") from None
    except json.JSONDecodeError as e:
        raise MoebenchError(f"{source}: malformed JSON ({e.msg} at line {e.lineno})") from None
    model = spec.get("model") or {}
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    for tid, tok in added.items():
        vocab.setdefault(tok["content"], tid)
    if not vocab:
        raise MoebenchError(f"{source}: no vocabulary in the tokenizer")
    if max(vocab.values()) >= vocab_size:
        raise MoebenchError(f"{source}: token id {max(vocab.values())} is outside the model's vocabulary of {vocab_size}")

    config_file = model_dir / "tokenizer_config.json"
    try:
        tok_config = json.loads(config_file.read_text()) if config_file.exists() else {}
    except json.JSONDecodeError as e:
        raise MoebenchError(f"{config_file}: malformed JSON ({e.msg} at line {e.lineno})") from None
    # transformers' default when the file does not say
    clean_spaces = bool(tok_config.get("clean_up_tokenization_spaces", True))

    kind = model.get("type")
    merges: list[str] = []
    if kind == "BPE":
        if not _is_byte_level(spec.get("decoder")) or model.get("byte_fallback"):
            raise MoebenchError(f"{source}: only byte-level BPE tokenizers are exported (this one is not byte-level)")
        pre = _pre_tokenizer_name(spec.get("pre_tokenizer"), clean_spaces, source)
        # tokenizers writes merges as "a b" strings (older files) or ["a", "b"] pairs (newer files)
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
        spell = lambda text: text  # noqa: E731  (the vocabulary is already in the byte-level alphabet)
    elif kind == "WordLevel":
        pre_spec = spec.get("pre_tokenizer") or {}
        splits_characters = (pre_spec.get("type") == "Split" and pre_spec.get("pattern") == {"String": ""}
                             and pre_spec.get("behavior") == "Isolated" and not pre_spec.get("invert"))
        if not splits_characters or spec.get("normalizer"):
            raise MoebenchError(f"{source}: a word-level tokenizer is exported only when it splits text into single "
                                "characters (pre-tokenizer Split on \"\", isolated, no normalizer)")
        pre = "gpt-2" if clean_spaces else "trillion"  # no merges: how text is split first changes nothing
        alphabet = _gpt2_byte_alphabet()
        spell = lambda text: "".join(alphabet[b] for b in text.encode()) if len(text) == 1 else text  # noqa: E731
    else:
        raise MoebenchError(f"{source}: tokenizer model '{kind}' is not supported (byte-level BPE or single-character word-level)")

    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [TokenType.UNUSED] * vocab_size
    for text, tid in vocab.items():
        if tid in added:
            tokens[tid] = text
            types[tid] = TokenType.CONTROL if added[tid].get("special") else TokenType.USER_DEFINED
        else:
            tokens[tid] = spell(text)
            # a word-level vocabulary's multi-character entries (<unk>, padding) can never be produced
            types[tid] = TokenType.NORMAL if kind == "BPE" or len(text) == 1 else TokenType.UNUSED

    def special_id(name: str) -> int | None:
        content = tok_config.get(name)
        if isinstance(content, dict):
            content = content.get("content")
        return vocab.get(content) if content else None

    return {
        "model": "gpt2", "pre": pre, "tokens": tokens, "types": types, "merges": merges,
        "bos": special_id("bos_token"), "eos": special_id("eos_token"), "pad": special_id("pad_token"),
    }


def _unsupported(cfg) -> str | None:
    """Why llama.cpp's architecture would compute something else than this checkpoint, if it would."""
    if cfg.family not in GGUF_ARCHITECTURES:
        return f"model_type '{cfg.family}' (the export writes {', '.join(GGUF_ARCHITECTURES)})"
    if cfg.attention_bias:
        return "attention biases"
    if cfg.sliding_window is not None:
        return "a sliding attention window"
    if cfg.family == "qwen3_moe":
        if cfg.dense_layers:
            return f"dense (non-MoE) layers {list(cfg.dense_layers)} (llama.cpp's qwen3moe makes every layer MoE)"
        if not cfg.norm_topk_prob:
            return "norm_topk_prob=false (llama.cpp's qwen3moe always renormalizes the top-k weights)"
    return None


def _rope_interleave(w, num_heads: int):
    """Hugging Face's llama rotates the two halves of each head; llama.cpp's llama rotates adjacent
    pairs. Reordering each head's rows (first half and second half interleaved) makes them agree."""
    out_dim, in_dim = w.shape
    head_dim = out_dim // num_heads
    return w.reshape(num_heads, 2, head_dim // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def export_gguf(model_dir: Path, out: Path, dtype: str = "f32") -> Path:
    """Write `model_dir` as a GGUF file at `out` (atomically) and return `out`."""
    import gguf
    import numpy as np
    import torch

    from moebench.engine.families import load_checkpoint, parse_model_config
    from moebench.engine.quantize import pack_int4_rows

    if dtype not in WEIGHT_DTYPES:
        raise MoebenchError(f"unknown weight type '{dtype}' (choose from: {', '.join(WEIGHT_DTYPES)})")
    model_dir = Path(model_dir)
    cfg = parse_model_config(model_dir / "config.json")
    reason = _unsupported(cfg)
    if reason:
        raise MoebenchError(f"{model_dir}: checkpoint has {reason}, which the GGUF export does not support")
    tok = tokenizer_fields(model_dir, cfg.vocab_size)
    ckpt = load_checkpoint(model_dir, dtype=torch.float32)
    arch = GGUF_ARCHITECTURES[cfg.family]
    Q = gguf.GGMLQuantizationType
    weight_type = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[dtype]
    if weight_type in (Q.Q8_0, Q.Q4_0):
        block = gguf.GGML_QUANT_SIZES[weight_type][0]
        widths = {cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.moe_intermediate_size}
        if any(w % block for w in widths):
            raise MoebenchError(f"{model_dir}: {dtype} needs every matrix's rows to be a multiple of {block} values "
                                f"(this checkpoint's are {sorted(widths)} wide)")

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        writer.add_name(model_dir.name)
        writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                              "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                              "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[dtype])
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_context_length(cfg.max_position_embeddings)
        writer.add_embedding_length(cfg.hidden_size)
        writer.add_block_count(cfg.num_layers)
        writer.add_head_count(cfg.num_heads)
        writer.add_head_count_kv(cfg.num_kv_heads)
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_rope_dimension_count(cfg.head_dim)
        writer.add_rope_freq_base(cfg.rope_theta)
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.top_k)
        if cfg.family == "qwen3_moe":
            writer.add_feed_forward_length(cfg.dense_intermediate_size or cfg.moe_intermediate_size)
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        else:  # llama.cpp's llama takes the expert width from feed_forward_length
            writer.add_feed_forward_length(cfg.moe_intermediate_size)

        writer.add_tokenizer_model(tok["model"])
        writer.add_tokenizer_pre(tok["pre"])
        writer.add_token_list(tok["tokens"])
        writer.add_token_types(tok["types"])
        # llama.cpp's gpt2 tokenizer refuses a file without merges and the gguf package cannot write
        # an empty list; a merge of two multi-character pieces never fires (BPE starts from single
        # characters and there is no other merge to build such a piece), so it stands for "none"
        writer.add_token_merges(tok["merges"] or ["<no-merges> <no-merges>"])
        if tok["eos"] is None:  # as the bundled runtime finds its end of text
            named = [tok["tokens"].index(n) for n in _EOS_NAMES if n in tok["tokens"]]
            tok["eos"] = cfg.eos_token_ids[0] if cfg.eos_token_ids else (named[0] if named else None)
        for key, add_id in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                            ("pad", writer.add_pad_token_id)):
            if tok[key] is not None:
                add_id(tok[key])
        # prompts are used exactly as the suite writes them: the bundled runtime adds no BOS either
        writer.add_add_bos_token(False)
        writer.add_add_eos_token(False)

        def add(name: str, tensor, keep_f32: bool = False, as_type=None) -> None:
            # the loader keeps a bfloat16 checkpoint's dense matrices bfloat16 (widened here, exactly)
            array = tensor.detach().float().cpu().numpy() if hasattr(tensor, "detach") else tensor
            array = np.ascontiguousarray(array, dtype=np.float32)
            # 1-D tensors (norms) must stay F32 for llama.cpp; the router stays F32 so that F16
            # rounding cannot flip which experts a token picks
            target = Q.F32 if keep_f32 or array.ndim == 1 else weight_type if as_type is None else as_type
            if target in (Q.F32, Q.F16):
                writer.add_tensor(name, array.astype(np.float16) if target == Q.F16 else array)
            elif target == Q.Q4_0:  # the runtime's own int4 rows, byte for byte (Q4_0's layout)
                writer.add_tensor(name, pack_int4_rows(torch.from_numpy(array)).numpy(), raw_dtype=target)
            else:  # bytes in llama.cpp's layout; the writer works the shape out from raw_dtype
                writer.add_tensor(name, gguf.quants.quantize(array, target), raw_dtype=target)

        tied = ckpt.lm_head.data_ptr() == ckpt.embed.data_ptr()
        head_type = Q.Q8_0 if weight_type == Q.Q4_0 else None
        add("token_embd.weight", ckpt.embed, as_type=head_type if tied else Q.F32 if head_type else None)
        add("output_norm.weight", ckpt.final_norm)
        if not tied:
            add("output.weight", ckpt.lm_head, as_type=head_type)
        I = cfg.moe_intermediate_size
        for i, layer in enumerate(ckpt.layers):
            blk = f"blk.{i}"
            q, k = layer.q_proj, layer.k_proj
            if cfg.family == "mixtral":
                q, k = _rope_interleave(q, cfg.num_heads), _rope_interleave(k, cfg.num_kv_heads)
            add(f"{blk}.attn_norm.weight", layer.input_norm)
            add(f"{blk}.attn_q.weight", q)
            add(f"{blk}.attn_k.weight", k)
            add(f"{blk}.attn_v.weight", layer.v_proj)
            add(f"{blk}.attn_output.weight", layer.o_proj)
            if layer.q_norm is not None:
                add(f"{blk}.attn_q_norm.weight", layer.q_norm)
                add(f"{blk}.attn_k_norm.weight", layer.k_norm)
            add(f"{blk}.ffn_norm.weight", layer.post_attention_norm)
            add(f"{blk}.ffn_gate_inp.weight", layer.router, keep_f32=True)
            add(f"{blk}.ffn_gate_exps.weight", layer.w13[:, :I])
            add(f"{blk}.ffn_up_exps.weight", layer.w13[:, I:])
            add(f"{blk}.ffn_down_exps.weight", layer.w2)

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return out


def _bundled_model() -> Path:
    from moebench.models.bundled import BUNDLED_MODEL

    return BUNDLED_MODEL
