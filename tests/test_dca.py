"""dca: identity above threshold 1, reuse layers store nothing and skip projections, fall-back mechanics.

The value tests (identity, attention through the folded maps) run in each precision under test
(:mod:`tests.precision`)."""

from __future__ import annotations

import pytest
import torch

from cache_backends import ModelGeometry, get_backend_class
from server.engine.runner import ModelRunner
from tests.test_backends import TEXT, cache_path_logits


@pytest.fixture(scope="module")
def setup(ref_model):
    from cache_backends.calibration import calibration_ids

    model, tok = ref_model
    geometry = ModelGeometry.from_config(model.config, torch.float32)
    return model, tok, geometry, calibration_ids(model, tok, max_tokens=4096)


@pytest.fixture(scope="module")
def typed(value_model, setup):
    """``setup`` with the model and geometry in the precision under test (same calibration token ids)."""
    model, tok = value_model
    return model, tok, ModelGeometry.from_config(model.config, model.dtype), setup[3]


def make(setup, **options):
    model, _, geometry, calib = setup
    backend = get_backend_class("dca")(geometry, **options)
    backend.prepare(model, calib)
    return backend


def test_threshold_above_one_is_identical_to_full(typed, precision):
    model, tok, geometry, calib = typed
    ids = tok.encode(TEXT)
    full_backend = get_backend_class("full")(geometry)
    full, _ = cache_path_logits(model, full_backend, ids, 8)
    ours, store = cache_path_logits(model, make(typed, threshold=1.01), ids, 8)
    precision.assert_close(ours, full, what="dca at threshold 1.01 vs full")
    assert store.reuse_layers() == 0


def test_reuse_layers_store_nothing_and_skip_projections(setup):
    model, tok, geometry, calib = setup
    backend = make(setup, threshold=-1.0, probe_interval=1000)  # every other layer reuses
    runner = ModelRunner(model, geometry.num_layers)
    store = backend.new_store()
    runner.prefill(calib[:200], store)
    reuse = [i for i, layer in enumerate(store.layers) if layer.mode == "reuse"]
    assert reuse == [1, 3, 5, 7]
    assert all(store.layers[i].nbytes() == 0 for i in reuse)
    per_layer = 2 * geometry.num_key_value_heads * geometry.head_dim * 4 * 201
    calls = {"k": 0}
    handles = [model.model.layers[i].self_attn.inner.k_proj.register_forward_hook(
        lambda *a: calls.__setitem__("k", calls["k"] + 1)) for i in reuse]
    try:
        runner.decode([calib[200]], [store])
    finally:
        for h in handles:
            h.remove()
    assert calls["k"] == 0  # reuse layers did not project K
    assert store.nbytes() == per_layer * (geometry.num_layers - len(reuse))
    assert store.num_tokens() == 201


def test_probe_below_threshold_falls_back_and_stores_from_there(setup):
    model, tok, geometry, calib = setup
    backend = make(setup, threshold=-1.0, probe_interval=2)
    runner = ModelRunner(model, geometry.num_layers)
    store = backend.new_store()
    runner.prefill(calib[:100], store)
    for layer in store.layers:
        layer.threshold = 2.0  # every probe now fails
    runner.decode([calib[100]], [store])  # step 1: no probe yet
    assert store.fallbacks == 0
    runner.decode([calib[101]], [store])  # step 2: probe -> fall back at position 101
    assert store.fallbacks == 4 and store.reuse_layers() == 0
    assert all(store.layers[i].fallback_at == 101 and store.layers[i].own.get_seq_length() == 1 for i in (1, 3, 5, 7))
    logits = runner.decode([calib[102]], [store])
    assert torch.isfinite(logits).all() and store.num_tokens() == 103
    assert store.layers[1].own.get_seq_length() == 2


def test_calibration_similarity_reported(setup):
    backend = make(setup)
    details = backend.details()["calibration_similarity_by_layer"]
    assert len(details["similarity_linear"]) == len(details["similarity_none"]) == 7
    # a fitted linear map predicts a layer's K/V far better than the raw neighbour
    assert sum(details["similarity_linear"]) > sum(details["similarity_none"])


@pytest.mark.parametrize("inner", [None, "int8", "mla"])
def test_reuse_layer_attends_the_source_cache_through_folded_maps_exactly(typed, precision, inner):
    """A reuse layer's decode attention (query folded through the RoPE-commuting key map, value map after
    attention, read from the source's stored form) equals attention over the K/V the map predicts from the
    source's rebuilt K/V, within the dtype's attention tolerance (the folded scores sum over the source
    heads in another order than the predicted keys; scores reach ~30, so reassociation moves the output by
    a few eps x 30 x max |value|); for dca, dca+int8 and dca+mla. In bf16 it found the fp32 value bias
    promoting a reuse layer's output to fp32 (o_proj then refused it)."""
    from cache_backends import create
    from cache_backends.attention import attend_kv

    model, _, geometry, calib = typed
    name = "dca" if inner is None else f"dca+{inner}"
    backend = create(name, geometry, threshold=-1.0)  # every layer whose source is kept reuses it
    backend.prepare(model, calib)
    store = backend.new_store()
    runner = ModelRunner(model, geometry.num_layers)
    runner.prefill(calib[:300], store)
    runner.decode([calib[300]], [store])
    gen = torch.Generator().manual_seed(0)
    reuse = [layer for layer in store.layers if layer.reusing()]
    assert reuse
    for layer in reuse:
        query = precision.randn(1, geometry.num_attention_heads, 1, geometry.head_dim, generator=gen)
        keys, values = layer.map.predict(*layer.source.own.materialize(), 0)
        want = attend_kv(query, keys, values, geometry.head_dim ** -0.5)
        got = layer.attend(query, geometry.head_dim ** -0.5)
        assert got.dtype == want.dtype == precision.dtype, (name, got.dtype, want.dtype)
        h, d = geometry.num_key_value_heads, geometry.head_dim
        value_map = layer.map.value_map.permute(0, 2, 1, 3).reshape(h * d, h * d)  # (source x in, dest x out)
        precision.assert_attention_close(got, want, query, keys, values, geometry.head_dim ** -0.5, name,
                                         map_gain=value_map.norm(dim=0).max().item())


def test_maps_predict_in_fp32_whatever_the_cache_dtype(typed, precision):
    """A layer map's prediction from K/V in the cache's dtype is its fp32 prediction rounded to that dtype
    (within 2 eps of the largest value: the key is a sum of two rounded terms). In bf16 it found the value
    map applied in bf16: its least-squares weights cancel (column L1 norms ~1e4), and rounding them moved
    predicted values by up to 0.43 (12 eps of the largest, ~4.7)."""
    model, _, geometry, calib = typed
    backend = make(typed)
    store = get_backend_class("full")(geometry).new_store()
    ModelRunner(model, geometry.num_layers).prefill(calib[:100], store)
    for i, layer_map in enumerate(backend.maps):  # map i predicts layer i + 1 from layer i
        keys, values = store.layers[i].materialize()  # (1, H, 100, d)
        got = layer_map.predict(keys, values, 0)
        want = layer_map.predict(keys.float(), values.float(), 0)
        for part, g, w in zip(("keys", "values"), got, want):
            assert g.dtype == precision.dtype, (i, part, g.dtype)
            precision.assert_close(g, w, 2, f"map {i} {part}")


def test_rope_commuting_map_predicts_post_rope_keys_exactly_as_pre_rope(setup):
    """The key map commutes with RoPE: mapping post-RoPE source keys equals RoPE of the pre-RoPE prediction."""
    from cache_backends.calibration import collect_kv

    model, _, geometry, calib = setup
    backend = make(setup)
    (sk, sv), (dk, dv) = collect_kv(model, geometry, calib[:2048])[2:4]
    layer_map = backend.maps[2]
    k_pre, _ = layer_map.predict_pre_rope(sk[:50], sv[:50])
    post = layer_map.rope.apply(sk[:50].transpose(0, 1)[None], 7)  # (1, H, 50, d) at positions 7..56
    k_post, _ = layer_map.predict(post, sv[:50].transpose(0, 1)[None], 7)
    want = layer_map.rope.apply(k_pre.transpose(0, 1)[None], 7)
    assert (k_post - want).abs().max().item() < 1e-4
