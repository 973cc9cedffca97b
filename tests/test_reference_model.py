"""The shipped reference model: loads offline, reproduces its model card's perplexity, writes KJV words."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from bench.quality import EVAL_SLICE, slice_token_ids, teacher_forced_perplexity
from tests.conftest import MODEL_DIR, REPO

PROMPTS = ["And God said", "The LORD is my shepherd", "In the beginning", "Blessed are the", "And Jesus answered"]


def test_loads_offline_in_a_fresh_process():
    code = ("from transformers import AutoModelForCausalLM, AutoTokenizer; import sys; "
            "m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); t = AutoTokenizer.from_pretrained(sys.argv[1]); "
            "print(m.config.model_type, m.config.num_key_value_heads, t.eos_token)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code, str(MODEL_DIR)], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    assert out == ["llama", "8", "<|endoftext|>"]


def test_architecture_matches_the_brief(ref_model):
    model, tok = ref_model
    c = model.config
    assert c.num_key_value_heads == c.num_attention_heads and c.num_hidden_layers >= 8
    assert c.head_dim == 32 and c.hidden_size == 256 and c.max_position_embeddings >= 1024
    assert sum(p.numel() for p in model.parameters()) <= 10_000_000
    assert 3500 <= len(tok) <= 4600
    size = sum(f.stat().st_size for f in MODEL_DIR.iterdir())
    assert size <= 40 * 2**20


def test_heldout_perplexity_reproduces_the_model_card(ref_model):
    model, tok = ref_model
    summary = json.loads((MODEL_DIR / "training_summary.json").read_text())
    card = (MODEL_DIR / "MODEL_CARD.md").read_text()
    assert str(summary["heldout_perplexity"]) in card
    ppl = teacher_forced_perplexity(model, slice_token_ids(MODEL_DIR / EVAL_SLICE, tok), window=summary["eval_window"])
    assert abs(ppl / summary["heldout_perplexity"] - 1) < 0.02, (ppl, summary["heldout_perplexity"])


def test_slices_have_about_20k_tokens(ref_model):
    _, tok = ref_model
    for name in ("eval_slice.txt", "calib_slice.txt"):
        n = len(slice_token_ids(MODEL_DIR / name, tok))
        assert 18_000 <= n <= 23_000, (name, n)


def test_greedy_continuations_are_corpus_words(ref_model):
    model, tok = ref_model
    words = set((MODEL_DIR / "corpus_words.txt").read_text().split())
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=tok.eos_token_id)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        generated = re.findall(r"[A-Za-z']+", text)
        assert len(generated) >= 5, text
        unknown = [w for w in generated[:-1] if w not in words]  # the last word may be cut mid-way
        assert not unknown, (prompt, text, unknown)


def test_training_script_is_shipped():
    assert (REPO / "scripts" / "train_reference_model.py").exists()
    summary = json.loads((MODEL_DIR / "training_summary.json").read_text())
    assert summary["command"].startswith("python scripts/train_reference_model.py")


def test_load_model_leaves_hub_kernels_off(monkeypatch):
    """kvserve loads its model with transformers' hub kernels off: where the ``kernels`` package is missing or of
    another version (a CUDA image's own), ``from_pretrained``'s default asks for them and raises; and they would
    replace layers with code fetched from the Hub, which an offline server cannot do."""
    import torch
    from transformers import modeling_utils

    from server.model_loading import load_model

    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    monkeypatch.setattr(modeling_utils, "is_kernels_available", lambda *a, **k: False)
    model, _ = load_model(str(MODEL_DIR), torch.device("cpu"), torch.float32)
    assert model.use_kernels is False
