"""MHA -> MLA conversion (scripts/convert_mha2mla.py) and the shipped converted model models/kjv-llama-mla."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from bench.quality import EVAL_SLICE, slice_token_ids, teacher_forced_perplexity
from cache_backends.geometry import ModelGeometry
from cache_backends.registry import create
from tests.conftest import MODEL_DIR, REPO
from tests.engine_helpers import make_engine, make_seq, reference_greedy, run_all

sys.path.insert(0, str(REPO / "scripts"))
from convert_mha2mla import (assign_pairs, convert, frequency_counts,  # noqa: E402
                             kv_elements_per_token_per_layer)

MLA_DIR = REPO / "models" / "kjv-llama-mla"
HEADS, HEAD_DIM, HALF = 4, 16, 8


@pytest.fixture(scope="module")
def tiny_llama():
    """A random MHA Llama whose last RoPE pair (lowest frequency) carries nothing in any head: q and k rows zero,
    so the conversion drops it and keeps the other 7 pairs of every head."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                w = proj.weight.view(HEADS, HEAD_DIM, -1)
                w[:, HALF - 1] = 0
                w[:, HEAD_DIM - 1] = 0
    return model


def test_conversion_is_exact_before_low_rank(tiny_llama):
    """Full rank, every pair that matters kept: the MLA model (rope key with each pair's own frequency, the
    softmax scale folded into q_proj, nope keys and values through kv_b_proj) gives the source's logits within
    1e-4, once DeepSeek's latent RMSNorm (which the fine-tune absorbs) is bypassed."""
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(1))
    mla, report = convert(tiny_llama, ids[0].tolist(), rope_pairs=HALF - 1, rank=HEADS * (2 + HEAD_DIM))
    assert all(sorted(head) == list(range(HALF - 1)) for layer in report["rope_pairs"] for head in layer)
    assert max(report["latent_relative_error"]) < 1e-5
    for layer in mla.model.layers:
        layer.self_attn.kv_a_layernorm = torch.nn.Identity()
    with torch.no_grad():
        got, want = mla(ids).logits, tiny_llama(ids).logits
    assert (got - want).abs().max().item() < 1e-4


def test_gqa_source_converts_exactly_with_one_rope_key_per_kv_head():
    """A GQA source (4 query heads reading 2 K/V heads) converts as it is: the kept pairs are chosen per K/V
    head and the rope key holds them once (2 * kv_heads * keep values, not 2 * heads * keep); before low rank,
    with the carrier dimension that makes DeepSeek's latent RMSNorm the identity, the MLA model gives the
    source's logits, norm included."""
    torch.manual_seed(4)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=2, head_dim=HEAD_DIM,
                         max_position_embeddings=256)
    gqa = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in gqa.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                w = proj.weight.view(-1, HEAD_DIM, config.hidden_size)
                w[:, HALF - 1] = 0
                w[:, HEAD_DIM - 1] = 0
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(5))
    rank = HEADS * (2 + HEAD_DIM) + 1  # every direction of keys and values, and the carrier
    mla, report = convert(gqa, ids[0].tolist(), rope_pairs=HALF - 1, rank=rank, latent_norm="carrier")
    assert mla.config.qk_rope_head_dim == 2 * 2 * (HALF - 1) and mla.config.qk_nope_head_dim == 2
    assert [len(layer) for layer in report["rope_pairs"]] == [2, 2]
    assert kv_elements_per_token_per_layer(mla.config) == rank + 2 * 2 * (HALF - 1)
    assert max(report["latent_relative_error"]) < 1e-5
    with torch.no_grad():
        got, want = mla(ids).logits, gqa(ids).logits
    assert (got - want).abs().max().item() < 1e-4


def test_rope_key_keeps_each_pairs_original_frequency(tiny_llama):
    ids = torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    mla, report = convert(tiny_llama, ids, rope_pairs=3, rank=16)
    table = torch.repeat_interleave(torch.arange(HALF), torch.tensor(report["rope_pair_counts"]))
    source = tiny_llama.model.rotary_emb.inv_freq
    assert torch.allclose(mla.model.rotary_emb.inv_freq, source[table], rtol=1e-5)
    assert mla.config.qk_rope_head_dim == 2 * 3 * HEADS and mla.config.kv_lora_rank == 16


def test_pair_assignment_meets_the_shared_frequency_table():
    """Each layer's heads keep exactly ``keep`` distinct pairs and pair j is kept by counts[j] heads: the
    assignment maximises the layer's score under the model's one frequency table."""
    gen = torch.Generator().manual_seed(3)
    scores = [torch.rand(HEADS, HALF, generator=gen) for _ in range(3)]
    counts = frequency_counts(scores, keep=3)
    assert counts.sum() == HEADS * 3 and counts.max() <= HEADS
    for s in scores:
        sel = assign_pairs(s, counts, keep=3)
        assert all(len(set(h.tolist())) == 3 for h in sel)
        assert torch.bincount(sel.reshape(-1), minlength=HALF).tolist() == counts.tolist()


@pytest.fixture(scope="module")
def shipped_mla():
    if not MLA_DIR.exists():
        pytest.fail(f"{MLA_DIR} is missing: python scripts/convert_mha2mla.py")
    return AutoModelForCausalLM.from_pretrained(MLA_DIR).eval(), AutoTokenizer.from_pretrained(MLA_DIR)


def test_shipped_mla_model_is_4x_smaller_and_reproduces_its_card(shipped_mla):
    model, tok = shipped_mla
    source = json.loads((MODEL_DIR / "config.json").read_text())
    assert model.config.model_type == "deepseek_v3"
    ratio = 2 * source["num_key_value_heads"] * source["head_dim"] / kv_elements_per_token_per_layer(model.config)
    assert ratio >= 4
    summary = json.loads((MLA_DIR / "conversion_summary.json").read_text())
    assert str(summary["ppl_final"]) in (MLA_DIR / "MODEL_CARD.md").read_text()
    ppl = teacher_forced_perplexity(model, slice_token_ids(MLA_DIR / EVAL_SLICE, tok), window=summary["seq_len"])
    assert abs(ppl / summary["ppl_final"] - 1) < 0.01, (ppl, summary["ppl_final"])


def test_shipped_mla_model_served_by_mla_with_absorbed_attention(shipped_mla):
    """KV_BACKEND=mla on the converted model caches its latent and rope key only, attends with absorbed
    attention, and greedy-decodes the tokens of ``generate()``, batched."""
    model, tok = shipped_mla
    prompts = ["And God said", "The LORD is my shepherd", "In the beginning God created the heaven"]
    engine = make_engine(model, tok, "mla")
    assert engine.backends["mla"].params() == {"rank": model.config.kv_lora_rank,
                                               "rope_dim": model.config.qk_rope_head_dim, "native": True}
    assert all(type(layer.self_attn).__name__.startswith("Absorbing") for layer in model.model.layers)
    seqs = [make_seq(tok, p, 24, "mla") for p in prompts]
    run_all(engine, seqs)
    assert [s.output_ids for s in seqs] == [reference_greedy(model, tok, p, 24) for p in prompts]
    geometry = ModelGeometry.from_config(model.config, torch.float32)
    assert create("mla", geometry).bytes_per_token_per_layer() == 4 * kv_elements_per_token_per_layer(model.config)


@pytest.mark.parametrize("name", ["full", "mla"])
def test_shipped_mla_model_greedy_tokens_through_the_kernel_equal_the_torch_paths(shipped_mla, name, monkeypatch):
    """The converted model served by ``full`` and ``mla`` (its latent and rope key paged, attended with absorbed
    attention): greedy tokens of a batch with the pages read in place by the attention kernel (KV_ATTENTION=kernel)
    equal those of the torch path (KV_ATTENTION=torch), which gathers them."""
    from cache_backends import kernels

    if not kernels.load():
        pytest.skip(f"the attention kernel is not available: {kernels.status()['reason']}")
    model, tok = shipped_mla
    prompts = ["And God said", "The LORD is my shepherd", "In the beginning God created the heaven and the earth"]
    calls, attend = [], kernels.paged_attention
    monkeypatch.setattr(kernels, "paged_attention", lambda *args: calls.append(1) or attend(*args))
    outputs = {}
    for mode in ("torch", "kernel"):
        with kernels.using(mode):
            engine = make_engine(model, tok, name, prefill_chunk_tokens=8)
            seqs = [make_seq(tok, p, 24, name) for p in prompts]
            run_all(engine, seqs)
            outputs[mode] = [s.output_ids for s in seqs]
            assert bool(calls) == (mode == "kernel")
    assert outputs["kernel"] == outputs["torch"]
