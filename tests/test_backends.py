"""Every backend: identity at its lossless setting, bytes = sum of tensors = closed formula, no shadow copy.

Value tests run in each precision under test (:mod:`tests.precision`: fp32 and bf16 on the CPU by default),
comparing within that dtype's tolerance."""

from __future__ import annotations

import pytest
import torch

from cache_backends.geometry import ModelGeometry
from cache_backends.kv_store import KVLayer
from cache_backends.registry import create, get_backend_class
from cache_backends.store_path import StorePath
from tests.conftest import fits

TEXT = ("And God said, Let there be light: and there was light. And God saw the light, that it was good: "
        "and God divided the light from the darkness.")


@pytest.fixture(scope="module")
def geometry(ref_model):
    model, _ = ref_model
    return ModelGeometry.from_config(model.config, torch.float32)


@pytest.fixture(scope="module")
def typed(value_model):
    """``(model, tokenizer, geometry)`` in the precision under test."""
    model, tok = value_model
    return model, tok, ModelGeometry.from_config(model.config, model.dtype)


@pytest.fixture(scope="module")
def calib(ref_model):
    from cache_backends.calibration import calibration_ids

    return calibration_ids(ref_model[0], ref_model[1], max_tokens=4096)


def make(name, model, geometry, calib, **options):
    backend = create(name, geometry, **options)
    backend.prepare(model, calib, fits(model))
    return backend


def cache_path_logits(model, backend, ids, prefix):
    """Logits of positions prefix-1 .. len-1: prefill ``prefix`` tokens, then decode the rest one by one."""
    runner = StorePath(model, backend.geometry.num_layers)
    store = backend.new_store()
    out = [runner.prefill(ids[:prefix], store)[-1]]
    for t in ids[prefix:]:
        out.append(runner.decode([t], [store])[0])
    return torch.stack(out), store


LOSSLESS = [("gqa", {"groups": 8, "method": "mean"}), ("gqa", {"groups": 8, "method": "pca"}),
            ("mla", {"rank": 512}), ("dca", {"threshold": 1.01}), ("dca+mla", {"threshold": 1.01, "rank": 512}),
            ("int4", {"rotate": True, "residual": 4096})]  # rotation configured, nothing quantized: exact


@pytest.mark.parametrize("name,options", LOSSLESS, ids=lambda x: str(x))
def test_lossless_setting_matches_full(typed, precision, calib, name, options):
    model, tok, geometry = typed
    ids = tok.encode(TEXT)
    full, _ = cache_path_logits(model, make("full", model, geometry, calib), ids, 8)
    ours, _ = cache_path_logits(model, make(name, model, geometry, calib, **options), ids, 8)
    precision.assert_close(ours, full, what=name)


ALL = [("full", {}), ("gqa", {"groups": 2, "method": "mean"}), ("gqa", {"groups": 2, "method": "pca"}),
       ("mla", {"rank": 64}), ("int8", {"group_size": 32, "residual": 32}), ("int8", {"group_size": 64, "residual": 0}),
       ("gqa+int8", {"groups": 2}), ("mla+int8", {"rank": 64}), ("dca+int8", {"threshold": 0.5}),
       ("dca+mla", {"threshold": 0.5, "rank": 64}), ("int4", {}), ("int4", {"rotate": True}),
       ("int8", {"value_bits": 4}), ("gqa+int4", {"groups": 2}), ("mla+int4", {"rank": 64, "rotate": True}),
       ("dca+int4", {"threshold": 0.5})]


@pytest.mark.parametrize("name,options", ALL, ids=lambda x: str(x))
def test_bytes_are_the_tensors_and_match_the_formula_at_1024(ref_model, geometry, calib, name, options):
    model, _ = ref_model
    backend = make(name, model, geometry, calib, **options)
    runner = StorePath(model, geometry.num_layers)
    store = backend.new_store()
    runner.prefill(calib[:1000], store)
    for t in calib[1000:1024]:
        runner.decode([t], [store])
    assert store.num_tokens() == 1024
    held = allocated = 0
    for layer in store.layers:
        for buffer in buffers_of(layer):
            used = buffer.view()  # the tokens in use
            held += used.nelement() * used.element_size()
            allocated += buffer.data.nelement() * buffer.data.element_size()
            # no full-precision shadow: no tensor in a compressed store spans every token at full width
            if name != "full" and buffer.data.dtype == torch.float32:
                assert buffer.data.shape[1] * buffer.data.shape[-1] * buffer.data.shape[-2] < 8 * 32 * 1024
    assert store.nbytes() == held
    assert store.allocated_bytes() == allocated >= held
    # the sums at 1024 tokens (for dca, of the store's own reuse decisions) are the bytes held, exactly
    formula = backend.live_bytes_per_token_per_layer(store) * 1024 * geometry.num_layers
    assert store.nbytes() == pytest.approx(formula, rel=1e-9)
    store.release()
    assert store.nbytes() == 0


def buffers_of(obj):
    """Every per-sequence buffer a layer holds, found through its storage objects (per-model constants such
    as codecs, bases, maps and RoPE tables are not per-sequence storage). A layer holds no bare tensor."""
    from cache_backends.kv_store import FullStorage
    from cache_backends.buffer import TokenBuffer
    from cache_backends.int8.backend import Int8Storage

    for value in vars(obj).values():
        if isinstance(value, TokenBuffer) and value.data is not None:
            yield value
        elif isinstance(value, (Int8Storage, FullStorage, KVLayer)):
            yield from buffers_of(value)


def test_int8_stores_int8_and_is_under_0_55x_of_full(ref_model, geometry, calib):
    model, _ = ref_model
    full = make("full", model, geometry, calib)
    int8 = make("int8", model, geometry, calib)
    sizes = {}
    for b in (full, int8):
        store = b.new_store()
        StorePath(model, geometry.num_layers).prefill(calib[:1024], store)
        sizes[b.name] = store.nbytes()
        if b is int8:
            assert all(layer.key_store.codes.data.dtype == torch.int8
                       and layer.value_store.codes.data.dtype == torch.int8
                       for layer in store.layers)
    assert sizes["int8"] <= 0.55 * sizes["full"]


def test_gqa_pca_reconstructs_better_than_mean(ref_model, geometry, calib):
    """At the same cache size the calibrated shared head rebuilds K/V with less error than mean pooling."""
    from cache_backends.calibration import collect_kv
    from cache_backends.gqa.backend import mean_codec, pca_key_codec, pca_value_codec

    model, _ = ref_model
    k, v = collect_kv(model, geometry, calib[:2048])[4]
    x_k, x_v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (1, H, T, d)
    mean = mean_codec(2, 4, geometry.head_dim)
    err = lambda codec, x: ((codec.decode(codec.encode(x)) - x) ** 2).mean().item()  # noqa: E731
    assert err(pca_key_codec(k, 2), x_k) < err(mean, x_k)
    assert err(pca_value_codec(v, 2), x_v) < err(mean, x_v)


def test_unsupported_combination_lists_the_supported_ones(geometry):
    with pytest.raises(ValueError, match="supported: gqa\\+int8, gqa\\+int4, mla\\+int8, mla\\+int4, dca\\+int8, dca\\+mla"):
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


ATTEND = [("full", {}), ("int8", {"group_size": 32, "residual": 32}), ("int8", {"group_size": 16, "residual": 0}),
          ("gqa", {"groups": 2, "method": "pca"}), ("gqa", {"groups": 2, "method": "mean"}), ("gqa+int8", {"groups": 2}),
          ("mla", {"rank": 64}), ("mla+int8", {"rank": 64}), ("int4", {}), ("int4", {"rotate": True}),
          ("int4", {"group_size": 16, "residual": 0, "rotate": True}), ("int8", {"value_bits": 4, "rotate": True}),
          ("gqa+int4", {"groups": 2, "rotate": True}), ("mla+int4", {"rank": 64}),
          ("mla+int4", {"rank": 64, "rotate": True})]


@pytest.mark.parametrize("name,options", ATTEND, ids=lambda x: str(x))
def test_decode_attends_in_stored_form_exactly(typed, precision, calib, name, options):
    """Each layer's decode attention over its stored form (int8 codes with folded scales, shared heads with
    folded codecs, an absorbed latent) equals attention over the K/V it rebuilds, within the dtype's
    attention tolerance (:mod:`tests.precision`)."""
    from cache_backends.attention import attend_kv

    model, _, geometry = typed
    backend = make(name, model, geometry, calib, **options)
    store = backend.new_store()
    StorePath(model, geometry.num_layers).prefill(calib[:300], store)  # 300: quantized groups + a window
    gen = torch.Generator().manual_seed(0)
    for i, layer in enumerate(store.layers):
        query = precision.randn(1, geometry.num_attention_heads, 1, geometry.head_dim, generator=gen)
        keys, values = layer.materialize()
        want = attend_kv(query, keys, values, geometry.head_dim ** -0.5)
        got = layer.attend(query, geometry.head_dim ** -0.5)
        assert got.dtype == want.dtype == precision.dtype, (name, got.dtype, want.dtype)
        precision.assert_attention_close(got, want, query, keys, values, geometry.head_dim ** -0.5,
                                         f"{name} layer {i}")


def test_rope_tables_grow_past_max_position_embeddings(ref_model):
    """mla/dca rebuild keys at positions past the model's max_position_embeddings when MAX_TOTAL_TOKENS is
    set larger (it failed with a shape error): the table grows and matches the model's own rotary module."""
    from cache_backends.rope import RopeTable

    model, _ = ref_model
    table = RopeTable(model, 16)
    x = torch.randn(1, 2, 3, model.config.head_dim if hasattr(model.config, "head_dim") else 32)
    rotated = table.apply(x, 2000)  # positions 2000..2002, far past the 16-row table
    cos, sin = model.model.rotary_emb(x, torch.arange(2000, 2003)[None])
    half = x.shape[-1] // 2
    want = x * cos[0] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin[0]
    assert torch.allclose(rotated, want, atol=1e-5)
    assert torch.allclose(table.invert(rotated, 2000), x, atol=1e-5)


def test_int4_packs_two_codes_a_byte_and_rotation_keeps_the_bytes(ref_model, geometry, calib):
    """int4 holds uint8 codes of head_dim / 2 bytes per token and head (two 4-bit codes each: real bytes, no
    wider copy) with fp16 scales in this fp32 model, and at 1024 tokens costs over 5x less than full (issue #24's
    target); rotation changes no byte; k8v4 sits between int4 and int8."""
    model, _ = ref_model
    sizes = {}
    for key, name, options in [("full", "full", {}), ("int8", "int8", {}), ("k8v4", "int8", {"value_bits": 4}),
                               ("int4", "int4", {}), ("int4r", "int4", {"rotate": True})]:
        store = make(name, model, geometry, calib, **options).new_store()
        StorePath(model, geometry.num_layers).prefill(calib[:1024], store)
        sizes[key] = store.nbytes()
        for layer in store.layers if key != "full" else []:
            for stream, bits in ((layer.key_store, 8 if key in ("int8", "k8v4") else 4),
                                 (layer.value_store, 8 if key == "int8" else 4)):
                codes = stream.codes.view()
                assert codes.dtype == (torch.int8 if bits == 8 else torch.uint8)
                assert codes.shape[-1] == geometry.head_dim * bits // 8
                assert stream.scale.view().dtype == stream.zero.view().dtype == (torch.float32 if bits == 8
                                                                                 else torch.float16)
    assert sizes["int4"] == sizes["int4r"] < sizes["k8v4"] < sizes["int8"]
    assert sizes["full"] / sizes["int4"] >= 5, sizes


def test_hadamard_rotation_is_orthogonal_and_folds_into_query_and_output():
    """R = R^T = R^-1 (block-diagonal on widths that are not a power of two), so q·k = (qR)·(kR) and a weighted
    sum of rotated rows, rotated once, is the weighted sum of the rows: scoring and output need no un-rotated
    copy of the cache."""
    from cache_backends.quant import hadamard, rotate

    gen = torch.Generator().manual_seed(0)
    for width in (64, 96, 8):
        r = hadamard(width)
        assert torch.allclose(r, r.T) and torch.allclose(r @ r, torch.eye(width), atol=1e-6)
        assert (r != 0).sum(0).min() > 1 or width == 1  # it mixes channels
        q, k = torch.randn(3, width, generator=gen), torch.randn(50, width, generator=gen)
        p = torch.softmax(torch.randn(3, 50, generator=gen), -1)
        assert torch.allclose(rotate(q) @ rotate(k).T, q @ k.T, atol=1e-5)
        assert torch.allclose(rotate(p @ rotate(k)), p @ k, atol=1e-5)
    assert torch.equal(hadamard(7), torch.eye(7))  # an odd width: no block to rotate


def test_rotation_lowers_4bit_error_on_an_outlier_channel():
    """Values quantized per token lose most to one outlier channel (it sets every token's scale); rotated, the
    outlier is spread over all channels and the 4-bit round trip is several times more accurate (QuaRot)."""
    from cache_backends.int8.backend import Int8Storage

    x = torch.randn(1, 2, 256, 64, generator=torch.Generator().manual_seed(0))
    x[..., 5] *= 40  # one outlier channel, as LLM activations have
    err = {}
    for rotate in (False, True):
        store = Int8Storage("token", 32, 0, bits=4, rotate=rotate)
        store.append(x)
        err[rotate] = ((store.read() - x)[..., [c for c in range(64) if c != 5]] ** 2).mean().item()
    assert err[True] < err[False] / 4, err


@pytest.mark.parametrize("heads, groups", [(1, 1), (3, 1), (8, 2), (9, 1), (12, 3), (16, 4)])
def test_gqa_default_groups_divide_the_heads(heads, groups):
    """A model whose K/V head count has no divisor at a quarter of it (the MHA twin's 9) still gets a default gqa
    (``heads // 4`` = 2 does not divide 9), and the sums use the same default."""
    from cache_backends.estimate import Shape, default_params

    g = ModelGeometry(num_layers=2, num_attention_heads=heads, num_key_value_heads=heads, head_dim=8, dtype_bytes=4)
    assert create("gqa", g).groups == groups
    shape = Shape(num_layers=2, num_key_value_heads=heads, k_head_dim=8, v_head_dim=8)
    assert default_params(shape, "gqa")["groups"] == groups
