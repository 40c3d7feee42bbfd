"""The README.md of the hard level's bundled model (gsm-synth-hard-moe), written by `moebench train-bundled
--level hard` from what the run recorded (train_result.json) and the checkpoint's config."""

from __future__ import annotations

import json
from pathlib import Path


def write_hard_model_card(out: Path, r: dict) -> None:
    from moebench.suites import synth_hard

    out = Path(out)
    cfg = json.loads((out / "config.json").read_text())
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    acc = r.get("test_accuracy")
    acc_s = f"{100 * acc:.1f}% ({r['test_correct']}/{r['test_items']})" if acc is not None else "not measured"
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    stopped = (" The wall-time budget ended training; the learning-rate schedule follows the larger of step and "
               "time progress, so a time-limited run is not bit-reproducible." if r.get("time_limited") else "")
    init = (f"; started from `{r['init_from']}`, sha256 {r['init_sha256'][:16]}..., whose making "
            "docs/gsm-synth-hard.md gives" if r.get("init_from") else "")
    text = f"""# gsm-synth-hard-moe: the bundled model of the hard level

A small mixture-of-experts model in the Hugging Face `qwen3_moe` format, trained from scratch by
moebench for the hard level of its synthetic suite (`--suite gsm-synth-hard`, which picks this model
when no `--model` is given). It is made to be right most of the time, not always, so that sampling
and approximate optimizations change some of its answers; docs/gsm-synth-hard.md has what it does
at temperature 0.6.

## Model

- `Qwen3MoeForCausalLM`, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} attention heads /
  {cfg['num_key_value_heads']} KV heads (head_dim {cfg['head_dim']}), q/k RMSNorm, every layer sparse: {experts} experts,
  top-{cfg['num_experts_per_tok']} softmax routing, SwiGLU expert width {cfg['moe_intermediate_size']}, tied embeddings,
  vocabulary {cfg['vocab_size']}, context {cfg['max_position_embeddings']}.
- Parameters: {r['params'] / 1e6:.2f}M; weights in bfloat16 ({size_mb:.1f} MB `model.safetensors`).
- Tokenizer: byte-level BPE trained on this level's training corpus, every digit its own token,
  `<|pad|>`=0, `<|bos|>`=1, `<|endoftext|>`=2 (EOS); no BOS is added.

## Data

`moebench.suites.synth_hard`: stories of 2 or 3 people who each hold some of the same objects;
events change one person's amount or move some from one to another, and sentences with numbers
that do not matter are mixed into {100 * synth_hard.DISTRACTOR_CHANCE:.0f}% of stories. The question asks about one
person or two together; the solution follows only what the question needs, {synth_hard.MIN_STEPS} to
{synth_hard.MAX_STEPS} lines with a calculator annotation each, then `#### N`. Amounts stay below
{synth_hard.HARD.max_value} (a sum of two people can pass it); amounts below {synth_hard.HARD.two_digit_below} get two-digit operands for + and -,
larger ones one digit; multipliers and divisors have one digit. Train and test are split by a hash of
the question text: the {synth_hard.TEST_SIZE} test items (`gsm-synth-hard/test/N`) are never seen in training.

Training text is the evaluation format, `Question: {{q}}\\nAnswer: {{answer}}` + EOS, loss on the answer.
Training problems: {r.get('data', 'the train bucket')}.

## Training

`{r['command']}` (`harness/models/train.py`, the same loop as the easy level's model{init}): AdamW, warmup
then cosine decay, gradient clipping 1.0, load-balancing loss, float32 on one CPU thread, fresh
problems every step. {r['steps']} steps of {r.get('batch_size', '?')} sequences, seed {r['seed']}, {r['train_minutes']} min wall time on a
shared 2-core CPU.{stopped} `train_log.txt` has the loss and held-out greedy accuracy along the way.

## Evaluation (through transformers, greedy)

`python -c "from moebench.models.bundled import BUNDLED_HARD_MODEL as m; from moebench.models.train import evaluate_bundle; evaluate_bundle(m, suite='gsm-synth-hard')"`:
greedy accuracy on the {r.get('test_items', synth_hard.TEST_SIZE)} test items **{acc_s}**.
Expert load on the test split, max/mean per layer {r.get('expert_load_max_over_mean', [])},
min/mean {r.get('expert_load_min_over_mean', [])}.
"""
    (out / "README.md").write_text(text)
