"""Every backend: identity at its lossless setting, bytes = sum of tensors = closed formula, no shadow copy."""

from __future__ import annotations

import pytest
import torch

from cache_backends import KVLayer, ModelGeometry, create, get_backend_class
from server.engine.runner import ModelRunner

TEXT = ("And God said, Let there be light: and there was light. And God saw the light, that it was good: "
        "and God divided the light from the darkness.")


@pytest.fixture(scope="module")
def geometry(ref_model):
    model, _ = ref_model
    return ModelGeometry.from_config(model.config, torch.float32)


@pytest.fixture(scope="module")
def calib(ref_model):
    from cache_backends.calibration import calibration_ids

    return calibration_ids(ref_model[0], ref_model[1], max_tokens=4096)


def make(name, model, geometry, calib, **options):
    backend = create(name, geometry, **options)
    backend.prepare(model, calib)
    return backend


def cache_path_logits(model, backend, ids, prefix):
    """Logits of positions prefix-1 .. len-1: prefill ``prefix`` tokens, then decode the rest one by one."""
    runner = ModelRunner(model, backend.geometry.num_layers)
    store = backend.new_store()
    out = [runner.prefill(ids[:prefix], store)[-1]]
    for t in ids[prefix:]:
        out.append(runner.decode([t], [store])[0])
    return torch.stack(out), store


LOSSLESS = [("gqa", {"groups": 8, "method": "mean"}), ("gqa", {"groups": 8, "method": "pca"}),
            ("mla", {"rank": 512}), ("dca", {"threshold": 1.01}), ("dca+mla", {"threshold": 1.01, "rank": 512})]


@pytest.mark.parametrize("name,options", LOSSLESS, ids=lambda x: str(x))
def test_lossless_setting_matches_full(ref_model, geometry, calib, name, options):
    model, tok = ref_model
    ids = tok.encode(TEXT)
    full, _ = cache_path_logits(model, make("full", model, geometry, calib), ids, 8)
    ours, _ = cache_path_logits(model, make(name, model, geometry, calib, **options), ids, 8)
    assert (ours - full).abs().max().item() < 1e-3


ALL = [("full", {}), ("gqa", {"groups": 2, "method": "mean"}), ("gqa", {"groups": 2, "method": "pca"}),
       ("mla", {"rank": 64}), ("int8", {"group_size": 32, "residual": 32}), ("int8", {"group_size": 64, "residual": 0}),
       ("gqa+int8", {"groups": 2}), ("mla+int8", {"rank": 64}), ("dca+int8", {"threshold": 0.5}),
       ("dca+mla", {"threshold": 0.5, "rank": 64})]


@pytest.mark.parametrize("name,options", ALL, ids=lambda x: str(x))
def test_bytes_are_the_tensors_and_match_the_formula_at_1024(ref_model, geometry, calib, name, options):
    model, _ = ref_model
    backend = make(name, model, geometry, calib, **options)
    runner = ModelRunner(model, geometry.num_layers)
    store = backend.new_store()
    runner.prefill(calib[:1000], store)
    for t in calib[1000:1024]:
        runner.decode([t], [store])
    assert store.num_tokens() == 1024
    held = 0
    for layer in store.layers:
        for value in tensors_of(layer):
            held += value.nelement() * value.element_size()
            # no full-precision shadow: no tensor in a compressed store spans every token at full width
            if name != "full" and value.dtype == torch.float32 and value.dim() == 4:
                assert value.shape[1] * value.shape[-1] * value.shape[-2] < 8 * 32 * 1024
    assert store.nbytes() == held
    if name.startswith("dca"):  # the store's own reuse decisions set its size: (1 - f) x the inner formula
        kept = geometry.num_layers - sum(layer.mode == "reuse" for layer in store.layers)
        formula = backend.inner.bytes_per_token_per_layer(1024) * 1024 * kept
    else:
        formula = backend.bytes_per_token_per_layer(1024) * 1024 * geometry.num_layers
    assert abs(store.nbytes() - formula) / formula < 0.05
    store.release()
    assert store.nbytes() == 0


def tensors_of(obj):
    """Every per-sequence tensor a layer holds: its own tensor attributes and those of its storage objects
    (per-model constants such as codecs, bases, maps and RoPE tables are not per-sequence storage)."""
    from cache_backends.base import FullStorage
    from cache_backends.int8 import Int8Storage

    for value in vars(obj).values():
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (Int8Storage, FullStorage, KVLayer)):
            yield from tensors_of(value)


def test_int8_stores_int8_and_is_under_0_55x_of_full(ref_model, geometry, calib):
    model, _ = ref_model
    full = make("full", model, geometry, calib)
    int8 = make("int8", model, geometry, calib)
    sizes = {}
    for b in (full, int8):
        store = b.new_store()
        ModelRunner(model, geometry.num_layers).prefill(calib[:1024], store)
        sizes[b.name] = store.nbytes()
        if b is int8:
            assert all(layer.key_store.q.dtype == torch.int8 and layer.value_store.q.dtype == torch.int8
                       for layer in store.layers)
    assert sizes["int8"] <= 0.55 * sizes["full"]


def test_gqa_pca_reconstructs_better_than_mean(ref_model, geometry, calib):
    """At the same cache size the calibrated shared head rebuilds K/V with less error than mean pooling."""
    from cache_backends.calibration import collect_kv
    from cache_backends.gqa import mean_codec, pca_key_codec, pca_value_codec

    model, _ = ref_model
    k, v = collect_kv(model, geometry, calib[:2048])[4]
    x_k, x_v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (1, H, T, d)
    mean = mean_codec(2, 4, geometry.head_dim)
    err = lambda codec, x: ((codec.decode(codec.encode(x)) - x) ** 2).mean().item()  # noqa: E731
    assert err(pca_key_codec(k, 2), x_k) < err(mean, x_k)
    assert err(pca_value_codec(v, 2), x_v) < err(mean, x_v)


def test_unsupported_combination_lists_the_supported_ones(geometry):
    with pytest.raises(ValueError, match="supported: gqa\\+int8, mla\\+int8, dca\\+int8, dca\\+mla"):
        create("int8+mla", geometry)
    with pytest.raises(ValueError, match="takes no option"):
        create("mla+int8", geometry, groups=2)


def test_bad_backend_parameters_are_refused(geometry):
    with pytest.raises(ValueError, match="KV_GQA_GROUPS"):
        get_backend_class("gqa")(geometry, groups=3)
    with pytest.raises(ValueError, match="KV_MLA_RANK"):
        get_backend_class("mla")(geometry, rank=10_000)
    with pytest.raises(ValueError, match="KV_INT8_GROUP_SIZE"):
        get_backend_class("int8")(geometry, group_size=0)


def test_int8_perplexity_gate(ref_model, geometry, calib):
    """int8's held-out perplexity through its own cache path is within +1% of full's (2 windows, 1024 tokens scored)."""
    from bench.fidelity import cache_path_perplexity
    from bench.quality import EVAL_SLICE, slice_token_ids
    from tests.conftest import MODEL_DIR

    model, tok = ref_model
    ids = slice_token_ids(MODEL_DIR / EVAL_SLICE, tok)
    full = cache_path_perplexity(model, make("full", model, geometry, calib), ids, max_windows=2)
    int8 = cache_path_perplexity(model, make("int8", model, geometry, calib), ids, max_windows=2)
    assert int8 <= full * 1.01, (int8, full)
