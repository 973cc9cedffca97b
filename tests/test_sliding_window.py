"""Sliding-window layers (Gemma 3's hybrid of sliding and global layers) on a tiny randomly initialised Gemma 3: no
download, the fast tier.

The model: 4 layers (sliding, sliding, global, sliding) of window 8, 4 query heads sharing 2 K/V heads, head_dim 32,
``query_pre_attn_scalar`` 20 (a softmax scale that is not ``head_dim ** -0.5``), and the two RoPE bases of Gemma 3
(10,000 on sliding layers, 1,000,000 on global ones). Pages of 4 tokens, so a window spans pages and starts inside
one; prompts and prefill chunks longer than the window.

* ``full`` through the paged pool, on the attention kernel and on the torch path, gives transformers' eager
  attention's logits at every step (a chunked prefill, a ragged step of a prefill beside another row, decodes);
* the per-sequence stores (the reference path the quality budget prices through) give them too;
* ``int8``/``int4`` with small groups (the window then starts inside the codes) give through the pool what their
  per-sequence stores give, on both attention paths;
* ``dca`` (layers reusing others' caches) and ``mla``/``gqa`` (one RoPE table for every layer, while Gemma 3
  rotates sliding and global layers with different bases) are refused with the reason.
"""

from __future__ import annotations

import copy

import pytest
import torch

from cache_backends import kernels
from cache_backends.geometry import ModelGeometry, layer_windows
from cache_backends.registry import create
from cache_backends.store_path import StorePath
from tests.engine_helpers import PagedDriver, with_eager_twin

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
LENGTH = 40


@pytest.fixture(scope="module")
def tiny():
    """``(model, eager)``: the tiny Gemma 3 with kvserve's attention, and its copy on transformers' eager attention."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=20,
                              sliding_window=WINDOW, layer_types=LAYER_TYPES, max_position_embeddings=256)
    torch.manual_seed(0)
    return with_eager_twin(Gemma3ForCausalLM(config).eval())


@pytest.fixture(scope="module")
def sequences(tiny):
    """Two token sequences of LENGTH and eager attention's logits at each of their positions, (2, LENGTH, vocab)."""
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (2, LENGTH))
    with torch.no_grad():
        logits = tiny[1](ids).logits
    return ids.tolist(), logits


def _attention_modes():
    return ["torch", "kernel"] if kernels.load() else ["torch"]


def test_the_geometry_reads_each_layers_window(tiny):
    from server.engine_loading import sliding_window_info

    geometry = ModelGeometry.from_config(tiny[0].config, torch.float32)
    assert geometry.layer_windows == (WINDOW, WINDOW, None, WINDOW) and geometry.sliding_layers == 3
    assert sliding_window_info(geometry) == {"tokens": WINDOW, "layers": [0, 1, 3]}  # /info
    config = copy.deepcopy(tiny[0].config)
    config.sliding_window = 4096  # longer than the context: masks nothing
    assert layer_windows(config) == ()


def test_kvserve_estimate_reads_the_windows_from_config_json_and_leaves_out_what_is_refused(tiny):
    """``kvserve estimate``'s shape from the config as saved: the same windows and RoPE facts as the served model's
    geometry, ``full`` counted with its windows kept, and the default rows without ``gqa``, ``mla`` and ``dca`` (with
    ``window``, which serves a model's own sliding layers)."""
    from cache_backends.estimate import Shape, bytes_per_token_per_layer
    from server.estimate_cli import resolve_specs

    config = tiny[0].config
    shape = Shape.from_config(config.to_dict())
    geometry = ModelGeometry.from_config(config, torch.float32)
    assert (shape.layer_windows, shape.rope_per_layer_type) == (geometry.layer_windows, True)
    assert geometry.shape().layer_windows == shape.layer_windows and geometry.shape().rope_per_layer_type
    assert bytes_per_token_per_layer(shape, "full", {}, 4, LENGTH) == create("full", geometry).bytes_per_token_per_layer(
        LENGTH)
    assert [name for name, _ in resolve_specs(shape, None, 4)] == ["full", "int8", "int8", "int4", "elastic", "window"]


def test_kv_sliding_window_pool_false_keeps_every_token_in_every_layer(tiny):
    from server.config import Settings
    from server.engine_loading import create_backends

    geometry = ModelGeometry.from_config(tiny[0].config, torch.float32)
    kept = create_backends(Settings(kv_backends=""), geometry)["full"]
    every = create_backends(Settings(kv_backends="", kv_sliding_window_pool=False), geometry)["full"]
    assert kept.window_groups() == [(None, [2]), (WINDOW, [0, 1, 3])] and every.window_groups() is None
    assert every.bytes_per_token_per_layer(LENGTH) == 512 > kept.bytes_per_token_per_layer(LENGTH)
    for name in ("int8", "int4"):  # the quantized tiers keep their windows too, and every token when told
        kept = create_backends(Settings(kv_backends=name), geometry)[name]
        every = create_backends(Settings(kv_backends=name, kv_sliding_window_pool=False), geometry)[name]
        assert kept.window_groups() == [(None, [2]), (WINDOW, [0, 1, 3])] and every.window_groups() is None
        assert every.bytes_per_token_per_layer(4096) > kept.bytes_per_token_per_layer(4096)
        assert type(every.page_layout(torch.float32, every.block_bytes(32))).__name__ == "PageLayout"
    elastic = create_backends(Settings(kv_backends="elastic"), geometry)["elastic"]
    assert elastic.window_groups() is None  # its tier fills on demand: every token in every layer


def _drive(driver: PagedDriver, ids: list[list[int]]) -> list[tuple[int, int, torch.Tensor]]:
    """A chunked prefill of row 0, a ragged step (row 0's next chunk beside row 1's whole prompt), then decodes of
    both rows to LENGTH: ``(row, position, logits)`` of every row's last token at every step."""
    a, b = driver.new_blocks(), driver.new_blocks()
    seen = [(0, 4, driver.step([a], [ids[0][:5]])[0])]
    out = driver.step([a, b], [ids[0][5:23], ids[1][:11]])
    seen += [(0, 22, out[0]), (1, 10, out[1])]
    for pa in range(23, LENGTH):
        pb = pa - 12
        out = driver.step([a, b], [[ids[0][pa]], [ids[1][pb]]])
        seen += [(0, pa, out[0]), (1, pb, out[1])]
    assert a.tokens == LENGTH
    driver.rows = (a, b)
    return seen


@pytest.mark.parametrize("windowed_pool", [True, False], ids=["windows-kept", "every-token-kept"])
@pytest.mark.parametrize("mode", _attention_modes())
def test_full_through_the_pool_gives_eager_attentions_logits(tiny, sequences, mode, windowed_pool):
    """With the sliding layers' pages keeping only their windows (:mod:`cache_backends.hybrid`), and with every layer
    keeping every token: transformers' eager logits at every step."""
    model, _ = tiny
    ids, reference = sequences
    backend = create("full", ModelGeometry.from_config(model.config, torch.float32))
    backend.windowed_pool = windowed_pool
    with kernels.using(mode):
        driver = PagedDriver(model, backend, pages=64, block_size=4)
        for row, pos, logits in _drive(driver, ids):
            torch.testing.assert_close(logits, reference[row, pos], rtol=0, atol=2e-5, msg=f"row {row} at {pos}")


def test_sliding_layers_give_back_the_pages_that_fall_out_of_their_window(tiny, sequences):
    """After the steps of :func:`_drive` (rows of 40 and 28 tokens, window 8): the global layer's group holds every
    token, the sliding layers' group only its last 7 (the next query sees them and itself), in at most
    ceil((tokens_per_page - 1 + 8) / tokens_per_page) pages; the bytes held are what the backend's sums say, and
    every other page is back in the pool."""
    from cache_backends.hybrid import HybridLayout

    model, _ = tiny
    backend = create("full", ModelGeometry.from_config(model.config, torch.float32))
    driver = PagedDriver(model, backend, pages=64, block_size=4)
    with kernels.using("torch"):
        _drive(driver, sequences[0])
    layout = driver.layout
    assert isinstance(layout, HybridLayout) and layout.windows == [None, WINDOW]
    assert layout.layers == [[2], [0, 1, 3]]
    held = 0
    for blocks, length in zip(driver.rows, (LENGTH, LENGTH - 12)):
        glob, sliding = blocks.groups
        assert (glob.first, glob.exact_len) == (0, length)
        assert (sliding.first, sliding.exact_len) == (length - (WINDOW - 1), WINDOW - 1)
        te = layout.groups[1].exact_tokens
        assert len(sliding.exact) <= -(-(te - 1 + WINDOW) // te)
        assert layout.stored_bytes(blocks) == pytest.approx(
            backend.bytes_per_token_per_layer(length) * length * 4, rel=1e-12)
        held += len(blocks.pages())
    assert driver.manager.num_free == 64 - 1 - held  # the null page, and the pages the rows hold
    # 2 (K, V) x 2 heads x 32 x 4 bytes = 512 per token and layer: 1 global layer of 40 tokens, 3 of 7
    assert backend.bytes_per_token_per_layer(LENGTH) * LENGTH * 4 == 512 * (LENGTH + 3 * 7)


def test_full_per_sequence_stores_give_eager_attentions_logits(tiny, sequences):
    model, _ = tiny
    ids, reference = sequences
    backend = create("full", ModelGeometry.from_config(model.config, torch.float32))
    runner = StorePath(model, 4)
    stores = [backend.new_store(), backend.new_store()]
    logits = [runner.prefill(ids[r][:20], stores[r], all_logits=True) for r in range(2)]
    for r in range(2):
        torch.testing.assert_close(logits[r], reference[r, :20], rtol=0, atol=2e-5)
    for pos in range(20, LENGTH):  # a batched decode of both stores
        out = runner.decode([ids[0][pos], ids[1][pos]], stores)
        torch.testing.assert_close(out, reference[:, pos], rtol=0, atol=2e-5, msg=f"decode at {pos}")


QUANTIZED = [("int8", {"group_size": 4, "residual": 4}), ("int4", {"group_size": 4, "residual": 4})]


@pytest.mark.parametrize("mode", _attention_modes())
@pytest.mark.parametrize("name,options", QUANTIZED, ids=[n for n, _ in QUANTIZED])
def test_quantized_tiers_through_the_pool_give_what_their_stores_give(tiny, sequences, mode, name, options):
    """The window starts inside the codes once a row passes window + residual tokens (the kernel then reads codes
    from the window's start); the stores (fed token by token, so that each token reads what the pool's chunked
    prefill reads: tests/test_paged.py) rebuild K/V and mask them. The two agree."""
    model, _ = tiny
    ids, _ = sequences
    backend = create(name, ModelGeometry.from_config(model.config, torch.float32), **options)
    runner = StorePath(model, 4)
    # the kernel scores a decode's 4-bit keys in integers unless asked for fp32 sums, as the stores compute
    # (tests/test_kernels.py bounds the integer sums' error)
    with kernels.using(mode), kernels.exact_sums():
        driver = PagedDriver(model, backend, pages=64, block_size=4)
        paged = _drive(driver, ids)
    expected = {}
    for r in range(2):  # token by token: every token reads the codes it reads decoding alone, as the pool's do
        store = backend.new_store()
        expected[(r, 0)] = runner.prefill(ids[r][:1], store)[-1]
        for pos in range(1, LENGTH):
            expected[(r, pos)] = runner.decode([ids[r][pos]], [store])[0]
    # Each path quantizes the K/V its own forward produced; a value on a rounding boundary then gets codes one step
    # apart (tests/test_paged.py). Measured on this model with the window and without it alike: up to 4e-4 (int8)
    # and 9e-4 (int4); a window one token off moves these logits by about 1e-1.
    tol = 1e-3 if name == "int8" else 3e-3
    for row, pos, logits in paged:
        torch.testing.assert_close(logits, expected[(row, pos)], rtol=0, atol=tol, msg=f"row {row} at {pos}")


def _ranges_as_mask(meta) -> torch.Tensor:
    """:attr:`StepMeta.ranges` as the (B, n, Tq + Te) mask they stand for: codes ``[q0, q)`` (``q0`` the fourth
    column, else 0), exact slots ``[lo, hi)``."""
    tq, te = meta.q_width, meta.positions.shape[1] - meta.q_width
    r = meta.ranges.long()
    iq, ie = torch.arange(tq), torch.arange(te)
    q0 = r[..., 3:4] if r.shape[-1] == 4 else torch.zeros_like(r[..., 0:1])
    codes = (iq[None, None] < r[..., 0:1]) & (iq[None, None] >= q0)
    exact = (ie[None, None] >= r[..., 1:2]) & (ie[None, None] < r[..., 2:3])
    return torch.cat([codes, exact], dim=-1)


@pytest.mark.parametrize("name,options", [("full", {})] + QUANTIZED, ids=["full"] + [n for n, _ in QUANTIZED])
def test_a_windowed_steps_mask_and_ranges_are_the_window(tiny, sequences, monkeypatch, name, options):
    """Every step's windowed metadata: its mask is the step's mask and ``p - window < t``, and its ranges (what the
    kernel reads) are that mask; a quantized layout's windows start inside the codes at some steps."""
    from cache_backends.step_meta import StepMeta

    model, _ = tiny
    seen = {"steps": 0, "cut": 0}
    windowed = StepMeta.windowed

    def checked(self, window):
        meta = windowed(self, window)
        want = self.mask & (self.positions[:, None, :] > self.query_positions[:, :, None] - window)
        assert torch.equal(meta.mask, want)
        assert torch.equal(_ranges_as_mask(meta), want)
        seen["steps"] += 1
        if meta.ranges.shape[-1] == 4:  # the codes a query sees start inside the tier
            seen["cut"] += bool(((meta.ranges[..., 3] > 0) & (meta.ranges[..., 3] < meta.ranges[..., 0])).any())
        return meta

    monkeypatch.setattr(StepMeta, "windowed", checked)
    backend = create(name, ModelGeometry.from_config(model.config, torch.float32), **options)
    with kernels.using("torch"):
        _drive(PagedDriver(model, backend, pages=64, block_size=4), sequences[0])
    assert seen["steps"] > 0 and (seen["cut"] > 0) == (name != "full")


@pytest.mark.parametrize("name,says", [("dca", r"3 of its 4 layers attend through a sliding window \(8 tokens\)"),
                                       ("dca+int8", "sliding window"), ("mla", "different RoPE parameters"),
                                       ("mla+int8", "different RoPE parameters"), ("gqa", "different RoPE parameters")])
def test_backends_that_cannot_serve_it_are_refused_saying_why(tiny, name, says):
    geometry = ModelGeometry.from_config(tiny[0].config, torch.float32)
    assert geometry.rope_per_layer_type
    with pytest.raises(ValueError, match=says):
        create(name, geometry)


def _codes_kept(length: int, residual: int, group: int, q_tokens: int) -> tuple[int, int, int]:
    """What the drop rule leaves a quantized sliding group of window :data:`WINDOW` after ``length`` tokens:
    ``(first, codes, code pages)``. The codes are the whole groups that leave ``residual`` tokens exact; a page of
    codes ``[a, a + q_tokens)`` goes once ``a + q_tokens - 1 < length - WINDOW + 1`` (the next query's first visible
    position), whole pages only, from the front."""
    codes = max(0, (length - residual) // group) * group
    first = q_tokens * min(codes // q_tokens, max(0, length - WINDOW + 1) // q_tokens)
    return first, codes - first, -(-(codes - first) // q_tokens)


@pytest.mark.parametrize("name,options", QUANTIZED, ids=[n for n, _ in QUANTIZED])
def test_quantized_sliding_layers_give_back_whole_code_pages_out_of_their_window(tiny, sequences, name, options):
    """After the steps of :func:`_drive` (rows of 40 and 28 tokens, window 8, groups of 4, 4 codes a page in the
    sliding group): the global layer holds every token (codes and the residual window), the sliding layers the codes
    the drop rule keeps (:func:`_codes_kept`: here one page, positions 32-35 of row 0) and their residual window;
    every other page is back in the pool; the bytes held are the kept tokens', at least the sums' (the newest
    ``window - 1``) and less than a page of codes above them; and less than with every token kept."""
    from cache_backends.hybrid import HybridLayout

    model, _ = tiny
    geometry = ModelGeometry.from_config(model.config, torch.float32)
    backend = create(name, geometry, **options)
    driver = PagedDriver(model, backend, pages=64, block_size=4)
    with kernels.using("torch"):
        _drive(driver, sequences[0])
    layout, q = driver.layout, backend.quantization
    assert isinstance(layout, HybridLayout) and layout.windows == [None, WINDOW]
    glob_layout, sliding_layout = layout.groups
    tq = sliding_layout.q_tokens
    assert tq == 4
    held = 0
    for blocks, length in zip(driver.rows, (LENGTH, LENGTH - 12)):
        glob, sliding = blocks.groups
        codes = max(0, (length - q.residual) // q.group_size) * q.group_size
        assert (glob.first, glob.q_len, glob.exact_len) == (0, codes, length - codes)
        first, kept, pages = _codes_kept(length, q.residual, q.group_size, tq)
        assert (sliding.first, sliding.q_len, len(sliding.q)) == (first, kept, pages)
        assert sliding.exact_len == length - codes
        assert first > 0 and length - WINDOW + 1 - tq < first <= length - WINDOW + 1  # one page holds older codes
        spec = backend.kv_spec()
        stored = spec.with_layers(1).stored_bytes(length - codes, codes) + spec.with_layers(3).stored_bytes(
            length - codes, kept)
        assert layout.stored_bytes(blocks) == stored
        sums = backend.bytes_per_token_per_layer(length) * length * 4
        per_code = spec.with_layers(3).q_bytes(q.group_size) / q.group_size
        assert sums <= stored < sums + tq * per_code
        assert layout.tier_tokens(blocks) == {"exact": length - codes, q.tier: round((codes + 3 * kept) / 4)}
        held += len(blocks.pages())
    assert driver.manager.num_free == 64 - 1 - held  # the null page, and the pages the rows hold
    every = create(name, geometry, **options)
    every.windowed_pool = False
    kept_all = PagedDriver(model, every, pages=64, block_size=4)
    with kernels.using("torch"):
        _drive(kept_all, sequences[0])
    assert kept_all.layout.stored_bytes(kept_all.rows[0]) > driver.layout.stored_bytes(driver.rows[0])


def _greedy(driver: PagedDriver, prompt: list[int], chunks: list[int], new: int) -> tuple[list[int], list]:
    """``prompt`` prefilled in steps of ``chunks`` tokens, then ``new`` greedy tokens: the tokens and every step's
    logits."""
    blocks, logits, at = driver.new_blocks(), [], 0
    for n in chunks:
        logits.append(driver.step([blocks], [prompt[at : at + n]])[0])
        at += n
    assert at == len(prompt)
    tokens = []
    for _ in range(new):
        tokens.append(int(logits[-1].argmax()))
        logits.append(driver.step([blocks], [[tokens[-1]]])[0])
    return tokens, logits


@pytest.mark.parametrize("mode", _attention_modes())
@pytest.mark.parametrize("name,options", QUANTIZED + [(n, {}) for n, _ in QUANTIZED],
                         ids=[f"{n}-small-groups" for n, _ in QUANTIZED] + [n for n, _ in QUANTIZED])
def test_quantized_greedy_tokens_are_those_of_every_token_kept(tiny, sequences, mode, name, options):
    """A 30-token prompt prefilled in steps of 5, 9 and 16 tokens (a step longer than the window: codes drained and
    dropped by the same step), then 40 greedy tokens (dropping a page of codes every 4 tokens): the same tokens as with
    every token kept (``KV_SLIDING_WINDOW_POOL=false``), the codes a query sees being the same codes. The kernel's
    logits are bit for bit the same; the torch path's gathers are shorter, so its matrix products sum in another
    order (measured: 3e-7 at most for int8, 2e-5 for int4, whose scales are fp16). The backends' defaults (groups
    of 32, 32 tokens exact) hold no code a window of 8 sees."""
    model, _ = tiny
    prompt = sequences[0][0][:30]
    geometry = ModelGeometry.from_config(model.config, torch.float32)
    out = {}
    for windowed in (True, False):
        backend = create(name, geometry, **options)
        backend.windowed_pool = windowed
        with kernels.using(mode):
            driver = PagedDriver(model, backend, pages=96, block_size=4)
            out[windowed] = _greedy(driver, prompt, [5, 9, 16], 40)
        if windowed and options:
            assert driver.layout.groups[1].q_tokens == 4
    assert out[True][0] == out[False][0]
    tol = 0 if mode == "kernel" else 1e-6 if name == "int8" else 1e-4
    for step, (a, b) in enumerate(zip(out[True][1], out[False][1])):
        torch.testing.assert_close(a, b, rtol=0, atol=tol, msg=f"step {step}")


@pytest.mark.parametrize("name,options", QUANTIZED + [("full", {})], ids=[n for n, _ in QUANTIZED] + ["full"])
def test_the_pages_a_walk_holds_stay_within_the_admission_bounds(tiny, name, options):
    """Prompts of 1-60 tokens prefilled in steps of 1, 3, 8 and 13 tokens, then decoded to 90, on the hybrid layout:
    no step holds more than :meth:`HybridLayout.pages_to_generate` says, nor more than the stored form of the whole
    prompt plus :meth:`HybridLayout.transient_pages` (what admission keeps free for a prefill step)."""
    from cache_backends.hybrid import HybridLayout

    backend = create(name, ModelGeometry.from_config(tiny[0].config, torch.float32), **options)
    page = -(-backend.block_bytes(4) // 64) * 64
    layout = backend.page_layout(torch.float32, page)
    assert isinstance(layout, HybridLayout)
    for chunk in (1, 3, 8, 13):
        for prompt in range(1, 61, 7):
            stored = layout.written(layout.cached_prefix([]), prompt)
            bound, transient = layout.pages_to_generate(prompt, 90, chunk), layout.transient_pages(stored, chunk)
            blocks, most = layout.cached_prefix([]), 0
            while blocks.tokens < 90:
                prefill = blocks.tokens < prompt
                n = min(chunk, prompt - blocks.tokens) if prefill else 1
                plan = layout.plan(blocks, n)
                layout.extend(blocks, plan, [0] * plan.new_exact_pages, [0] * plan.new_q_pages)
                held = len(blocks.pages())
                if prefill:
                    assert held <= len(stored.pages()) + transient, (chunk, prompt, blocks.tokens)
                most = max(most, held)
                layout.commit(blocks, plan)
                if blocks.tokens == prompt:
                    assert len(blocks.pages()) == len(stored.pages())  # the stored form is any chunking's
            assert most <= bound, (chunk, prompt)


# ---- prefix caching (cache_backends.hybrid: vLLM's hybrid rule) -------------------------------------------------
def _hybrid_layout(tiny, name: str = "full", **options):
    backend = create(name, ModelGeometry.from_config(tiny[0].config, torch.float32), **options)
    return backend.page_layout(torch.float32, -(-backend.block_bytes(4) // 64) * 64)


def test_a_hybrid_hit_needs_every_global_block_and_the_sliding_blocks_of_the_last_window(tiny):
    """The rule on keys alone: the global group (12 tokens a page, one layer) must hold every block of ``[0, L)``,
    the sliding group (4 tokens a page, three layers, window 8) the blocks of ``[L - 7, L)``; its earlier blocks are
    null in the hit. The hit's tables are what a walk to ``L`` leaves, and ``window`` layouts are not cached
    (quantized layouts are: ``tests/test_hybrid_quant_prefix.py``)."""
    layout = _hybrid_layout(tiny)
    (te_g, te_s), bt = [g.exact_tokens for g in layout.groups], layout.cache_block_tokens
    assert (te_g, te_s, bt, layout.windows) == (12, 4, 12, [None, WINDOW]) and layout.cacheable
    hashes = [[b"g%d" % i for i in range(10)], [b"s%d" % i for i in range(30)]]
    pages = {h: 100 + i for i, h in enumerate(hashes[0] + hashes[1])}

    def hit(missing=()):
        return layout.cache_hit(lambda h: None if h in missing else pages[h], hashes, 61)

    full = hit()
    assert len(full) == 60 // te_g + 60 // te_s
    blocks = layout.cached_prefix(full)
    walked = layout.written(layout.cached_prefix([]), 60)
    assert blocks.length == 60 and blocks.groups[0].exact == [pages[h] for h in hashes[0][:5]]
    for own, ref in zip(blocks.groups, walked.groups):
        assert (own.first, own.start, own.exact_len, len(own.exact)) == (ref.first, ref.start, ref.exact_len,
                                                                           len(ref.exact))
    assert blocks.groups[1].exact == [pages[hashes[1][13]], pages[hashes[1][14]]]  # [52, 60) holds [53, 60)
    assert full[5 : 5 + 13] == [0] * 13  # the sliding blocks before the window: null
    assert len(hit(missing=hashes[1][:13])) == len(full)  # blocks the window left are not needed
    short = hit(missing=[hashes[1][14]])  # [56, 60) gone: the longest L whose window is held is 48 ([41, 48))
    assert layout.cached_prefix(short).length == 48
    assert layout.cached_prefix(hit(missing=[hashes[1][11], hashes[1][14]])).length == 36  # 48 needs [44, 48)
    assert layout.cached_prefix(hit(missing=[hashes[0][2]])).length == 24  # the global run ends at block 2
    assert hit(missing=[hashes[0][0]]) == [] and hit(missing=hashes[1][2:]) == []
    assert not _hybrid_layout(tiny, "window", window=16, sinks=4).cacheable


def _tiny_engine(tiny, prefix_caching: bool = True):
    from transformers import AutoTokenizer

    from server.engine.setup import build_engine
    from tests.conftest import MODEL_DIR

    backend = create("full", ModelGeometry.from_config(tiny[0].config, torch.float32))
    return build_engine(tiny[0], AutoTokenizer.from_pretrained(str(MODEL_DIR)), {"full": backend}, set(),
                        max_batch_size=4, budget_bytes=None, max_total_tokens=256, block_size=4,
                        prefill_chunk_tokens=16, prefix_caching=prefix_caching)


def _tiny_serve(engine, ids: list[int]):
    from tests.engine_helpers import serve_counting_pages

    return serve_counting_pages(engine, ids, 12)


def test_a_hybrid_prefix_longer_than_the_window_is_a_hit_with_the_same_tokens(tiny):
    """A second request sharing a 60-token prefix (7.5 windows) prefills only past its 60 cached tokens, allocates
    fewer pages, and decodes the tokens it decodes with no prefix cache; every page is back in the pool after each
    request (free count), the blocks kept evictable."""
    torch.manual_seed(2)
    prefix = torch.randint(3, 128, (60,)).tolist()
    first, second = prefix + [5, 6, 7], prefix + [9, 10, 11, 12]
    engine = _tiny_engine(tiny)
    kv = engine.scheduler.kv
    usable = kv.blocks.usable_pages
    assert kv.info()["prefix_cached_backends"] == ["full"]
    _tiny_serve(engine, first)
    assert kv.blocks.num_free == usable and kv.blocks.num_evictable > 0
    seq, taken = _tiny_serve(engine, second)
    assert kv.blocks.num_free == usable and kv.blocks.num_used == 0
    miss, taken_miss = _tiny_serve(_tiny_engine(tiny, prefix_caching=False), second)
    assert (seq.cached_tokens, miss.cached_tokens) == (60, 0)
    assert seq.output_ids == miss.output_ids
    assert taken < taken_miss  # 5 global blocks, and the 13 sliding pages its window would have passed through
    with kernels.using("torch"):  # the torch path reads the hit's tables the same way
        again, _ = _tiny_serve(engine, second)
    assert again.cached_tokens == 60 and again.output_ids == miss.output_ids


def test_a_hybrid_prefix_whose_window_blocks_were_evicted_is_recomputed(tiny):
    """Pages taken under pressure evict the cached blocks released first (the sliding blocks the window left during
    the first request, then the global blocks deepest first): the second request gets a shorter hit or none, and the
    same tokens; the pool is whole afterwards."""
    torch.manual_seed(3)
    prefix = torch.randint(3, 128, (60,)).tolist()
    second = prefix + [9, 10, 11, 12]
    engine = _tiny_engine(tiny)
    kv = engine.scheduler.kv
    _tiny_serve(engine, prefix + [5, 6, 7])
    kept = 10  # of the cached pages: those released last (the global blocks and the last window's)
    kv.blocks.free(kv.blocks.allocate(kv.blocks.num_free - kept))
    assert kv.blocks.num_evictable == kept
    seq, _ = _tiny_serve(engine, second)
    miss, _ = _tiny_serve(_tiny_engine(tiny, prefix_caching=False), second)
    assert seq.cached_tokens < 60 and seq.output_ids == miss.output_ids
    assert kv.blocks.num_free == kv.blocks.usable_pages


def test_a_hybrid_hit_shares_the_pages_of_a_running_request(tiny):
    """A second request admitted while the first decodes takes the first's blocks (the global ones it holds, the
    sliding ones its window left, now evictable, and those it still holds): both decode what they decode alone with no
    prefix cache, and every page is back in the pool at the end."""
    from server.engine.sampling import SamplingParams
    from server.engine.sequence import Sequence
    from tests.engine_helpers import run_all, run_step, serve_counting_pages

    torch.manual_seed(4)
    prefix = torch.randint(3, 128, (60,)).tolist()
    first, second = prefix + [5, 6, 7], prefix + [9, 10, 11, 12]
    engine = _tiny_engine(tiny)
    kv = engine.scheduler.kv
    a = Sequence(request_id="a", prompt_ids=first, max_new_tokens=30, params=SamplingParams(ignore_eos=True), stop=[],
                 backend_name="full")
    engine.submit(a)
    while len(a.output_ids) < 3:
        run_step(engine)
    shared = kv.table(a).groups[0].exact[:5]  # its global blocks of [0, 60)
    b = Sequence(request_id="b", prompt_ids=second, max_new_tokens=12, params=SamplingParams(ignore_eos=True),
                 stop=[], backend_name="full")
    engine.submit(b)
    run_step(engine)
    assert b.cached_tokens == 60 and [kv.blocks.ref[p] for p in shared] == [2] * 5
    run_all(engine, [])
    alone = _tiny_engine(tiny, prefix_caching=False)
    assert a.output_ids == serve_counting_pages(alone, first, 30)[0].output_ids
    assert b.output_ids == serve_counting_pages(alone, second, 12)[0].output_ids
    assert kv.blocks.num_free == kv.blocks.usable_pages


def _preempted_readmission(tiny, second_prompt: int):
    """Two requests on a pool of 18 pages that cannot hold both: the second is preempted (its pages released, its
    blocks left in the prefix cache) and readmitted once the first ends. Returns the sequences, what the second held
    per group when preempted and, at its readmission, ``(context tokens, prefix-cache hit, tokens served from it)``."""
    from transformers import AutoTokenizer

    from server.engine.sampling import SamplingParams
    from server.engine.sequence import Sequence
    from server.engine.setup import build_engine
    from tests.conftest import MODEL_DIR
    from tests.engine_helpers import run_all

    torch.manual_seed(5)
    ids = [torch.randint(3, 128, (60,)).tolist() for _ in range(2)]
    prompts = [ids[0][:36], ids[1][:second_prompt]]
    backend = create("full", ModelGeometry.from_config(tiny[0].config, torch.float32))
    page = -(-backend.block_bytes(4) // 64) * 64
    engine = build_engine(tiny[0], AutoTokenizer.from_pretrained(str(MODEL_DIR)), {"full": backend}, set(),
                          max_batch_size=4, budget_bytes=18 * page, max_total_tokens=256, block_size=4,
                          prefill_chunk_tokens=16)
    kv = engine.scheduler.kv
    held, readmitted = [], []
    release, start = kv.release, kv.start

    def on_release(seq):  # the second's first release is its preemption
        if seq.request_id == "b" and (table := kv.table(seq)) is not None:
            held.append([list(g.exact) for g in table.groups])
        release(seq)

    def on_start(seq):
        hit, served = list(seq.prefix_hit), start(seq)
        if seq.preemptions:
            readmitted.append((len(seq.context_ids), hit, served))
        return served

    kv.release, kv.start = on_release, on_start
    seqs = [Sequence(request_id=r, prompt_ids=p, max_new_tokens=n, params=SamplingParams(ignore_eos=True), stop=[],
                     backend_name="full") for r, p, n in zip("ab", prompts, (30, 40))]
    run_all(engine, seqs)
    alone = [_tiny_serve_n(tiny, p, n) for p, n in zip(prompts, (30, 40))]
    return seqs, alone, held, readmitted


def _tiny_serve_n(tiny, ids: list[int], n: int) -> list[int]:
    from tests.engine_helpers import serve_counting_pages

    return serve_counting_pages(_tiny_engine(tiny, prefix_caching=False), ids, n)[0].output_ids


def test_a_preempted_hybrid_sequence_takes_its_own_blocks_back(tiny):
    """#44: preempted at 61 tokens, the sequence's readmission hits its own blocks under the hybrid rule: every global
    block of [0, 60) (the pages its global layer held) and, of the sliding blocks, only those of the last window,
    [53, 60) (the two pages its sliding layers held; the earlier ones null). It recomputes the one token left and
    decodes what it decodes unpreempted."""
    seqs, alone, held, readmitted = _preempted_readmission(tiny, 34)
    assert [s.preemptions for s in seqs] == [0, 1]
    (context, hit, served), = readmitted
    assert (context, served) == (61, 60)  # 60 from the cache, 1 recomputed
    glob, sliding = held[0]
    assert hit[:5] == glob[:5]  # [0, 60) in 12-token pages
    assert hit[5:] == [0] * 13 + sliding[:2]  # 4-token blocks 0-12 null, 13-14 ([52, 60)) the pages it held
    assert [s.output_ids for s in seqs] == alone


@pytest.mark.xfail(strict=True, reason="#44: a hit must end on a global block (12 tokens) before the last token, "
                                       "and the sliding blocks of that earlier window were evicted before the "
                                       "preemption (the pool was exhausted): the whole context is recomputed")
def test_a_sequence_preempted_past_a_global_block_recomputes_only_the_rest(tiny):
    """Preempted at 64 tokens, the sequence holds every global block of [0, 60) and its window [57, 64); the hit
    at 60 needs the sliding blocks of [53, 60), which left the window (and the pool) before the preemption."""
    seqs, alone, _, readmitted = _preempted_readmission(tiny, 40)
    assert [s.preemptions for s in seqs] == [0, 1] and [s.output_ids for s in seqs] == alone
    (context, _, served), = readmitted
    assert context == 64 and served > 0
