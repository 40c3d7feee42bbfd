"""Train the bundled default model: a small qwen3_moe that solves the synthetic GSM-style suite.

The training forward (train_model.py) is written in plain PyTorch and is mathematically the
forward of transformers' Qwen3MoE (RMSNorm, RoPE, q_norm/k_norm, GQA, softmax top-k router,
SwiGLU experts); only the order of work differs: the experts run as one capacity-padded batched
matmul instead of a loop. This module holds the tokenizer, the data, the training loop, the
evaluation and the bundle's files.

Run: ``moebench train-bundled``; the command line is in train_cli.py (above this module).
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from moebench.models.train_model import TrainModel, to_hf

from moebench.models.bundled import BUNDLED_MODEL as BUNDLED_DIR
from moebench.models.levels import EASY_CONFIG, LEVELS, Level

SPECIALS = ["<|pad|>", "<|bos|>", "<|endoftext|>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

MODEL_CONFIG = EASY_CONFIG  # the easy level's shape (levels.py holds each level's)
VOCAB_SIZE = 768


# ---------------------------------------------------------------- tokenizer

def build_tokenizer(texts, vocab_size: int = VOCAB_SIZE):
    """Byte-level BPE with every digit its own token; decodes back to the exact text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, s
    return tok


def make_hf_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=SPECIALS[PAD_ID],
                                   bos_token=SPECIALS[BOS_ID], eos_token=SPECIALS[EOS_ID],
                                   padding_side="left", clean_up_tokenization_spaces=False)


# ---------------------------------------------------------------- model

def hf_config(vocab_size: int = VOCAB_SIZE, model_config: dict = MODEL_CONFIG):
    from transformers import Qwen3MoeConfig

    kw = dict(model_config)
    theta = kw.pop("rope_theta")
    cfg = Qwen3MoeConfig(vocab_size=vocab_size, pad_token_id=PAD_ID, bos_token_id=BOS_ID,
                         eos_token_id=EOS_ID, rope_parameters={"rope_type": "default", "rope_theta": theta},
                         **kw)
    return cfg


# ---------------------------------------------------------------- evaluation

def extract_answer(text: str) -> str | None:
    import re

    text = text.split("Question:")[0]
    m = re.search(r"####\s*(-?[\d,]+)", text)
    if m:
        return m.group(1).replace(",", "")
    return None


@torch.no_grad()
def greedy_eval(hf, hf_tok, items, batch_size: int = 100, max_new_tokens: int = 200):
    """Greedy accuracy through transformers' generate (left padding, stop at EOS).

    items: objects with .question and .target.  Returns (accuracy, outputs)."""
    from moebench.suites.synth import format_prompt

    hf.eval()
    outs = []
    for i in range(0, len(items), batch_size):
        chunk = items[i:i + batch_size]
        enc = hf_tok([format_prompt(it.question) for it in chunk], return_tensors="pt",
                     padding=True, add_special_tokens=False)
        gen = hf.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                          eos_token_id=EOS_ID, pad_token_id=PAD_ID)
        texts = hf_tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        outs.extend(texts)
    correct = sum(extract_answer(o) == it.target for o, it in zip(outs, items))
    return correct / max(1, len(items)), outs


@torch.no_grad()
def expert_load(hf, hf_tok, texts, batch_size: int = 50):
    """Tokens routed to each expert in each layer over `texts` (pads excluded): [L, E]."""
    c = hf.config
    counts = torch.zeros(c.num_hidden_layers, c.num_experts)
    hooks = []

    def mk(li):
        def hook(mod, args, out):
            idx = out[2]  # router_indices [N, k]
            hook.mask_ref.append((li, idx))
        return hook

    records = []
    for li, layer in enumerate(hf.model.layers):
        h = mk(li)
        h.mask_ref = records
        hooks.append(layer.mlp.gate.register_forward_hook(h))
    try:
        for i in range(0, len(texts), batch_size):
            enc = hf_tok(texts[i:i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            records.clear()
            hf(**enc)
            valid = enc["attention_mask"].reshape(-1).bool()
            for li, idx in records:
                sel = idx[valid].reshape(-1)
                counts[li] += torch.bincount(sel, minlength=c.num_experts).float()
    finally:
        for h in hooks:
            h.remove()
    return counts


# ---------------------------------------------------------------- data

# Training problems are the train bucket's, drawn from seed + TRAIN_STREAM_OFFSET; the held-out
# validation problems from seed + VALIDATION_OFFSET (also train bucket, excluded from training).
TRAIN_STREAM_OFFSET = 12345
VALIDATION_OFFSET = 999

def batches(tok, rng: random.Random, batch_size: int, exclude: set[str], seed: int, pool: int = 8,
            level: Level = LEVELS["easy"]):
    """Endless training batches: (ids [B,T], labels [B,T], valid [B,T]); loss on the answer only."""
    from moebench.suites.synth import format_prompt

    stream = level.problems().iter_problems("train", seed=seed + TRAIN_STREAM_OFFSET, **level.generator_kwargs())
    while True:
        probs = []
        while len(probs) < batch_size * pool:
            p = next(stream)
            if p.question not in exclude:
                probs.append(p)
        prompts = [format_prompt(p.question) for p in probs]
        fulls = [f"{pr} {p.answer}" for pr, p in zip(prompts, probs)]
        penc = tok.encode_batch(prompts)
        fenc = tok.encode_batch(fulls)
        rows = []
        for pe, fe in zip(penc, fenc):
            ids = fe.ids + [EOS_ID]
            assert fe.ids[:len(pe.ids)] == pe.ids
            rows.append((ids, len(pe.ids)))
        rows.sort(key=lambda r: len(r[0]))  # length buckets: little padding
        groups = [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]
        rng.shuffle(groups)
        for g in groups:
            T = max(len(r[0]) for r in g)
            ids = torch.full((len(g), T), PAD_ID, dtype=torch.long)
            labels = torch.full((len(g), T), -100, dtype=torch.long)
            valid = torch.zeros((len(g), T), dtype=torch.bool)
            for j, (r, plen) in enumerate(g):
                ids[j, :len(r)] = torch.tensor(r)
                valid[j, :len(r)] = True
                labels[j, plen - 1:len(r) - 1] = torch.tensor(r[plen:])
            yield ids, labels, valid


# ---------------------------------------------------------------- training

def train(out: Path = BUNDLED_DIR, minutes: float = 45.0, seed: int = 0, steps: int = 3200,
          batch_size: int = 16, lr: float = 3e-3, eval_every: int = 300, eval_items: int = 100,
          final_eval: bool = True, threads: int = 1, save_checkpoints: bool = False, log=print,
          level: str = "easy", init_from: Path | None = None):
    from moebench.suites.synth import format_training_text

    lvl = LEVELS[level]
    def generate_split(split, n, seed=None):
        return lvl.problems().generate_split(split, n, seed, **lvl.generator_kwargs())

    # one thread: on a shared 2-core machine, 2 OpenMP threads ran up to 8x slower
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    t0 = time.time()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    if init_from is None:
        corpus = [format_training_text(p.question, p.answer) for p in generate_split("train", 20000)]
        tok = build_tokenizer(corpus)
    else:  # a warm start keeps the starting model's tokenizer, so its embeddings mean what they meant
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(init_from) / "tokenizer.json"))
        tok.no_padding()  # the saved file pads batches; training pads its own
    hf_tok = make_hf_tokenizer(tok)
    cfg = hf_config(tok.get_vocab_size(), lvl.model_config)
    # validation: train-bucket problems from a separate seed, kept out of training
    val = generate_split("train", eval_items, seed=seed + VALIDATION_OFFSET)
    exclude = {p.question for p in val}

    model = TrainModel(cfg)
    model.init_weights(seed)
    if init_from is not None:
        start, _ = load_bundle(init_from)
        weights = {k: v for k, v in start.state_dict().items() if k != "lm_head.weight"}  # tied: the embedding
        model.load_state_dict(weights)
        log(f"initialised from {init_from} (model.safetensors sha256 {_file_sha256(Path(init_from) / 'model.safetensors')[:16]})")
    nparams = sum(p.numel() for p in model.parameters())
    log(f"params {nparams/1e6:.2f}M  vocab {cfg.vocab_size}  config {json.dumps(lvl.model_config)}")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    warmup = min(100, steps // 10)
    budget_s = minutes * 60

    def lr_at(progress, s):
        # progress in [0, 1]: the larger of the step fraction and the wall-time fraction, so
        # the cosine decay always completes within the time budget on a slow, shared machine
        if s < warmup:
            return lr * (s + 1) / warmup
        f = min(1.0, max(0.0, (progress - warmup / steps) / (1 - warmup / steps)))
        return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * f)))

    rng = random.Random(seed)
    data = batches(tok, rng, batch_size, exclude, seed, level=lvl)
    aux_coef = cfg.router_aux_loss_coef
    ema = None
    ntok = 0
    tstep = time.time()
    t_train = time.time()
    step = 0
    time_limited = False
    for step in range(steps):
        progress = max(step / steps, (time.time() - t_train) / budget_s)
        if progress >= 1.0:
            time_limited = True
            log(f"time budget of {minutes} min reached at step {step}; stopping")
            break
        cur_lr = lr_at(progress, step)
        ids, labels, valid = next(data)
        for gparam in opt.param_groups:
            gparam["lr"] = cur_lr
        logits, aux, counts = model(ids, valid)
        ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        loss = ce + aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ntok += int(valid.sum())
        ema = ce.item() if ema is None else 0.98 * ema + 0.02 * ce.item()
        if step % 25 == 0:
            load = counts.float()
            mm = (load.max(1).values / load.mean(1)).max().item()
            dt = time.time() - tstep
            log(f"step {step} ce {ce.item():.4f} ema {ema:.4f} aux {aux.item()/cfg.num_hidden_layers:.3f} "
                f"maxload/mean {mm:.2f} lr {cur_lr:.2e} tok/s {ntok/dt:.0f} "
                f"elapsed {(time.time()-t0)/60:.1f}m")
            ntok, tstep = 0, time.time()
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            te = time.time()
            hf_now = to_hf(model)
            acc, _ = greedy_eval(hf_now, hf_tok, val)
            if save_checkpoints:
                save_bundle(hf_now, hf_tok, out / "checkpoint")
            log(f"eval step {step+1} val greedy acc {acc:.3f} ({len(val)} items, bf16 weights) "
                f"[{time.time()-te:.0f}s]")
            ntok, tstep = 0, time.time()
    train_s = time.time() - t0
    nsteps = step if time_limited else step + 1
    log(f"training done: {nsteps} steps in {train_s/60:.1f} min")

    hf = to_hf(model)
    save_bundle(hf, hf_tok, out)
    log(f"saved to {out}")
    result = {"steps": nsteps, "time_limited": time_limited, "train_minutes": round(train_s / 60, 1), "seed": seed,
              "params": nparams}
    if level != "easy" or init_from is not None:  # the easy bundle's record predates these fields
        result.update(level=level, suite=lvl.suite, batch_size=batch_size, lr=lr,
                      data=f"{lvl.module}.iter_problems('train', seed={seed + TRAIN_STREAM_OFFSET}"
                           f"{', nums=' + lvl.numbers if lvl.numbers else ''}), "
                           f"minus {eval_items} validation problems from seed {seed + VALIDATION_OFFSET}")
        if init_from is not None:
            result.update(init_from=str(init_from),
                          init_sha256=_file_sha256(Path(init_from) / "model.safetensors"))
    if final_eval:
        result.update(evaluate_bundle(out, threads=threads, log=log, suite=lvl.suite))
    level_flag = ("" if level == "easy" else f" --level {level}") + (f" --init-from {init_from}" if init_from else "")
    result["command"] = (f"moebench train-bundled{level_flag} --minutes {minutes:g} --seed {seed} --steps {steps} "
                         f"--batch-size {batch_size} --lr {lr:g} --eval-every {eval_every} --threads {threads}")
    (out / "train_result.json").write_text(json.dumps(result, indent=1) + "\n")
    if level == "easy":
        write_model_card(out, result)
    else:
        from moebench.models.hard_model_card import write_hard_model_card

        write_hard_model_card(out, result)
    return result


def _file_sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def write_model_card(out: Path, r: dict):
    from moebench.suites import synth

    cfg = json.loads((Path(out) / "config.json").read_text())
    size_mb = (Path(out) / "model.safetensors").stat().st_size / 1e6
    acc = r.get("test_accuracy")
    acc_s = (f"{100 * acc:.1f}% ({r['test_correct']}/{r['test_items']})" if acc is not None else "not measured")
    loads = r.get("expert_load_max_over_mean", [])
    mins = r.get("expert_load_min_over_mean", [])
    E = cfg.get("num_experts", cfg.get("num_local_experts"))
    text = f"""# gsm-synth-moe: the bundled default model

A tiny mixture-of-experts model in the Hugging Face `qwen3_moe` format, trained from
scratch by moebench to solve its synthetic GSM-style suite (`gsm-synth`). It is the default
model of moebench's default job: small enough to run anywhere, yet a real MoE whose
routing was learned, with answers that can be scored exactly.

## Model

- Architecture: `Qwen3MoeForCausalLM`, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']},
  {cfg['num_attention_heads']} attention heads / {cfg['num_key_value_heads']} KV heads (head_dim {cfg['head_dim']}),
  q/k RMSNorm, RoPE theta {cfg['rope_parameters']['rope_theta']:g}, every layer sparse:
  {E} experts, top-{cfg['num_experts_per_tok']} softmax routing (norm_topk_prob={str(cfg['norm_topk_prob']).lower()}),
  SwiGLU expert width {cfg['moe_intermediate_size']}, tied embeddings, vocabulary {cfg['vocab_size']}.
- Parameters: {r['params'] / 1e6:.2f}M; weights stored in bfloat16 ({size_mb:.1f} MB `model.safetensors`).
- Tensor names (as transformers 5.24 `save_pretrained` writes them): experts one by one,
  `model.layers.L.mlp.experts.E.gate_proj.weight` [{cfg['moe_intermediate_size']}, {cfg['hidden_size']}],
  `...up_proj.weight` [{cfg['moe_intermediate_size']}, {cfg['hidden_size']}],
  `...down_proj.weight` [{cfg['hidden_size']}, {cfg['moe_intermediate_size']}]; router `model.layers.L.mlp.gate.weight`
  [{E}, {cfg['hidden_size']}]. transformers fuses the experts into `mlp.experts.gate_up_proj` /
  `mlp.experts.down_proj` when it loads them. No `lm_head.weight` (tied to `model.embed_tokens.weight`).
- Tokenizer (`tokenizer.json`): byte-level BPE trained on the synthetic training corpus,
  every digit a single token, special tokens `<|pad|>`=0, `<|bos|>`=1, `<|endoftext|>`=2 (EOS).
  No BOS is added; decoding round-trips the text exactly.

## Data

`moebench.suites.synth`: seeded grade-school word problems in GSM8K's answer format, one
quantity (objects, money, or an amount of stuff) changed by 1 to 5 steps drawn from
{synth.TEMPLATE_COUNT} templates (24 names); each step is a line with a calculator annotation
`<<a+b=c>>c`, and the solution ends with `#### N`. All four operations, division only when
exact; every value below {synth.MAX_VALUE}; the second operand of every step is one digit (2-digit
+/- 1-digit, at most 2-digit x 1-digit, exact division by one digit). Step counts are skewed to short problems (weights
{list(synth.STEP_WEIGHTS)}), so answer lengths vary (P95/P50 of answer tokens >= 2).
Split by a hash of the question text: the 1,000 test items (`gsm-synth/test/N`) are never
seen in training.

Training text is exactly the evaluation format: `Question: {{q}}\\nAnswer: {{answer}}` + EOS;
the loss covers the answer and EOS only.

## Training

`{r['command']}` (`harness/models/train.py`): plain-PyTorch forward with the same math as
transformers' Qwen3MoE (experts run as one matmul per expert over tokens sorted by expert),
AdamW (betas 0.9/0.95, weight decay 0.1), warmup then cosine decay, gradient clipping 1.0,
Switch-style load-balancing loss (coefficient {cfg['router_aux_loss_coef']}), float32, one CPU thread,
fresh problems every step. {r['steps']} steps, {r['train_minutes']} min wall time on a shared
2-core CPU{' (the wall-time budget ended training; the learning-rate schedule follows the larger of step and time progress, so a time-limited run is not bit-reproducible)' if r.get('time_limited') else ''}. The log of loss and held-out greedy accuracy is `train_log.txt`. Weights were rounded to bfloat16 for export; all accuracy figures below are
after that rounding (computed in float32).

## Evaluation (engine-free, through transformers)

`python -c "from moebench.models.train import evaluate_bundle; evaluate_bundle()"`: greedy
`generate` with left padding, zero-shot prompt `Question: {{q}}\\nAnswer:`, stop at EOS,
exact match on the number after `####`.

- Greedy accuracy on the 1,000 held-out test items: **{acc_s}**.
- Expert load on the test split (tokens routed per expert over all positions of
  question+answer text; per layer): max/mean {loads}, min/mean {mins}.
"""
    (Path(out) / "README.md").write_text(text)



def save_bundle(hf, hf_tok, out: Path):
    hf = hf.to(torch.bfloat16)
    hf.config.dtype = "bfloat16"
    hf.generation_config.eos_token_id = EOS_ID
    hf.generation_config.pad_token_id = PAD_ID
    hf.generation_config.bos_token_id = BOS_ID
    hf.generation_config.do_sample = False
    hf.save_pretrained(out, safe_serialization=True)
    hf_tok.save_pretrained(out)


def load_bundle(path: Path = BUNDLED_DIR):
    """(model in float32 from the bf16 checkpoint, tokenizer) through transformers."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(Path(path) / "tokenizer.json"),
                                  pad_token=SPECIALS[PAD_ID], bos_token=SPECIALS[BOS_ID],
                                  eos_token=SPECIALS[EOS_ID], padding_side="left",
                                  clean_up_tokenization_spaces=False)
    return hf.eval(), tok


def evaluate_bundle(path: Path = BUNDLED_DIR, limit: int | None = None, threads: int = 1, log=print,
                    suite: str = "gsm-synth"):
    """Greedy accuracy on the held-out test split of `suite` and expert load, through transformers."""
    from moebench.suites import load_suite
    from moebench.suites.synth import format_training_text

    torch.set_num_threads(threads)
    hf, tok = load_bundle(path)
    items = load_suite(suite, limit=limit).items
    t = time.time()
    acc, outs = greedy_eval(hf, tok, items)
    correct = round(acc * len(items))
    log(f"test greedy accuracy {acc:.4f} ({correct}/{len(items)}) [{time.time()-t:.0f}s]")
    counts = expert_load(hf, tok, [format_training_text(it.question, it.answer) for it in items])
    ratio = counts.max(1).values / counts.mean(1)
    share = counts.min(1).values / counts.mean(1)
    log(f"expert load max/mean per layer {[round(x, 2) for x in ratio.tolist()]}; "
        f"min/mean per layer {[round(x, 2) for x in share.tolist()]}")
    return {"test_items": len(items), "test_correct": correct, "test_accuracy": acc,
            "expert_load_max_over_mean": [round(x, 3) for x in ratio.tolist()],
            "expert_load_min_over_mean": [round(x, 3) for x in share.tolist()]}
