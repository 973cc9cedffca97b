"""dca: identity above threshold 1, reuse layers store nothing and skip projections, fall-back mechanics."""

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


def make(setup, **options):
    model, _, geometry, calib = setup
    backend = get_backend_class("dca")(geometry, **options)
    backend.prepare(model, calib)
    return backend


def test_threshold_above_one_is_identical_to_full(setup):
    model, tok, geometry, calib = setup
    ids = tok.encode(TEXT)
    full_backend = get_backend_class("full")(geometry)
    full, _ = cache_path_logits(model, full_backend, ids, 8)
    ours, store = cache_path_logits(model, make(setup, threshold=1.01), ids, 8)
    assert (ours - full).abs().max().item() < 1e-3
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
    assert all(store.layers[i].fallback_at == 101 and store.layers[i].own.keys.shape[-2] == 1 for i in (1, 3, 5, 7))
    logits = runner.decode([calib[102]], [store])
    assert torch.isfinite(logits).all() and store.num_tokens() == 103
    assert store.layers[1].own.keys.shape[-2] == 2


def test_calibration_similarity_reported(setup):
    backend = make(setup)
    details = backend.details()["calibration_similarity_by_layer"]
    assert len(details["similarity_linear"]) == len(details["similarity_none"]) == 7
    # a fitted linear map predicts a layer's K/V far better than the raw neighbour
    assert sum(details["similarity_linear"]) > sum(details["similarity_none"])
