"""mla on a native-MLA model: a tiny randomly initialised DeepseekV3 built here caches its own latent (values
checked in each precision under test, :mod:`tests.precision`)."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from cache_backends import kernels
from cache_backends.geometry import ModelGeometry
from cache_backends.registry import create
from cache_backends.page_plan import SeqBlocks
from cache_backends.paged import in_place_layer
from cache_backends.store_path import StorePath
from tests.engine_helpers import PagedDriver


# num_experts_per_tok = n_routed_experts: no discontinuous top-k routing (tests/test_arch_matrix.py says why).
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
              num_experts_per_tok=4, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
              q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256)


@pytest.fixture(scope="module")
def tiny_deepseek(precision):
    """The model (weights drawn in fp32 with seed 0) on the device and in the dtype under test."""
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(DeepseekV3Config(**CONFIG)).eval().to(precision.device, precision.dtype)


def cache_path_and_reference(model, backend, seed: int):
    """40 random tokens: 30 prefilled, 9 decoded through ``backend``; returns the store, the 10 logits rows of the
    cache path and the model's own forward's rows for the same positions."""
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
    runner = StorePath(model, backend.geometry.num_layers)
    store = backend.new_store()
    logits = [runner.prefill(ids[:30], store)[-1]]
    for t in ids[30:-1]:
        logits.append(runner.decode([t], [store])[0])
    with torch.no_grad():
        reference = model(torch.tensor([ids[:-1]], device=model.device)).logits[0, 29:]
    return store, torch.stack(logits), reference


def test_native_mla_caches_the_models_latent_and_rope_key(tiny_deepseek, precision):
    model = tiny_deepseek
    geometry = ModelGeometry.from_config(model.config, model.dtype)
    backend = create("mla", geometry)
    backend.prepare(model)
    assert backend.params() == {"rank": 16, "rope_dim": 8, "native": True}
    store, logits, reference = cache_path_and_reference(model, backend, seed=2)
    precision.assert_close(logits, reference, what="cache path vs the model's own forward")
    layer = store.layers[0]
    latent, rope_key = layer.materialize()
    assert latent.shape == (1, 1, 39, 16) and rope_key.shape == (1, 1, 39, 8)  # latent, rope key
    assert latent.dtype == rope_key.dtype == precision.dtype
    nbytes = geometry.dtype_bytes
    assert store.nbytes() == (16 + 8) * nbytes * 39 * 3 == backend.bytes_per_token_per_layer() * 39 * 3


def test_native_mla_refuses_another_rank():
    geometry = ModelGeometry.from_config(DeepseekV3Config(**CONFIG), torch.float32)
    with pytest.raises(ValueError, match="kv_lora_rank=16"):
        create("mla", geometry, rank=8)


def test_absorbed_attention_batched_matches_the_models_own_attention(tiny_deepseek, precision):
    """mla on native MLA decodes a ragged batch with absorbed attention (W_UK folded into the query, W_UV
    after attention, the latent never expanded): each row's logits equal the model's own forward within
    the dtype's tolerance."""
    model = tiny_deepseek
    geometry = ModelGeometry.from_config(model.config, model.dtype)
    backend = create("mla", geometry)
    backend.prepare(model)
    assert all(type(layer.self_attn).__name__.startswith("Absorbing") for layer in model.model.layers)
    runner = StorePath(model, geometry.num_layers)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (9, 17, 30)]
    stores = [backend.new_store() for _ in prompts]
    for ids, store in zip(prompts, stores):
        runner.prefill(ids[:-1], store)
    batched = runner.decode([ids[-1] for ids in prompts], stores)
    for row, ids in enumerate(prompts):
        with torch.no_grad():
            reference = model(torch.tensor([ids], device=precision.device)).logits[0, -1]
        precision.assert_close(batched[row], reference, what=f"row {row}")


@pytest.mark.parametrize("name", ["mla", "full"])
def test_a_mixed_step_on_native_mla_gives_each_row_the_models_own_logits(tiny_deepseek, precision, name):
    """Two sequences decoding and a third's prompt chunks (12, then 18 tokens) in one forward through the pool
    (absorbed attention over the latent and rope key pages, each length's rows as one group): every row's logits
    equal the model's own forward at that position, for ``mla`` and for ``full`` (which holds the same entries
    exactly: both are paged on a native-MLA model)."""
    model = tiny_deepseek
    backend = create(name, ModelGeometry.from_config(model.config, model.dtype))
    backend.prepare(model)
    assert [s.width for s in backend.kv_spec().streams] == [model.config.kv_lora_rank, model.config.qk_rope_head_dim]
    driver = PagedDriver(model, backend)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (21, 34, 30)]
    rows = [SeqBlocks() for _ in seqs]
    for blocks, ids in zip(rows[:2], seqs[:2]):
        driver.step([blocks], [ids[:19]])
    for step, (lo, hi) in enumerate([(0, 12), (12, 30)]):
        logits = driver.step(rows, [[seqs[0][19 + step]], [seqs[1][19 + step]], seqs[2][lo:hi]])
        for row, end in enumerate([20 + step, 20 + step, hi]):
            with torch.no_grad():
                want = model(torch.tensor([seqs[row][:end]], device=precision.device)).logits[0, -1]
            precision.assert_close(logits[row], want, what=f"mixed step {step}, row {row}")


@pytest.mark.parametrize("name,options,min_cos", [("mla+int8", {}, 0.99), ("mla+int4", {"rotate": True}, 0.95)],
                         ids=["mla+int8", "mla+int4:rotate=true"])
def test_native_mla_int8_attends_the_int8_codes_and_holds_what_the_sums_say(tiny_deepseek, precision, name, options,
                                                                            min_cos):
    """``mla+int8`` (and ``mla+int4``, rotated) on a native-MLA model: the latent and the rope key quantized per
    channel over token groups (newest tokens in full precision); decode attends to the codes (scales and the
    rotation folded into the query and the weights) and equals absorbed attention over the dequantized streams;
    the store holds the estimator's sum to the byte; the logits stay close to the model's own."""
    model = tiny_deepseek
    geometry = ModelGeometry.from_config(model.config, model.dtype)
    backend = create(name, geometry, group_size=8, residual=8, **options)
    backend.prepare(model)
    store, logits, reference = cache_path_and_reference(model, backend, seed=3)
    assert store.nbytes() == backend.bytes_per_token_per_layer(39) * 39 * 3
    assert store.layers[0].key_store.codes.length == 24  # 39 tokens: 3 groups of 8 quantized, 15 in the window
    cos = torch.nn.functional.cosine_similarity(logits.float(), reference.float(), dim=-1)
    assert cos.min() > min_cos, cos
    gen = torch.Generator().manual_seed(4)
    for layer, block in zip(store.layers, model.model.layers):
        _check_int8_read(layer, block.self_attn, precision, gen)


@torch.inference_mode()
def _check_int8_read(layer, a, precision, gen):
    """One layer: absorbed attention on its int8 codes vs on their dequantized copy."""
    from cache_backends.absorbed_mla import AbsorbedRead

    nope = a.qk_nope_head_dim
    query = precision.randn(1, 4, 1, nope + a.qk_rope_head_dim, generator=gen)
    got = AbsorbedRead(layer, a).attend(query, a.scaling)
    w = a.kv_b_proj.weight.view(4, nope + a.v_head_dim, -1)
    latent, rope_key = layer.key_store.read()[0, 0], layer.value_store.read()[0, 0]  # dequantized copies
    scores = (query[0, :, :, :nope] @ w[:, :nope]) @ latent.T + query[0, :, :, nope:] @ rope_key.T
    want = ((torch.softmax(scores * a.scaling, -1) @ latent) @ w[:, nope:].transpose(1, 2))[None]
    precision.assert_close(got, want, what="absorbed attention on int8 codes vs on their dequantized copy",
                           factor=32)


@pytest.mark.parametrize("name,options", [("full", {}), ("mla", {}), ("mla+int8", {"group_size": 8, "residual": 8}),
                                          ("mla+int4", {"group_size": 8, "residual": 8, "rotate": True})],
                         ids=["full", "mla", "mla+int8", "mla+int4:rotate=true"])
def test_greedy_tokens_through_the_kernel_equal_the_torch_paths(tiny_deepseek, precision, name, options):
    """A ragged batch (prompts of 9, 23 and 40 tokens, the last prefilled in two chunks) decoded greedily through the
    pool, its latent and rope key (exact, or quantized per channel with an exact window) read in place by the
    attention kernel (KV_ATTENTION=kernel) and gathered (KV_ATTENTION=torch): the same tokens (up to a near-tie,
    :meth:`Precision.assert_greedy_agrees`), and the kernel's step logits within the dtype's tolerance of the torch
    path's."""
    if not kernels.load():
        pytest.skip(f"the attention kernel is not available: {kernels.status()['reason']}")
    model = tiny_deepseek
    backend = create(name, ModelGeometry.from_config(model.config, model.dtype), **options)
    backend.prepare(model)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (9, 23, 40)]
    tokens, logits = {}, {}
    for mode in ("torch", "kernel"):
        with kernels.using(mode):
            driver = PagedDriver(model, backend)
            rows = [SeqBlocks() for _ in prompts]
            first = driver.step(rows[:2], prompts[:2])  # two prompts in one forward
            driver.step(rows[2:], [prompts[2][:25]])  # the third in two chunks, the second over the first's pages
            first = torch.cat([first, driver.step(rows[2:], [prompts[2][25:]])])
            nxt, out, steps = first.argmax(-1).tolist(), [[] for _ in prompts], []
            for _ in range(12):  # the three rows decoding together
                for row, t in enumerate(nxt):
                    out[row].append(t)
                steps.append(driver.step(rows, [[t] for t in nxt]))
                nxt = steps[-1].argmax(-1).tolist()
            tokens[mode], logits[mode] = out, steps
            assert (in_place_layer(driver.pool.views[name], 0) is not None) == (mode == "kernel")
    for row, prompt in enumerate(prompts):
        precision.assert_greedy_agrees(model, prompt, tokens["kernel"][row], tokens["torch"][row])
    if precision.dtype == torch.float32:
        assert tokens["kernel"] == tokens["torch"]
    if tokens["kernel"] == tokens["torch"]:
        for got, want in zip(logits["kernel"], logits["torch"]):
            precision.assert_close(got, want, what="step logits, kernel vs torch")
