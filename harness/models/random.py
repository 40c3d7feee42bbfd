"""Random checkpoints written by transformers itself, for benchmarks and tests that must not
depend on a download: the engine loads exactly the files it would load in the field."""

from __future__ import annotations

from pathlib import Path

import torch


def write_char_tokenizer(directory: Path, vocab_size: int = 211) -> Path:
    """A WordLevel tokenizer over single characters ("</s>" = id 1, the EOS), padded with unused
    ids up to `vocab_size`: enough to run text through the engine."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<unk>": 0, "</s>": 1}
    for ch in chars:
        vocab[ch] = len(vocab)
    for i in range(len(vocab), vocab_size):
        vocab[f"<extra_{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["</s>"])
    tok.save(str(directory / "tokenizer.json"))
    return directory


def make_random_qwen3_moe(directory: Path, shape: dict, seed: int = 0, dtype: torch.dtype = torch.float32,
                          char_tokenizer: bool = False, **config) -> Path:
    """A random qwen3_moe checkpoint of `shape` (Qwen3MoeConfig fields) saved by transformers.

    `config` adds or overrides config fields (e.g. initializer_range: at transformers' default
    0.02 a random model repeats one token forever, so routing never changes between steps)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    settings = dict(norm_topk_prob=True, tie_word_embeddings=False, eos_token_id=None, pad_token_id=None,
                    bos_token_id=None, max_position_embeddings=4096)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**settings, **shape, **config})).to(dtype).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    if char_tokenizer:
        write_char_tokenizer(directory, shape["vocab_size"])
    return directory
