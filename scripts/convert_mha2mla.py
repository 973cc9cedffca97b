"""Convert kvserve's MHA reference model to multi-head latent attention (MHA2MLA) and recover it by fine-tuning.

One command, end to end (conversion, fine-tune, model card)::

    python scripts/convert_mha2mla.py --src models/kjv-llama-mha --out models/kjv-llama-mla

A GQA source (``num_key_value_heads`` < ``num_attention_heads``, e.g. SmolLM2-135M-Instruct) is converted as
it is: its K/V heads are repeated for the query heads that read them, and the kept RoPE pairs are chosen per
K/V head (the query heads of a group share its rope-key slots), so the rope key costs ``2 * kv_heads *
rope_pairs`` values, not ``2 * heads * rope_pairs``. A folder without ``calib_slice.txt``/``eval_slice.txt``
is calibrated and scored on the packaged texts (:func:`bench.quality.model_slice_ids`); ``--bench-windows N``
scores the held-out text as ``kvserve bench`` does (the cache path of ``full`` for the source and of the
native ``mla`` backend for the converted model, N 1024-token windows, the last 256 tokens of each scored).

Method: MHA2MLA (Ji et al., arXiv 2502.14837), in DeepSeek-V3's MLA layout (arXiv 2405.04434) so that
``AutoModelForCausalLM`` loads the result and kvserve's ``mla`` backend serves it with absorbed attention:

1. **Partial RoPE** (the paper's 2-norm criterion): per layer and K/V head, the ``--rope-pairs`` RoPE
   frequency pairs with the largest mean ``|q_pair| * |k_pair|`` (summed over the query heads reading that
   key) on the calibration slice keep RoPE; the other pairs become position-free ("nope") dimensions.
2. **Decoupled rope key**: the kept pairs of all K/V heads form DeepSeek's rope key (``qk_rope_head_dim =
   num_key_value_heads * 2 * rope_pairs``), cached once per token; query head h's rope query is non-zero only
   on its K/V head's pairs, so at conversion ``q_rope_h . k_rope = `` head h's kept-pair score exactly. Each rope-key pair keeps
   its original frequency through ``longrope``'s per-frequency factors (short and long factors equal,
   attention factor 1: a frequency table, no context extension).
3. **Joint low rank**: the position-free key dimensions and the values of all heads are projected on the
   top ``--rank`` principal directions of their calibration activations (uncentred, key and value blocks
   weighted equally): ``kv_a_proj_with_mqa`` maps the hidden state to that latent (``kv_lora_rank``),
   ``kv_b_proj`` back to per-head nope keys and values.
4. **Fine-tune** every weight on the training chapters (``--seq-len``-token windows, AdamW, cosine schedule)
   to recover what steps 1-3 lost; the held-out perplexity is measured before and after. The training
   chapters are the King James Bible's chapters outside the held-out split (``train_reference_model``, Debian's
   ``bible-kjv``); none of them is a chapter of the held-out text (checked).

The softmax scale of the new head width (``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``) is folded into
``q_proj`` so that the converted model scores exactly as the source before low rank. DeepSeek normalises
the latent (``kv_a_layernorm``, an RMSNorm), which the source does not; ``--latent-norm`` chooses how the
conversion meets it:

* ``mean`` (the reference model's recipe): the norm's weight starts at the mean latent RMS on calibration, so
  the conversion is exact up to each token's deviation from that mean, which the fine-tune absorbs. On a
  pretrained model that deviation is not small: tokens whose values are near zero (attention sinks) come out
  of the norm at the mean size (SmolLM2-135M: held-out perplexity 6.4 → 7900 at full rank).
* ``carrier``: the last latent dimension carries a constant ``C`` (the bias of ``kv_a_proj_with_mqa``; ``C``
  = 100 x the largest latent norm on calibration) that nothing reads (its ``kv_b_proj`` column is zero), so
  every token's RMS is ``C / sqrt(rank)`` within 1/20000 and the norm, with that weight (0 on the carrier,
  so that the carrier leaves it as 0), is the identity: the conversion is exact. The latent then holds ``rank - 1`` directions of keys and values.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench.quality import CALIB_SLICE, EVAL_SLICE, model_slice_ids, teacher_forced_perplexity  # noqa: E402
from cache_backends.calibration import slice_file  # noqa: E402
from train_reference_model import (greedy_sample, lr_at, make_optimizer, train_chapters, train_step,  # noqa: E402
                                   train_stream)

COPIED = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", EVAL_SLICE,
          CALIB_SLICE, "corpus_words.txt"]
BENCH_WINDOW, BENCH_PREFIX = 1024, 768  # kvserve bench's perplexity windows and the prefix before scored tokens
SAMPLE_PROMPTS = ["And God said", "The LORD is my shepherd", "In the beginning"]


@torch.no_grad()
def attention_inputs(model, token_ids: list[int], window: int = 1024) -> list[torch.Tensor]:
    """The normalised hidden states entering each layer's attention: per layer a (tokens, hidden_size) tensor."""
    inputs: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    hooks = [layer.self_attn.q_proj.register_forward_hook(
        lambda _m, args, _out, i=i: inputs[i].append(args[0].reshape(-1, args[0].shape[-1])))
        for i, layer in enumerate(model.model.layers)]
    try:
        for start in range(0, len(token_ids), window):
            chunk = token_ids[start:start + window]
            if len(chunk) > 1:
                model(input_ids=torch.tensor([chunk]))
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(x) for x in inputs]


def pair_scores(q: torch.Tensor, k: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """MHA2MLA's 2-norm rule: per K/V head and RoPE pair, the mean ``|q_pair| |k_pair|`` over tokens, summed
    over the query heads that read that key.

    Args:
        q: (tokens, heads * head_dim) pre-RoPE queries; k: (tokens, kv_heads * head_dim) pre-RoPE keys, with
            ``heads`` a multiple of ``kv_heads`` (query head h reads key h // (heads / kv_heads)); pair j of a
            head is dims (j, j + head_dim/2) (transformers' rotate-half layout).
    Returns:
        (kv_heads, head_dim/2) scores.
    """
    half = head_dim // 2
    kv_heads = k.shape[-1] // head_dim
    qn = q.view(-1, kv_heads, heads // kv_heads, 2, half).norm(dim=3)  # (tokens, kv_heads, group, half)
    kn = k.view(-1, kv_heads, 1, 2, half).norm(dim=3)
    return (qn * kn).mean(0).sum(1)


def frequency_counts(scores: list[torch.Tensor], keep: int) -> torch.Tensor:
    """How many heads keep each RoPE pair (frequency), one multiset for every layer: the model has one
    frequency table. The layers' unconstrained top-``keep`` choices, averaged and rounded (largest remainders)
    to ``heads * keep`` in all. Returns (head_dim/2,) integer counts, each at most ``heads``."""
    heads, half = scores[0].shape
    votes = torch.zeros(half, dtype=torch.float64)
    for s in scores:
        votes += torch.zeros(half, dtype=torch.float64).index_add_(
            0, s.topk(keep, dim=-1).indices.reshape(-1), torch.ones(heads * keep, dtype=torch.float64))
    votes /= len(scores)
    counts = votes.floor()
    order = (votes - counts).argsort(descending=True)
    counts[order[: heads * keep - int(counts.sum())]] += 1
    return counts.long()


def assign_pairs(score: torch.Tensor, counts: torch.Tensor, keep: int) -> torch.Tensor:
    """The pairs each head of one layer keeps: maximise the summed scores with exactly ``keep`` distinct pairs
    per head and pair j kept by exactly ``counts[j]`` heads (a transportation problem; its LP relaxation is
    integral, solved by HiGHS' simplex). Returns (heads, keep) pair indices, ascending."""
    from scipy.optimize import linprog

    heads, half = score.shape
    n = heads * half
    rows = torch.zeros(heads + half, n, dtype=torch.float64)  # x[h, j] flattened h-major
    for h in range(heads):
        rows[h, h * half:(h + 1) * half] = 1
    for j in range(half):
        rows[heads + j, j::half] = 1
    rhs = torch.cat([torch.full((heads,), float(keep), dtype=torch.float64), counts.double()])
    res = linprog(-score.double().reshape(-1).numpy(), A_eq=rows.numpy(), b_eq=rhs.numpy(), bounds=(0, 1),
                  method="highs-ds")
    if res.status != 0:
        raise RuntimeError(f"RoPE pair assignment failed: {res.message}")
    x = torch.from_numpy(res.x).view(heads, half)
    return x.topk(keep, dim=-1).indices.sort(dim=-1).values


def rope_slots(selections: list[torch.Tensor], counts: torch.Tensor) -> list[torch.Tensor]:
    """Where each (head, kept pair) of each layer sits in the shared rope key: slot s has the frequency of pair
    ``table[s]`` (``table`` = pairs in ascending order, pair j repeated ``counts[j]`` times); within a layer each
    slot serves one head. Returns per layer a (heads, keep) tensor of slot indices."""
    table = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    out = []
    for sel in selections:
        free = {int(j): (table == j).nonzero().flatten().tolist() for j in counts.nonzero().flatten()}
        out.append(torch.tensor([[free[int(j)].pop(0) for j in head] for head in sel]))
    return out


def joint_latent(y: torch.Tensor, split: int, rank: int) -> torch.Tensor:
    """Top ``rank`` uncentred principal directions of ``y`` (tokens, width), its first ``split`` columns (keys)
    and the rest (values) weighted to equal total energy. Returns (width, rank) with orthonormal columns in the
    weighted space, mapped back (so ``y @ P @ P_pinv`` is the rank-``rank`` approximation of ``y``)."""
    w = torch.ones(y.shape[1], dtype=torch.float64)
    ek, ev = y[:, :split].double().pow(2).sum(), y[:, split:].double().pow(2).sum()
    if ek > 0 and ev > 0:  # a block of zeros (nothing to balance) keeps weight 1
        w[split:] = (ek / ev).sqrt()
    yw = y.double() * w
    _, vecs = torch.linalg.eigh(yw.T @ yw)
    return vecs[:, -rank:].flip(-1), w  # (width, rank) in the weighted space, and the weights


def rope_frequency_factors(table: torch.Tensor, head_dim: int, theta: float) -> list[float]:
    """``longrope`` short/long factors that give rope-key slot i the original frequency of pair ``table[i]``:
    ``inv_freq_i = 1 / (factor_i * theta ** (2 i / R))`` must equal ``theta ** (-2 table[i] / head_dim)``."""
    j = table.double()
    i = torch.arange(j.numel(), dtype=torch.float64)
    return (theta ** (2 * j / head_dim) / theta ** (2 * i / (2 * j.numel()))).tolist()


def build_config(src, table: torch.Tensor, keep: int, rank: int) -> DeepseekV3Config:
    """The DeepSeek-V3 config of the converted model: dense MLP in every layer, no query low rank,
    ``qk_rope_head_dim = 2 * len(table)``, ``qk_nope_head_dim = head_dim - 2 * keep``, ``v_head_dim = head_dim``."""
    heads, head_dim = src.num_attention_heads, src.head_dim
    theta = src.rope_parameters["rope_theta"]
    factors = rope_frequency_factors(table, head_dim, theta)
    return DeepseekV3Config(
        vocab_size=src.vocab_size, hidden_size=src.hidden_size, intermediate_size=src.intermediate_size,
        num_hidden_layers=src.num_hidden_layers, num_attention_heads=heads, num_key_value_heads=heads,
        q_lora_rank=None, kv_lora_rank=rank, qk_rope_head_dim=2 * table.numel(),
        qk_nope_head_dim=head_dim - 2 * keep, v_head_dim=head_dim,
        first_k_dense_replace=src.num_hidden_layers, n_routed_experts=1, n_shared_experts=0,
        num_experts_per_tok=1, n_group=1, topk_group=1,
        hidden_act=src.hidden_act, max_position_embeddings=src.max_position_embeddings,
        rms_norm_eps=src.rms_norm_eps, tie_word_embeddings=src.tie_word_embeddings, rope_interleave=False,
        rope_parameters={"rope_type": "longrope", "rope_theta": theta, "short_factor": factors,
                         "long_factor": factors, "original_max_position_embeddings": src.max_position_embeddings,
                         "factor": 1.0, "attention_factor": 1.0},
        bos_token_id=src.bos_token_id, eos_token_id=src.eos_token_id, pad_token_id=src.pad_token_id,
        attention_bias=False, attention_dropout=0.0, dtype="float32",
    )


@torch.no_grad()
def convert(src_model, calib_ids: list[int], rope_pairs: int, rank: int,
            latent_norm: str = "mean") -> tuple[DeepseekV3ForCausalLM, dict]:
    """Build the MLA model from the MHA one (steps 1-3 of the module docstring).

    Args:
        src_model: a ``LlamaForCausalLM``-style MHA or GQA model (q/k/v/o projections without bias,
            rotate-half RoPE).
        calib_ids: calibration token ids (activations for the pair scores and the latent).
        rope_pairs: RoPE pairs kept per head; rank: ``kv_lora_rank``.
        latent_norm: ``"mean"`` or ``"carrier"`` (module docstring).
    Returns:
        the converted model and a report: kept pairs per layer and K/V head, the latent's relative
        reconstruction error per layer on calibration, the spread (std / mean) of the latent's RMS.
    Raises:
        ValueError: if the query heads do not divide evenly among the K/V heads, ``rope_pairs``/``rank`` are
            out of range or ``latent_norm`` is unknown.
    """
    cfg = src_model.config
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    half = d // 2
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    group = heads // kv_heads
    if not 1 <= rope_pairs < half:
        raise ValueError(f"--rope-pairs must be between 1 and {half - 1}")
    nope = d - 2 * rope_pairs
    if latent_norm not in ("mean", "carrier"):
        raise ValueError(f"--latent-norm must be 'mean' or 'carrier', got {latent_norm!r}")
    carrier = latent_norm == "carrier"
    if not 1 + carrier <= rank <= heads * (nope + d) + carrier:
        raise ValueError(f"--rank must be between {1 + carrier} and {heads * (nope + d) + carrier}")
    xs = attention_inputs(src_model, calib_ids)
    scores = [pair_scores(l.self_attn.q_proj(x), l.self_attn.k_proj(x), heads, d)
              for l, x in zip(src_model.model.layers, xs)]
    counts = frequency_counts(scores, rope_pairs)
    selections = [assign_pairs(s, counts, rope_pairs) for s in scores]
    slots = rope_slots(selections, counts)
    table = torch.repeat_interleave(torch.arange(half), counts)
    config = build_config(cfg, table, rope_pairs, rank)
    config.attention_bias = carrier  # the carrier's constant is kv_a_proj_with_mqa's bias (o_proj's stays 0)
    model = DeepseekV3ForCausalLM(config).eval()
    sd = {k: v for k, v in src_model.state_dict().items() if "self_attn" not in k}
    missing = model.load_state_dict(sd, strict=False).missing_keys
    if any("self_attn" not in k for k in missing):
        raise ValueError(f"the source model lacks weights the MLA layout needs: {missing}")
    scale = math.sqrt((config.qk_nope_head_dim + config.qk_rope_head_dim) / d)  # fold the new softmax scale
    slots_total = table.numel()
    report = {"rope_pair_counts": counts.tolist(), "rope_pairs": [], "pair_score_kept": [],
              "latent_relative_error": [], "latent_rms_spread": []}
    for src_layer, dst_layer, x, sel, slot, score in zip(src_model.model.layers, model.model.layers, xs,
                                                         selections, slots, scores):
        a, b = src_layer.self_attn, dst_layer.self_attn
        wq, wk = a.q_proj.weight.view(heads, d, -1), a.k_proj.weight.view(kv_heads, d, -1)
        hidden = wq.shape[-1]
        wv = a.v_proj.weight.view(kv_heads, d, hidden).repeat_interleave(group, 0).reshape(heads * d, hidden)
        # the rope key (rotate-half layout): slot s holds x1 at row s and x2 at row slots_total + s
        k_rope = torch.zeros(2 * slots_total, hidden)
        q_rows, k_nope_rows = [], []
        for g in range(kv_heads):
            k_rope[slot[g]], k_rope[slot[g] + slots_total] = wk[g, sel[g]], wk[g, sel[g] + half]
        for h in range(heads):
            g = h // group  # the K/V head query head h reads
            kept = set(sel[g].tolist()) | {j + half for j in sel[g].tolist()}
            nope_dims = [j for j in range(d) if j not in kept]
            q_rope = torch.zeros(2 * slots_total, hidden)  # head h reads only its K/V head's slots
            q_rope[slot[g]], q_rope[slot[g] + slots_total] = wq[h, sel[g]], wq[h, sel[g] + half]
            q_rows.append(torch.cat([wq[h, nope_dims], q_rope]))
            k_nope_rows.append(wk[g, nope_dims])
        b.q_proj.weight.copy_(torch.cat(q_rows) * scale)
        # the joint latent of every head's position-free keys and values
        w_kv = torch.cat(k_nope_rows + [wv])  # (heads*(nope+d), hidden)
        y = x @ w_kv.T  # (tokens, width)
        informative = rank - carrier
        basis, weights = joint_latent(y, heads * nope, informative)
        down = (basis.T * weights).float()  # (informative, width): latent = down @ y
        up = (basis / weights[:, None]).float()  # (width, informative): y ≈ up @ latent
        latent = y @ down.T  # (tokens, informative)
        rms = latent.pow(2).mean(-1).sqrt()
        mean_rms = rms.mean()
        down_w = down @ w_kv
        if carrier:  # a last latent dimension held at C by the bias, read by nothing: RMSNorm is then the identity
            c = 100 * float(latent.norm(dim=-1).max())
            down_w, up = torch.cat([down_w, torch.zeros(1, hidden)]), torch.cat([up, torch.zeros(len(up), 1)], 1)
            b.kv_a_proj_with_mqa.bias.zero_()
            b.kv_a_proj_with_mqa.bias[informative] = c
            b.kv_a_layernorm.weight.fill_(c / math.sqrt(rank))
            b.kv_a_layernorm.weight[informative] = 0  # the carrier leaves the norm as 0 (not C: that would make
            # kv_b_proj's first updates of its zero column add C-sized noise to every key and value)
            b.o_proj.bias.zero_()
        else:
            b.kv_a_layernorm.weight.fill_(float(mean_rms))  # RMSNorm(latent) * mean RMS ≈ latent
        b.kv_a_proj_with_mqa.weight.copy_(torch.cat([down_w, k_rope]))
        up_k, up_v = up[: heads * nope].view(heads, nope, rank), up[heads * nope:].view(heads, d, rank)
        b.kv_b_proj.weight.copy_(torch.cat([up_k, up_v], dim=1).reshape(-1, rank))
        b.o_proj.weight.copy_(a.o_proj.weight)
        report["rope_pairs"].append(sel.tolist())
        report["pair_score_kept"].append(round(float(score.gather(1, sel).sum() / score.sum()), 4))
        report["latent_relative_error"].append(round(float((latent @ up[:, :informative].T - y).norm() / y.norm()), 4))
        report["latent_rms_spread"].append(round(float(rms.std() / mean_rms), 4))
    return model, report


def kv_elements_per_token_per_layer(config) -> int:
    """Cached elements per token per layer: K and V (MHA) or the latent plus the rope key (MLA)."""
    if getattr(config, "kv_lora_rank", None):
        return config.kv_lora_rank + config.qk_rope_head_dim
    return 2 * config.num_key_value_heads * config.head_dim


def kv_bytes_per_token(config) -> int:
    """Bytes per token of kvserve's cache for this model in fp32, all layers: ``full`` for an MHA/GQA model,
    the native ``mla`` backend's latent and rope key for an MLA one (the backend's own count)."""
    from cache_backends.geometry import ModelGeometry
    from cache_backends.registry import create

    geometry = ModelGeometry.from_config(config, torch.float32)
    backend = create("mla" if geometry.kv_lora_rank else "full", geometry)
    return backend.bytes_per_token_per_layer() * geometry.num_layers


def bench_perplexity(model, token_ids: list[int], windows: int) -> float:
    """Held-out perplexity as ``kvserve bench`` scores it (:func:`bench.fidelity.cache_path_perplexity`):
    ``windows`` 1024-token windows, 768 tokens prefilled, the rest scored token by token through the cache path
    of ``full`` (an MHA/GQA model) or of the native ``mla`` backend (absorbed attention over the cached latent).
    Scored on a copy: the backend switches the model's attention modules."""
    import copy

    from bench.fidelity import cache_path_perplexity
    from cache_backends.geometry import ModelGeometry
    from cache_backends.registry import create

    scored = copy.deepcopy(model).eval()
    geometry = ModelGeometry.from_config(scored.config, torch.float32)
    backend = create("mla" if geometry.kv_lora_rank else "full", geometry)
    backend.prepare(scored, [])
    return cache_path_perplexity(scored, backend, token_ids, window=BENCH_WINDOW, prefix=BENCH_PREFIX,
                                 max_windows=windows)


def check_held_out(eval_path: Path) -> None:
    """Refuse to fine-tune on a chapter of the held-out text.

    Raises:
        SystemExit: naming how many chapters of ``eval_path`` are training chapters too.
    """
    held = {c.strip("\n") for c in eval_path.read_text(encoding="utf-8").split("\n\n") if c.strip()}
    shared = held & set(train_chapters())
    if shared:
        raise SystemExit(f"{len(shared)} chapters of {eval_path} are training chapters: not a held-out text")


def fine_tune(model, args, heldout) -> list[dict]:
    """Step 4: train every weight on the training chapters; ``heldout(model)`` (the held-out perplexity) every
    ``--eval-every`` steps and after the last."""
    data = train_stream(AutoTokenizer.from_pretrained(args.src))
    opt = make_optimizer(model, args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    log, loss_ema, t0 = [], None, time.time()
    bar = tqdm(range(args.steps), desc="fine-tune", mininterval=10)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        loss = train_step(model, opt, data, args.seq_len, args.batch, gen)
        loss_ema = loss if loss_ema is None else 0.95 * loss_ema + 0.05 * loss
        bar.set_postfix(loss=f"{loss_ema:.3f}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            model.eval()
            log.append({"step": step + 1, "train_loss": round(loss_ema, 4),
                        "heldout_ppl": round(heldout(model), 3),
                        "minutes": round((time.time() - t0) / 60, 1)})
            tqdm.write(json.dumps(log[-1]))
    model.eval()
    return log


def write_model_card(out: Path, s: dict) -> None:
    """MODEL_CARD.md from the run's summary (every figure comes from this run)."""
    log = "\n".join(f"| {r['step']} | {r['train_loss']} | {r['heldout_ppl']} | {r['minutes']} |" for r in s["log"])
    samples = "\n".join(f"- **{p}** → {t!r}" for p, t in s["samples"].items())
    counts = ", ".join(f"pair {j}: {c}" for j, c in enumerate(s["conversion"]["rope_pair_counts"]) if c)
    rows = "\n".join(f"| {i} | {s['conversion']['pair_score_kept'][i]} | {s['conversion']['latent_relative_error'][i]} |"
                     f" {s['conversion']['latent_rms_spread'][i]} |" for i in range(len(s["conversion"]["rope_pairs"])))
    control_row = ""
    if (out / "control.json").exists():
        c = json.loads((out / "control.json").read_text())
        control_row = (f"| control: the MHA source fine-tuned by the same recipe (`{c['command']}`, "
                       f"{c['minutes']} minutes) | {c['ppl_final']} | {c['ppl_final'] / s['ppl_source'] - 1:+.1%} |\n"
                       f"| **converted vs control** (the cost of MLA at equal training) | | "
                       f"**{s['ppl_final'] / c['ppl_final'] - 1:+.1%}** |\n")
    card = f"""# {out.name} — {Path(s["src"]).name} converted to multi-head latent attention

`{s["src"]}` converted MHA → MLA with partial RoPE and a joint K/V latent (MHA2MLA, Ji et al., arXiv
2502.14837), in DeepSeek-V3's layout (`DeepseekV3ForCausalLM`, arXiv 2405.04434): `AutoModelForCausalLM`
loads it, and `MODEL_ID={out} KV_BACKEND=mla` serves it with absorbed attention over the
cached latent. Made by:

```
{s["command"]}
```

## KV cache
| | cached elements per token per layer | bytes per token (fp32, {s["layers"]} layers) |
|---|---|---|
| source (K and V, {s.get("kv_heads", s["heads"])} K/V heads x head_dim {s["head_dim"]}) | {s["mha_elements"]} | {4 * s["mha_elements"] * s["layers"]:,} |
| this model (kv_lora_rank {s["rank"]} + rope key {s["rope_dim"]}) | {s["mla_elements"]} | {4 * s["mla_elements"] * s["layers"]:,} |

**{s["mha_elements"] / s["mla_elements"]:.1f}x smaller KV cache.**

## Recipe
1. Partial RoPE: {s["rope_pairs"]} of {s["head_dim"] // 2} RoPE pairs kept per K/V head, chosen per layer and head by the
   2-norm rule (largest mean |q_pair| |k_pair| on {s["calib_tokens"]:,} calibration tokens), under one
   frequency table for the model (kept-pair counts: {counts}); the other pairs are position-free.
2. The kept pairs of all heads form the shared rope key (qk_rope_head_dim {s["rope_dim"]}; head h's rope query
   reads only its own pairs at conversion; `longrope` factors hold each pair's original frequency).
3. Joint low rank of every head's position-free keys and values: kv_lora_rank {s["rank"]} (top principal
   directions of their calibration activations, keys and values weighted to equal energy).
4. Fine-tune of every weight on the training chapters: {s["steps"]} steps of {s["batch"]} x {s["seq_len"]} tokens
   ({s["steps"] * s["batch"] * s["seq_len"]:,} tokens), AdamW lr {s["lr"]} (warm-up {s["warmup"]}, cosine to
   {s["min_lr_ratio"]:.0%}), seed {s["seed"]}; {s["fine_tune_minutes"]} minutes on {s["threads"]} CPU threads
   (torch {s["torch"]}).

| layer | share of the 2-norm score kept by RoPE | latent relative error (calibration) | latent RMS spread |
|---|---|---|---|
{rows}

## Held-out perplexity
{s.get("heldout", f"Teacher-forced, non-overlapping {s['seq_len']}-token windows over `eval_slice.txt`, fp32 "
   "(`bench.quality.teacher_forced_perplexity`).")}

| model | perplexity | vs MHA source |
|---|---|---|
| MHA source | {s["ppl_source"]} | |
| converted, before fine-tune | {s["ppl_converted"]} | {s["ppl_converted"] / s["ppl_source"] - 1:+.1%} |
| converted, after fine-tune | {s["ppl_final"]} | {s["ppl_final"] / s["ppl_source"] - 1:+.1%} |
{control_row}
| step | train loss (EMA) | held-out perplexity | minutes |
|---|---|---|---|
{log}

## Greedy samples (40 new tokens)
{samples}
"""
    (out / "MODEL_CARD.md").write_text(card)


def control(args) -> None:
    """``--control``: the same fine-tune on the unconverted MHA model; rewrites the model card with it."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    src, out = Path(args.src), Path(args.out)
    tokenizer = AutoTokenizer.from_pretrained(src)
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    t0 = time.time()
    eval_ids = model_slice_ids(src, EVAL_SLICE, tokenizer)
    log = fine_tune(source, args, heldout_scorer(args, eval_ids))
    result = {"command": "python " + " ".join(["scripts/convert_mha2mla.py"] + sys.argv[1:]),
              "ppl_final": log[-1]["heldout_ppl"], "minutes": round((time.time() - t0) / 60, 1), "log": log}
    (out / "control.json").write_text(json.dumps(result, indent=2) + "\n")
    write_model_card(out, json.loads((out / "conversion_summary.json").read_text()))


def heldout_scorer(args, eval_ids: list[int]):
    """The held-out perplexity of a model: ``kvserve bench``'s (``--bench-windows``) or teacher-forced
    ``--seq-len`` windows over the whole held-out slice."""
    if args.bench_windows:
        return lambda model: bench_perplexity(model, eval_ids, args.bench_windows)
    return lambda model: teacher_forced_perplexity(model, eval_ids, window=args.seq_len)


def heldout_description(args) -> str:
    if args.bench_windows:
        return (f"As `kvserve bench --windows {args.bench_windows}` scores it (`bench.fidelity.cache_path_perplexity`):"
                f" {args.bench_windows} windows of {BENCH_WINDOW} tokens of the held-out text, {BENCH_PREFIX} prefilled,"
                f" the last {BENCH_WINDOW - BENCH_PREFIX} scored token by token through the cache path (`full` for the"
                f" source, the native `mla` backend for the converted model), fp32.")
    return (f"Teacher-forced, non-overlapping {args.seq_len}-token windows over `eval_slice.txt`, fp32 "
            "(`bench.quality.teacher_forced_perplexity`).")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", default="models/kjv-llama-mha")
    p.add_argument("--out", default="models/kjv-llama-mla")
    p.add_argument("--rope-pairs", type=int, default=6, help="RoPE pairs kept per head")
    p.add_argument("--rank", type=int, default=32, help="kv_lora_rank")
    p.add_argument("--latent-norm", choices=["mean", "carrier"], default="mean",
                   help="how the conversion meets DeepSeek's latent RMSNorm: its weight at the mean latent RMS "
                        "(the reference model's recipe), or a constant carrier dimension that makes it the "
                        "identity (exact; for pretrained models)")
    p.add_argument("--converted-ppl", type=float, default=None,
                   help="the converted model's held-out perplexity before fine-tune, when already measured by a "
                        "run of the same conversion (skips scoring it again)")
    p.add_argument("--source-ppl", type=float, default=None,
                   help="the source's held-out perplexity by the same scoring, when already measured (skips "
                        "scoring the source again)")
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bench-windows", type=int, default=0,
                   help="score the held-out text as kvserve bench --windows N does (the cache path, N 1024-token "
                        "windows, the last 256 tokens of each) instead of teacher-forced --seq-len windows")
    p.add_argument("--control", action="store_true",
                   help="fine-tune the unchanged MHA source with the same recipe (no conversion) and record its "
                        "held-out perplexity in OUT/control.json and the model card: the share of the recovery "
                        "that is just more training")
    args = p.parse_args()
    if args.control:
        return control(args)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    src, out = Path(args.src), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(src)
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    calib_ids = model_slice_ids(src, CALIB_SLICE, tokenizer)[: args.calib_tokens]
    eval_ids = model_slice_ids(src, EVAL_SLICE, tokenizer)
    if args.steps:
        check_held_out(slice_file(src, EVAL_SLICE))
    heldout = heldout_scorer(args, eval_ids)
    t_start = time.time()
    ppl_source = args.source_ppl or heldout(source)
    model, report = convert(source, calib_ids, args.rope_pairs, args.rank, args.latent_norm)
    ppl_converted = args.converted_ppl or heldout(model)
    print(json.dumps({"ppl_source": ppl_source, "ppl_converted": ppl_converted, **report}), flush=True)
    t0 = time.time()
    log = fine_tune(model, args, heldout) if args.steps else []
    minutes = round((time.time() - t0) / 60, 1)
    ppl_final = log[-1]["heldout_ppl"] if log else ppl_converted
    model.generation_config.do_sample = False
    model.generation_config.max_new_tokens = 64
    model.save_pretrained(out, safe_serialization=True)
    for name in COPIED:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    cfg = model.config
    summary = {
        "command": "python " + " ".join(["scripts/convert_mha2mla.py"] + sys.argv[1:]), "src": str(src),
        "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads, "head_dim": source.config.head_dim,
        "kv_heads": source.config.num_key_value_heads, "source_kv_bytes_per_token": kv_bytes_per_token(source.config),
        "kv_bytes_per_token": kv_bytes_per_token(cfg), "heldout": heldout_description(args),
        "train_tokens": args.steps * args.batch * args.seq_len,
        "rope_pairs": args.rope_pairs, "rank": args.rank, "rope_dim": cfg.qk_rope_head_dim,
        "latent_norm": args.latent_norm,
        "mha_elements": kv_elements_per_token_per_layer(source.config),
        "mla_elements": kv_elements_per_token_per_layer(cfg), "calib_tokens": len(calib_ids),
        "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr, "warmup": args.warmup,
        "min_lr_ratio": args.min_lr_ratio, "seed": args.seed, "threads": args.threads, "torch": torch.__version__,
        "fine_tune_minutes": minutes, "ppl_source": round(ppl_source, 3), "ppl_converted": round(ppl_converted, 3),
        "ppl_final": round(ppl_final, 3), "log": log, "conversion": report,
        "samples": {q: greedy_sample(model, tokenizer, q) for q in SAMPLE_PROMPTS},
        "total_minutes": round((time.time() - t_start) / 60, 1),
    }
    (out / "conversion_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_model_card(out, summary)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("log", "conversion")}, indent=2))


if __name__ == "__main__":
    main()
