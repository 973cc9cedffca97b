"""mla on a native-MLA model: a tiny randomly initialised DeepseekV3 built here caches its own latent."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from cache_backends import ModelGeometry, create
from server.engine.runner import ModelRunner


@pytest.fixture(scope="module")
def tiny_deepseek():
    torch.manual_seed(0)
    config = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                              n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                              first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                              qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256)
    return DeepseekV3ForCausalLM(config).eval()


def test_native_mla_caches_the_models_latent_and_rope_key(tiny_deepseek):
    model = tiny_deepseek
    geometry = ModelGeometry.from_config(model.config, torch.float32)
    backend = create("mla", geometry)
    backend.prepare(model)
    assert backend.params() == {"rank": 16, "rope_dim": 8, "native": True}
    ids = torch.randint(0, 128, (40,)).tolist()
    runner = ModelRunner(model, geometry.num_layers)
    store = backend.new_store()
    logits = [runner.prefill(ids[:30], store)[-1]]
    for t in ids[30:-1]:
        logits.append(runner.decode([t], [store])[0])
    with torch.no_grad():
        reference = model(torch.tensor([ids[:-1]])).logits[0, 29:]
    assert (torch.stack(logits) - reference).abs().max().item() < 1e-4
    layer = store.layers[0]
    latent, rope_key = layer.materialize()
    assert latent.shape == (1, 1, 39, 16) and rope_key.shape == (1, 1, 39, 8)  # latent, rope key
    assert store.nbytes() == (16 + 8) * 4 * 39 * 3 == backend.bytes_per_token_per_layer() * 39 * 3


def test_native_mla_refuses_another_rank(tiny_deepseek):
    geometry = ModelGeometry.from_config(tiny_deepseek.config, torch.float32)
    with pytest.raises(ValueError, match="kv_lora_rank=16"):
        create("mla", geometry, rank=8)


def test_absorbed_attention_batched_matches_the_models_own_attention(tiny_deepseek):
    """mla on native MLA decodes a ragged batch with absorbed attention (W_UK folded into the query, W_UV
    after attention, the latent never expanded): each row's logits equal the model's own forward, 1e-4."""
    model = tiny_deepseek
    geometry = ModelGeometry.from_config(model.config, torch.float32)
    backend = create("mla", geometry)
    backend.prepare(model)
    assert all(type(layer.self_attn).__name__.startswith("Absorbing") for layer in model.model.layers)
    runner = ModelRunner(model, geometry.num_layers)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (9, 17, 30)]
    stores = [backend.new_store() for _ in prompts]
    for ids, store in zip(prompts, stores):
        runner.prefill(ids[:-1], store)
    batched = runner.decode([ids[-1] for ids in prompts], stores)
    for row, ids in enumerate(prompts):
        with torch.no_grad():
            reference = model(torch.tensor([ids])).logits[0, -1]
        assert (batched[row] - reference).abs().max().item() < 1e-4, row
