"""Train kvserve's reference model: a small multi-head-attention Llama on the King James Bible.

One command, end to end (data, tokenizer, model, model card)::

    python scripts/train_reference_model.py --out models/kjv-llama-mha

Data: Debian's ``bible-kjv`` package (public domain), every verse printed by
``bible -f "Gen1:1-Rev22:21"``, verse references stripped. A chapter is its verses joined by newlines;
chapters are split deterministically into train and held-out (every 20th chapter, starting at the
10th, is held out: 5%). Tokenizer: byte-level BPE (``tokenizers``) with a vocabulary of 4096 including
the end-of-text token ``<|endoftext|>``, which follows every chapter. Model: ``LlamaForCausalLM`` from
scratch with ``num_key_value_heads == num_attention_heads`` (plain MHA), RoPE, trained on 1024-token
windows with AdamW, linear warm-up and cosine decay, seed 0.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.quality import CALIB_SLICE, EVAL_SLICE, slice_token_ids, teacher_forced_perplexity  # noqa: E402

EOT = "<|endoftext|>"
VERSE = re.compile(r"^(\S+?)(\d+):(\d+) (.*)$")
SAMPLE_PROMPTS = ["And God said", "The LORD is my shepherd", "In the beginning"]


def read_chapters() -> list[str]:
    """Every KJV chapter as text (verses joined by newlines), in canonical order.

    Raises:
        SystemExit: if the ``bible`` command (Debian package ``bible-kjv``) is missing.
    """
    try:
        out = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], check=True, capture_output=True,
                             text=True).stdout
    except FileNotFoundError:
        raise SystemExit("the 'bible' command is missing: apt-get install bible-kjv")
    chapters: list[list[str]] = []
    key = None
    for line in out.splitlines():
        m = VERSE.match(line)
        if not m:
            continue
        book, chapter, _verse, text = m.groups()
        if (book, chapter) != key:
            key = (book, chapter)
            chapters.append([])
        chapters[-1].append(text.strip())
    return ["\n".join(verses) for verses in chapters]


def is_held_out(index: int) -> bool:
    """The deterministic split: chapter ``index`` (0-based, canonical order) is held out when index % 20 == 10."""
    return index % 20 == 10


def train_tokenizer(chapters: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(chapters, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, bos_token=EOT, unk_token=None,
                                   pad_token=EOT, model_max_length=1024, clean_up_tokenization_spaces=False)


def write_slice(path: Path, chapters: list[str], tokenizer, target_tokens: int) -> int:
    """Write whole chapters (blank-line separated) until about ``target_tokens`` tokens; return the count."""
    chosen, count = [], 0
    for chapter in chapters:
        if count >= target_tokens:
            break
        chosen.append(chapter)
        count += len(tokenizer.encode(chapter, add_special_tokens=False)) + 1
    path.write_text("\n\n".join(chosen) + "\n", encoding="utf-8")
    return count


def write_corpus_words(path: Path, chapters: list[str]) -> int:
    """Write every distinct word of the whole corpus (letters and apostrophes), one per line; return the count."""
    words = sorted({w for c in chapters for w in re.findall(r"[A-Za-z']+", c)})
    path.write_text("\n".join(words) + "\n", encoding="utf-8")
    return len(words)


def train_stream(tokenizer) -> torch.Tensor:
    """The training chapters as one token stream (each chapter followed by end-of-text): (tokens,) int64."""
    stream: list[int] = []
    for ids in tokenizer(train_chapters(), add_special_tokens=False).input_ids:
        stream.extend(ids + [tokenizer.eos_token_id])
    return torch.tensor(stream, dtype=torch.long)


def train_chapters() -> list[str]:
    return [c for i, c in enumerate(read_chapters()) if not is_held_out(i)]


def make_optimizer(model, lr: float) -> torch.optim.AdamW:
    """AdamW, betas 0.9/0.95, weight decay 0.1 on matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def train_step(model, opt, data: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator) -> float:
    """One optimiser step on ``batch`` random ``seq_len``-token windows of ``data``; returns the loss."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
    windows = torch.stack([data[s : s + seq_len + 1] for s in starts])  # (batch, seq_len + 1)
    model.train()
    logits = model(input_ids=windows[:, :-1]).logits  # (batch, seq_len, vocab_size)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), windows[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def greedy_sample(model, tokenizer, prompt: str, new_tokens: int = 40) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def write_model_card(out: Path, summary: dict, config) -> None:
    """Write MODEL_CARD.md from the training summary (every figure comes from this run)."""
    samples = "\n".join(f"- **{p}** → {t!r}" for p, t in summary["samples"].items())
    log = "\n".join(f"| {r['step']} | {r['train_loss']} | {r['heldout_ppl']} | {r['minutes']} |" for r in summary["log"])
    card = f"""# kjv-llama-mha — kvserve's reference model

A small Llama (multi-head attention, RoPE) trained from scratch on the King James Bible, so that every
KV backend has a model with learned attention to compress. Trained on a 2-core CPU by:

```
{summary["command"]}
```

## Data
- Source: Debian package `bible-kjv` (public domain), `bible -f "Gen1:1-Rev22:21"`, verse references
  stripped; a chapter is its verses joined by newlines, followed by `<|endoftext|>`.
- Split by whole chapters: chapter *i* (0-based, canonical order) is held out when `i % 20 == 10`
  ({summary["heldout_chapters"]} held-out chapters, {summary["train_chapters"]} train chapters,
  {summary["train_tokens"]:,} train tokens).
- `eval_slice.txt`: the first held-out chapters, {summary["eval_slice_tokens"]:,} tokens.
  `calib_slice.txt`: every 7th train chapter from the 2nd, about {summary["calib_slice_tokens"]:,} tokens.
  Chapters are separated by a blank line; `bench.quality.slice_token_ids` turns a slice into tokens.
- `corpus_words.txt`: every distinct word of the corpus (for the sample test).

## Architecture
`LlamaForCausalLM`: {config.num_hidden_layers} layers, hidden size {config.hidden_size}, {config.num_attention_heads}
attention heads, num_key_value_heads {config.num_key_value_heads} (MHA), head_dim {config.head_dim}, MLP
{config.intermediate_size}, RoPE theta {config.rope_theta if hasattr(config, "rope_theta") else 10000},
max_position_embeddings {config.max_position_embeddings}, tied embeddings,
vocabulary {config.vocab_size} (byte-level BPE trained with `tokenizers`, end-of-text `<|endoftext|>`).
Parameters: {summary["parameters"]:,}.

## Training
AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), linear warm-up then cosine decay to 10%, gradient
clipping 1.0, seed 0, random 1024-token windows of the train stream.
Steps {summary["steps"]}, tokens seen {summary["tokens_seen"]:,}, wall time {summary["wall_time_minutes"]} minutes
(torch {summary["torch"]}, 2 CPU threads).

| step | train loss (EMA) | held-out perplexity | minutes |
|---|---|---|---|
{log}

**Final train loss: {summary["final_train_loss"]}. Held-out perplexity: {summary["heldout_perplexity"]}**
(teacher-forced, non-overlapping {summary["eval_window"]}-token windows over `eval_slice.txt`, fp32;
`bench.quality.teacher_forced_perplexity`; reproduced by `tests/test_reference_model.py`).

## Greedy samples (40 new tokens)
{samples}
"""
    (out / "MODEL_CARD.md").write_text(card)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="models/kjv-llama-mha")
    p.add_argument("--steps", type=int, default=360)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=60)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    chapters = read_chapters()
    train_ch = [c for i, c in enumerate(chapters) if not is_held_out(i)]
    held_ch = [c for i, c in enumerate(chapters) if is_held_out(i)]
    tokenizer = train_tokenizer(train_ch, args.vocab)
    tokenizer.save_pretrained(out)
    eval_tokens = write_slice(out / EVAL_SLICE, held_ch, tokenizer, 20_000)
    write_corpus_words(out / "corpus_words.txt", chapters)
    calib_tokens = write_slice(out / CALIB_SLICE, train_ch[1::7], tokenizer, 20_000)

    data = train_stream(tokenizer)
    stream = data.tolist()
    eval_ids = slice_token_ids(out / EVAL_SLICE, tokenizer)
    print(f"chapters: {len(train_ch)} train / {len(held_ch)} held out; train tokens {len(stream):,}; "
          f"eval slice {eval_tokens:,} tokens; calibration slice {calib_tokens:,} tokens", flush=True)

    eot = tokenizer.eos_token_id
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=704, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=8, head_dim=32, max_position_embeddings=1024,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=eot, eos_token_id=eot,
        pad_token_id=eot, attention_dropout=0.0, torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params:,}", flush=True)

    opt = make_optimizer(model, args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    log: list[dict] = []
    bar = tqdm(range(args.steps), desc="train", mininterval=10)
    loss_ema = None
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        loss = train_step(model, opt, data, args.seq_len, args.batch, gen)
        loss_ema = loss if loss_ema is None else 0.95 * loss_ema + 0.05 * loss
        bar.set_postfix(loss=f"{loss_ema:.3f}", lr=f"{lr_at(step, args):.2e}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            model.eval()
            ppl = teacher_forced_perplexity(model, eval_ids, window=args.seq_len)
            log.append({"step": step + 1, "train_loss": round(loss_ema, 4), "heldout_ppl": round(ppl, 3),
                        "minutes": round((time.time() - t0) / 60, 1)})
            tqdm.write(json.dumps(log[-1]))

    model.eval()
    wall = time.time() - t0
    final_ppl = teacher_forced_perplexity(model, eval_ids, window=args.seq_len)
    model.generation_config.do_sample = False
    model.generation_config.max_new_tokens = 64
    model.save_pretrained(out, safe_serialization=True)
    samples = {prompt: greedy_sample(model, tokenizer, prompt) for prompt in SAMPLE_PROMPTS}
    summary = {
        "command": "python " + " ".join(["scripts/train_reference_model.py"] + sys.argv[1:]),
        "parameters": n_params, "steps": args.steps, "tokens_seen": args.steps * args.batch * args.seq_len,
        "train_tokens": len(stream), "wall_time_minutes": round(wall / 60, 1),
        "final_train_loss": round(loss_ema, 4), "heldout_perplexity": round(final_ppl, 3),
        "eval_window": args.seq_len, "eval_slice_tokens": len(eval_ids), "calib_slice_tokens": calib_tokens,
        "train_chapters": len(train_ch), "heldout_chapters": len(held_ch), "log": log, "samples": samples,
        "torch": torch.__version__,
    }
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_model_card(out, summary, config)
    print(json.dumps({k: v for k, v in summary.items() if k != "log"}, indent=2))


if __name__ == "__main__":
    main()
