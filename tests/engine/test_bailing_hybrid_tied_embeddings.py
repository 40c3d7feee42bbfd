"""Ling-3.0 (`bailing_hybrid`) with tie_word_embeddings=true: transformers never ties this family
and uses lm_head.weight; the runtime must give the same logits."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from moebench.engine import load_checkpoint
from moebench.errors import MoebenchError
from test_bailing_hybrid import engine_prefill_logits
from tiny_bailing import make_tiny_bailing


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return make_tiny_bailing(tmp_path_factory.mktemp("tied"), tie_word_embeddings=True)


def test_tied_flag_logits_match_transformers(tied):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32).eval()
    assert reference.config.tie_word_embeddings
    head, embed = reference.lm_head.weight, reference.model.get_input_embeddings().weight
    assert not torch.equal(head, embed)  # the case that matters: the two differ in the file
    ckpt = load_checkpoint(tied)
    ids = [3, 17, 42, 5, 60, 11]
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0].float()
    ours, _ = engine_prefill_logits(ckpt, [ids], "naive")
    assert (ours - ref).abs().max().item() <= 1e-4


def test_tied_flag_without_lm_head_is_refused_in_one_line(tied, tmp_path):
    import shutil

    copy = tmp_path / "no-head"
    shutil.copytree(tied, copy)
    weights = load_file(copy / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MoebenchError, match="missing tensor 'lm_head.weight'.*never ties"):
        load_checkpoint(copy)
