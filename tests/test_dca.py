"""dca: identity above threshold 1, reuse layers store nothing and skip projections, fall-back mechanics.

The value tests (identity, attention through the folded maps) run in each precision under test
(:mod:`tests.precision`)."""

from __future__ import annotations

import pytest
import torch

from cache_backends.geometry import ModelGeometry
from cache_backends.registry import get_backend_class
from cache_backends.store_path import StorePath
from tests.conftest import fits
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
    backend.prepare(model, calib, fits(model))
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
    backend = make(setup, threshold=-1.0, probe_interval=1000, window=0)  # every other layer reuses, no window
    runner = StorePath(model, geometry.num_layers)
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
    backend = make(setup, threshold=-1.0, probe_interval=2, window=0)
    runner = StorePath(model, geometry.num_layers)
    store = backend.new_store()
    runner.prefill(calib[:100], store)
    for layer in store.layers:
        layer.threshold_for = lambda tokens: 2.0  # every probe now fails
    runner.decode([calib[100]], [store])  # step 1: no probe yet
    assert store.fallbacks == 0
    runner.decode([calib[101]], [store])  # step 2: probe -> fall back at position 101
    assert store.fallbacks == 4 and store.reuse_layers() == 0
    assert all(store.layers[i].fallback_at == 101 and store.layers[i].own.get_seq_length() == 1 for i in (1, 3, 5, 7))
    logits = runner.decode([calib[102]], [store])
    assert torch.isfinite(logits).all() and store.num_tokens() == 103
    assert store.layers[1].own.get_seq_length() == 2


def test_residual_window_holds_the_newest_tokens_and_slides(setup):
    """A reuse layer keeps its own K/V for the newest ``window + length % window`` tokens (36 of 100 after the
    prompt), drops the oldest 32 at once when it reaches 64, and the store's bytes are those tokens' bytes; after
    a fall-back the window stops sliding."""
    from cache_backends.dca.plan import window_start

    model, _, geometry, calib = setup
    backend = make(setup, threshold=-1.0, probe_interval=1000, window=32)
    runner = StorePath(model, geometry.num_layers)
    store = backend.new_store()
    runner.prefill(calib[:100], store)
    per_token = 2 * geometry.num_key_value_heads * geometry.head_dim * 4
    reuse = [layer for layer in store.layers if layer.reusing()]
    assert [layer.index for layer in reuse] == [1, 3, 5, 7]
    assert all(layer.own_start == 64 and layer.own.get_seq_length() == 36 for layer in reuse)
    assert store.nbytes() == per_token * (4 * 100 + 4 * 36)
    for t in range(100, 130):
        runner.decode([calib[t]], [store])
        n = t + 1
        assert all(layer.own_start == window_start(n, 32) for layer in reuse), n
        assert store.nbytes() == per_token * (4 * n + 4 * (n - window_start(n, 32)))
    assert window_start(128, 32) == 96 and reuse[0].own.get_seq_length() == 34  # slid at 128, 130 tokens now
    assert store.nbytes() == backend.live_bytes_per_token_per_layer(store) * 130 * geometry.num_layers
    reuse[0].threshold_for = lambda tokens: 2.0
    reuse[0].probe_interval = 1
    for t in range(130, 170):  # past the next slide (160): it has fallen back, the window grows
        runner.decode([calib[t]], [store])
    assert reuse[0].fallback_at == 130 and reuse[0].own_start == 96 and reuse[0].own.get_seq_length() == 74
    assert reuse[1].own_start == 128


def test_probe_compares_the_mean_of_the_latest_probes_with_the_threshold_of_that_span(setup):
    """Decode probes average the similarity of the latest (up to 4) probed tokens and compare it with the layer's
    calibrated threshold for that many tokens: a single probed token passes a span-1 threshold, the average of
    four fails a span-4 one."""
    model, _, geometry, calib = setup
    backend = make(setup, threshold=-1.0, probe_interval=1, window=0)
    runner = StorePath(model, geometry.num_layers)
    store = backend.new_store()
    runner.prefill(calib[:100], store)
    layer = store.layers[3]
    assert layer.reusing()
    layer.threshold = 1.0
    layer.thresholds = {**layer.thresholds, 1: -1.0, 4: 2.0}
    for t in range(100, 103):
        runner.decode([calib[t]], [store])
    assert layer.reusing() and len(layer.probes) == 3  # spans 1-3 take the span-1 threshold
    runner.decode([calib[103]], [store])
    assert layer.fallback_at == 103 and len(layer.probes) == 4


def test_thresholds_are_calibrated_per_layer_and_span_on_what_the_inner_backend_stores(setup):
    """The reuse candidates and each one's thresholds come from the calibration windows as served: shorter spans
    get lower thresholds; dca+int8's candidates and thresholds match dca's (the ridge maps do not amplify the
    int8 error: with plain least squares its similarities fell from ~0.96 to ~0.69 and it reused nothing);
    a threshold above 1 has no candidates."""
    from cache_backends.registry import create

    model, _, geometry, calib = setup
    plain = make(setup, threshold=0.95)
    quantized = create("dca+int8", geometry, threshold=0.95)
    quantized.prepare(model, calib, fits(model))
    assert plain.reuse_candidates and plain.reuse_candidates == quantized.reuse_candidates
    for layer in plain.reuse_candidates:
        spans = plain.layer_thresholds[layer]
        assert spans[1] < spans[16] < spans[1024] <= 1
        assert all(abs(spans[n] - quantized.layer_thresholds[layer][n]) < 0.01 for n in spans)
        assert abs(plain.served_similarity[layer] - quantized.served_similarity[layer]) < 0.01
    assert all(plain.served_similarity[layer] >= 0.95 for layer in plain.reuse_candidates)
    assert make(setup, threshold=1.01).reuse_candidates == []
    details = plain.details()
    assert details["reuse_candidates"] == plain.reuse_candidates
    assert set(details["runtime_thresholds_by_layer"]) == {str(layer) for layer in plain.reuse_candidates}


def test_calibration_similarity_reported(setup):
    backend = make(setup)
    details = backend.details()["calibration_similarity_by_layer"]
    assert len(details["similarity_linear"]) == len(details["similarity_none"]) == 7
    # a fitted linear map predicts a layer's K/V far better than the raw neighbour
    assert sum(details["similarity_linear"]) > sum(details["similarity_none"])


def test_similarity_averages_every_token_in_either_layout():
    """Calibration passes (tokens, H, d); serving (1, H, n, d). Both average every token and head (#26: the
    calibration figures were token 0's, e.g. 0.026 for layer 1 against 0.856 served)."""
    from cache_backends.dca.similarity import similarity, token_similarity

    gen = torch.Generator().manual_seed(0)
    own_k, own_v = torch.randn(12, 4, 16, generator=gen), torch.randn(12, 4, 16, generator=gen)
    pred_k, pred_v = own_k + torch.randn(12, 4, 16, generator=gen), own_v.clone()
    pred_k[0] = own_k[0]  # token 0 alone would say 1.0
    served = [x.transpose(0, 1).unsqueeze(0) for x in (own_k, own_v, pred_k, pred_v)]  # (1, H, n, d)
    assert similarity(own_k, own_v, pred_k, pred_v) == pytest.approx(similarity(*served), abs=1e-6)
    assert similarity(*served) == pytest.approx(token_similarity(*served).mean().item(), abs=1e-6)
    assert similarity(own_k, own_v, pred_k, pred_v) < 0.95
    with pytest.raises(ValueError, match="1, H, n, d"):
        token_similarity(own_k, own_v, pred_k, pred_v)


def test_calibration_figures_match_what_is_served(setup):
    """With a RoPE-commuting map, the calibration's similarity per layer is the served one (same windows)."""
    backend = make(setup)
    linear = backend.details()["calibration_similarity_by_layer"]["similarity_linear"]
    served = [backend.served_similarity[layer] for layer in range(1, 8)]
    assert linear == pytest.approx(served, abs=0.02)


@pytest.mark.parametrize("inner", [None, "int8", "mla"])
@pytest.mark.parametrize("window", [0, 32])
def test_reuse_layer_attends_the_source_cache_through_folded_maps_exactly(typed, precision, inner, window):
    """A reuse layer's decode attention (query folded through the RoPE-commuting key map, value map after
    attention, read from the source's stored form) equals attention over the K/V the map predicts from the
    source's rebuilt K/V, within the dtype's attention tolerance (the folded scores sum over the source
    heads in another order than the predicted keys; scores reach ~30, so reassociation moves the output by
    a few eps x 30 x max |value|); for dca, dca+int8 and dca+mla. In bf16 it found the fp32 value bias
    promoting a reuse layer's output to fp32 (o_proj then refused it). With a residual window the layer's own
    K/V of the newest positions join the same softmax (``window=32``)."""
    from cache_backends.attention import attend_kv
    from cache_backends.registry import create

    model, _, geometry, calib = typed
    name = "dca" if inner is None else f"dca+{inner}"
    backend = create(name, geometry, threshold=-1.0, window=window)  # every layer whose source is kept reuses it
    backend.prepare(model, calib, fits(model))
    store = backend.new_store()
    runner = StorePath(model, geometry.num_layers)
    runner.prefill(calib[:300], store)
    runner.decode([calib[300]], [store])
    gen = torch.Generator().manual_seed(0)
    reuse = [layer for layer in store.layers if layer.reusing()]
    assert reuse
    for layer in reuse:
        query = precision.randn(1, geometry.num_attention_heads, 1, geometry.head_dim, generator=gen)
        keys, values = layer.map.predict(*layer.source.own.materialize(), 0)
        if window:  # its own K/V serve the newest 32 + 301 % 32 = 45 positions
            own_keys, own_values = layer.own.materialize()
            assert layer.own_start == 256 and own_keys.shape[-2] == 45
            keys = torch.cat([keys[..., :256, :], own_keys], -2)
            values = torch.cat([values[..., :256, :], own_values], -2)
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
    StorePath(model, geometry.num_layers).prefill(calib[:100], store)
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


# ---- dca in the paged pool -------------------------------------------------------------------------------------
def _store_greedy(model, backend, geometry, ids, n):
    """Greedy tokens of a per-sequence DCAStore (one layer object per layer, its own attention path): the
    reference the pool is checked against; ``n - 1`` decode steps, as the engine writes its last token never."""
    runner = StorePath(model, geometry.num_layers)
    store = backend.new_store()
    logits = runner.prefill(ids, store)
    out = []
    for step in range(n):
        out.append(int(logits[-1].argmax()))
        if step < n - 1:
            logits = runner.decode([out[-1]], [store])
    return out, store


@pytest.mark.parametrize("name,options", [
    ("dca", {"threshold": -1.0, "window": 32}), ("dca", {"threshold": -1.0, "window": 0}),
    ("dca", {"probe_interval": 2}), ("dca+int8", {"threshold": -1.0}),
    ("dca+int8", {"probe_interval": 3, "window": 0}), ("dca+mla", {"probe_interval": 2})],
    ids=["reuse-window", "reuse-no-window", "fallbacks", "int8-reuse", "int8-no-window", "mla-fallbacks"])
def test_the_pool_serves_what_a_per_sequence_store_serves(setup, name, options):
    """Three prompts served together from the paged pool (one forward a step, every candidate layer batched) get
    the greedy tokens, the reuse decisions and the fall-backs a per-sequence store gets for each alone; at the
    default threshold with a probe every 2 steps some layers fall back (the probes and the fall-back's window
    are the pool's too)."""
    from cache_backends.registry import create
    from server.engine.sampling import SamplingParams
    from server.engine.sequence import Sequence
    from tests.engine_helpers import make_engine, run_all

    model, tok, geometry, calib = setup
    backend = create(name, geometry, **options)
    backend.prepare(model, calib, fits(model))
    prompts, n = [calib[:100], calib[300:345], calib[600:700]], 30
    refs = [_store_greedy(model, backend, geometry, p, n) for p in prompts]
    engine = make_engine(model, tok, name, prepared=backend)
    assert type(engine.kv.layouts[name]).__name__ == "DCALayout"
    seqs = [Sequence(request_id=str(i), prompt_ids=list(p), max_new_tokens=n, params=SamplingParams(), stop=[],
                     backend_name=name) for i, p in enumerate(prompts)]
    run_all(engine, seqs)
    for (tokens, store), seq in zip(refs, seqs):
        assert seq.output_ids == tokens
        assert seq.kv_stats == store.stats()
    if options.get("probe_interval") == 2:  # the default threshold: some layers fall back
        assert sum(s.kv_stats["dca_fallbacks"] for s in seqs) > 0
    assert engine.kv.blocks.num_used == 0


@pytest.mark.parametrize("window", [32, 0])
def test_a_reuse_layer_holds_only_its_window_in_the_pool(setup, window):
    """After a 100-token prefill with every candidate reusing, the kept layers hold every token and each reuse
    layer only its window (36 tokens from position 64; without a window nothing, in at most one page: the slot its
    next token is written to and dropped from), and the sequence's bytes are those tokens' bytes, as the
    per-sequence store's; its pages are fewer than ``full``'s for the same prompt."""
    from tests.engine_helpers import make_engine, make_seq, run_step

    model, tok, geometry, calib = setup
    engine = make_engine(model, tok, "dca", threshold=-1.0, window=window)
    layout = engine.kv.layouts["dca"]
    assert layout.candidates == [1, 3, 5, 7]
    seq = make_seq(tok, "x", 5, backend="dca")
    seq.prompt_ids = calib[:100]
    engine.submit(seq)
    run_step(engine)
    blocks = engine.kv.table(seq)
    assert blocks.groups[0].tokens == 100 and blocks.reuse_layers() == 4
    own = 36 if window else 0
    for group in blocks.groups[1:]:
        assert group.tokens == own and group.first == 100 - own
        assert len(group.pages()) == (-(-own // layout.groups[1].exact_tokens) if window else 1)
    per_token = 2 * geometry.num_key_value_heads * geometry.head_dim * 4
    assert engine.kv.store(seq).nbytes() == per_token * (4 * 100 + 4 * own)
    kept_pages = -(-100 // layout.groups[0].exact_tokens)
    assert engine.kv.held(seq) == kept_pages + sum(len(g.pages()) for g in blocks.groups[1:])
    full = make_engine(model, tok, "full")
    other = make_seq(tok, "x", 5)
    other.prompt_ids = calib[:100]
    full.submit(other)
    run_step(full)
    assert engine.kv.held_bytes(seq) < full.kv.held_bytes(other)


def test_admission_charges_dca_what_its_prefill_keeps_and_the_step_the_rest(setup):
    """A dca prompt is charged the pages it holds once its candidates keep only their windows (the least), and
    the scheduler keeps free, for its prefill step, the rest of what the step holds (every layer's K/V before
    the decisions): less than every layer kept, not more than the step needs."""
    from tests.engine_helpers import make_engine, make_seq, run_step

    model, tok, geometry, calib = setup
    engine = make_engine(model, tok, "dca", threshold=-1.0)
    layout = engine.kv.layouts["dca"]
    seq = make_seq(tok, "x", 5, backend="dca")
    seq.prompt_ids = calib[:500]
    cost, transient = engine.kv.admission_cost(seq), engine.kv.transient_pages(seq)
    every_layer = layout.prefill_pages(layout.cached_prefix([]), 500)
    assert cost < every_layer == cost + transient == layout.pages_for(500)
    engine.submit(seq)
    run_step(engine)
    assert engine.kv.held(seq) == cost  # every candidate reused: what admission charged


def test_a_quantized_inner_is_not_priced_above_dca_for_a_request_to_fit_alone(setup):
    """The most a request can hold (whether it fits the pool alone) is its prompt written whole and then its tokens
    as they are generated, not every token written in one step: ``dca+int8`` (which stores less) is never priced
    above ``dca`` for the same request (it was refused at 60 blocks where ``dca`` fitted)."""
    from tests.engine_helpers import make_engine, make_seq

    model, tok, geometry, calib = setup
    need = {}
    for name in ("dca", "dca+int8"):
        engine = make_engine(model, tok, name)
        seq = make_seq(tok, "x", 300, backend=name)
        seq.prompt_ids = calib[:351]
        need[name] = engine.kv.pages_to_finish(seq) * engine.kv.page_bytes
    assert need["dca+int8"] < need["dca"], need


@pytest.mark.parametrize("threshold", [0.0, 0.9, 1.1])
def test_the_pages_known_before_calibration_hold_the_calibrated_one(setup, threshold):
    """Before the weights load, dca's layout is unknown (calibration picks its reuse layers), so a ``window`` served
    beside it had its sinks checked only after the load. :func:`server.backend_check.possible_pages` lays the pool
    out for every number of reuse layers calibration may pick: the page of the calibrated pool is one of them, sinks
    over a page are refused before the load as ``window`` alone is, and sinks that fit one page are not."""
    from server.backend_check import check_pool, possible_pages
    from server.config import ConfigError
    from server.engine.kv_cache import page_layouts

    geometry = setup[2]
    calibrated = make(setup, threshold=threshold)
    window = get_backend_class("window")(geometry, sinks=16, window=64)
    unprepared = get_backend_class("dca")(geometry, threshold=threshold)
    assert len(unprepared.layout_variants()) == geometry.num_layers // 2 + 1
    pages = possible_pages({"window": window, "dca": unprepared}, torch.float32, 16)
    assert page_layouts({"window": window, "dca": calibrated}, torch.float32, 16)[0] in pages
    assert page_layouts({"dca": calibrated}, torch.float32, 16)[0] in possible_pages({"dca": unprepared},
                                                                                      torch.float32, 16)
    check_pool({"window": window, "dca": unprepared}, torch.float32, 16, None)
    wide = get_backend_class("window")(geometry, sinks=20, window=64)
    with pytest.raises(ConfigError, match=r"^window: sinks=20 \(KV_WINDOW_SINKS\) must fit one page of its sink tier "
                                          r"\(16 tokens a page\).* \(KV_BLOCK_SIZE is 16\)$"):
        check_pool({"window": wide, "dca": unprepared}, torch.float32, 16, None)
    with pytest.raises(ValueError, match=r"sinks=20 \(KV_WINDOW_SINKS\) must fit one page"):  # as after the load
        page_layouts({"window": wide, "dca": calibrated}, torch.float32, 16)


def test_past_the_most_pools_laid_out_the_pool_is_checked_after_the_load(setup, monkeypatch):
    """Each dca backend multiplies the pools to lay out (5 each on 8 layers): past
    :data:`server.backend_check.MAX_POOL_VARIANTS` none is laid out before the load (the engine checks the pool
    once calibrated), rather than start-up spending seconds on them."""
    import server.backend_check as backend_check
    from cache_backends.registry import create
    from server.config import ConfigError

    geometry = setup[2]
    served = {"window": create("window", geometry, sinks=20, window=64), "dca": create("dca", geometry),
              "dca+int8": create("dca+int8", geometry)}
    with pytest.raises(ConfigError, match="sinks=20"):  # 25 pools, every one refusing the sinks
        backend_check.check_pool(served, torch.float32, 16, None)
    monkeypatch.setattr(backend_check, "MAX_POOL_VARIANTS", 24)
    assert backend_check.possible_pages(served, torch.float32, 16) == set()
    backend_check.check_pool(served, torch.float32, 16, None)
