"""``dca``'s layers read in place by the attention kernel (:func:`cache_backends.dca.paged.
attend_in_place_through_map`: the layer's own pages and its source's with the map folded in, merged by their
log-sum-exp, in one op, :func:`kernels.dca_attention`) against the torch path over the same pages
gathered (:func:`cache_backends.dca.paged.attend_through_map`), inside the engine's own steps: every reuse layer's
output of every decode step (rows reading their source, their window, or falling back) compared, and every kept
layer's and every own-pages-only attention (a prompt's, its tokens read exact under a quantized inner) with the same
pages gathered."""

from __future__ import annotations

import pytest
import torch

from cache_backends import kernels
from cache_backends.dca import backend as dca_backend
from cache_backends.dca.paged import attend_through_map, gathered
from cache_backends.geometry import ModelGeometry
from cache_backends.paged import InPlaceRead
from tests.conftest import fits
from tests.test_kernels import FOUR_BIT, KERNEL_DTYPES

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"the attention kernel is not available: "
                                                           f"{kernels.status()['reason']}")


@pytest.fixture(scope="module")
def setup(ref_model):
    from cache_backends.calibration import calibration_ids

    model, tok = ref_model
    geometry = ModelGeometry.from_config(model.config, torch.float32)
    return model, tok, geometry, calibration_ids(model, tok, max_tokens=4096)


@pytest.mark.parametrize("name,options", [
    ("dca", {"threshold": -1.0, "window": 32}), ("dca", {"threshold": -1.0, "window": 0, "align": "none"}),
    ("dca", {"probe_interval": 2}), ("dca+int8", {"threshold": -1.0}), ("dca+int4", {"threshold": -1.0}),
    ("dca+int4", {"threshold": -1.0, "rotate": True}), ("dca+int8", {"probe_interval": 3, "window": 0}),
    ("dca+mla", {"threshold": -1.0})],
    ids=["reuse-window", "reuse-no-map", "fallbacks", "int8-reuse", "int4-reuse", "int4-rotated-reuse",
         "int8-fallbacks", "mla-reuse"])
def test_a_reuse_layer_read_in_place_gives_the_gathered_attention(setup, name, options, monkeypatch):
    """Three prompts served together: each reuse layer's attention through the kernel (the source's and its own pages
    in place) equals, within fp32 rounding, the torch path's over the same pages gathered, in every step, as does
    each kept layer's and each own-pages-only attention; the kernel path is the one the engine takes (``dca+mla``:
    the latent's op for kept layers and own pages, the map over its source's latent in the dca op, every source
    head's keys rebuilt inside it)."""
    from cache_backends.registry import create
    from server.engine.sampling import SamplingParams
    from server.engine.sequence import Sequence
    from tests.engine_helpers import make_engine, run_all

    model, tok, geometry, calib = setup
    backend = create(name, geometry, **options)
    backend.prepare(model, calib, fits(model))
    in_place, calls = dca_backend.attend_in_place_through_map, []

    def counted(layer_map, query, src, src_meta, own, own_meta, own_from, scaling, limit, latents=()):
        calls.append((query.shape[2], any(p > 0 for p in own_from), any(p == 0 for p in own_from)))
        return in_place(layer_map, query, src, src_meta, own, own_meta, own_from, scaling, limit, latents)

    monkeypatch.setattr(dca_backend, "attend_in_place_through_map", counted)
    attend, compared = backend.attend_paged, []

    def checked(layer, query, reads, meta, scaling, module=None):  # a reuse layer through the kernel: the gathered
        before = len(calls)                                          # path's attention over the same pages
        got = attend(layer, query, reads, meta, scaling, module)
        if len(calls) > before:
            i, source = reads.index, meta.sources[layer - 1]
            want = attend_through_map(backend.maps[layer - 1], query, source.kv(), meta.kept, reads.own_kv(),
                                      meta.candidates[i], torch.tensor(meta.own_from[i]), scaling,
                                      meta.position_limit)
            torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
            compared.append(layer)
        return got

    monkeypatch.setattr(backend, "attend_paged", checked)
    inner_attend, inner_calls = backend.inner.attend_paged, []

    def checked_inner(layer, query, reads, meta, scaling, module=None):  # kept layers; a reuse layer's own pages alone
        got = inner_attend(layer, query, reads, meta, scaling, module)
        if isinstance(reads[0], InPlaceRead):
            want = inner_attend(layer, query, gathered(reads, meta), meta, scaling, module)
            torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
            inner_calls.append(query.shape[2])
        return got

    monkeypatch.setattr(backend.inner, "attend_paged", checked_inner)
    prompts, n = [calib[:100], calib[300:345], calib[600:700]], 24
    engine = make_engine(model, tok, name, prepared=backend)
    seqs = [Sequence(request_id=str(i), prompt_ids=list(p), max_new_tokens=n, params=SamplingParams(), stop=[],
                     backend_name=name) for i, p in enumerate(prompts)]
    # 4-bit keys in fp32, as the torch path sums them (a decode's few rows score them in integers otherwise, within a
    # third of the codes' own error: tests/test_kernels.py)
    with kernels.exact_sums(name.endswith("int4")):
        run_all(engine, seqs)
    assert calls, "no reuse layer went through the kernel"
    assert len(compared) == len(calls)
    assert all(n_new == 1 for n_new, _, _ in calls)  # a prompt attends its own K/V (own_from 0): no source read
    assert any(n_new > 1 for n_new in inner_calls) and any(n_new == 1 for n_new in inner_calls)


def _seen(meta, ranges) -> list[list[int]]:
    """Per row, the positions its first query token sees under ``ranges`` (codes ``[q0, q)``, exact slots ``[lo, hi)``)."""
    out = []
    for b in range(ranges.shape[0]):
        q, lo, hi = (int(x) for x in ranges[b, 0, :3])
        q0 = int(ranges[b, 0, 3]) if ranges.shape[-1] > 3 else 0
        codes = meta.positions[b, q0:q].tolist()
        exact = meta.positions[b, meta.q_width + lo: meta.q_width + hi].tolist()
        out.append(sorted(codes + exact))
    return out


def test_ranges_before_and_from_split_a_steps_tokens_at_a_position():
    """:meth:`StepMeta.ranges_before` and :meth:`ranges_from` cut each query's visible tokens at a position: the
    two together see what the step's ranges see, and nothing twice (exact and quantized layouts)."""
    from cache_backends.page_plan import SeqBlocks
    from tests.test_kernels import Pool, _grow

    for tier in ("exact", "int8"):
        pool = Pool(tier, 2, 64, torch.float32, tokens_per_page=16, seed=3)
        rows = [SeqBlocks() for _ in range(3)]
        _grow(pool, rows, [40, 70, 100], chunk=50)
        meta = pool.write(rows, [1, 1, 1], commit=False)
        cut = torch.tensor([[0], [33], [80]])
        before, after = meta.ranges_before(cut), meta.ranges_from(cut)

        whole, b_seen, a_seen = (_seen(meta, r) for r in (meta.ranges, before, after))
        for b in range(3):
            assert sorted(b_seen[b] + a_seen[b]) == whole[b]
            assert all(p < int(cut[b]) for p in b_seen[b]) and all(p >= int(cut[b]) for p in a_seen[b])
        pool.commit()


def _random_map(heads: int, width: int, gen: torch.Generator):
    """A :class:`LayerMap` of random complex key mixes, key bias, value map and value bias (Llama RoPE)."""
    from cache_backends.dca.maps import LayerMap
    from cache_backends.rope import RopeTable

    half = width // 2
    mix = torch.complex(torch.randn(heads, heads, half, generator=gen), torch.randn(heads, heads, half, generator=gen))
    return LayerMap((0.5 * mix).to(torch.complex64), 0.3 * torch.randn(heads, width, generator=gen),
                    torch.randn(heads, heads, width, width, generator=gen) * width ** -0.5,
                    0.1 * torch.randn(heads, width, generator=gen), RopeTable.llama(width, 4096))


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("tier", ["exact", "int8", "int4", "int4-rotated"])
@pytest.mark.parametrize("heads,rep,width", [(2, 3, 64), (3, 1, 32)], ids=["gqa2x3-d64", "mha3-d32"])
@pytest.mark.parametrize("dtype", [d for d in KERNEL_DTYPES if d != torch.float16], ids=str)
def test_a_map_over_pages_in_place_gives_the_gathered_attention(heads, rep, width, tier, splits, dtype, monkeypatch):
    """A reuse layer's attention through a random map, over a source pool and its own pool read in place, against the
    same pages gathered: GQA and MHA, exact and quantized pages (rotated too), each row cut at another position
    (nothing from its own pages, most, or nearly all of its source), a decode and prefill chunks (one of two query
    tiles), blocks split over work units or not,
    in fp32 (within fp32 rounding) and bf16 (within its rounding of the fp32 sums)."""
    from cache_backends.dca.paged import attend_in_place_through_map
    from cache_backends.page_plan import SeqBlocks
    from cache_backends.paged import in_place_layer, read_layer
    from tests.test_kernels import Pool, _fp32, _grow

    monkeypatch.setenv("KVSERVE_KERNEL_SPLITS", str(splits))
    gen = torch.Generator().manual_seed(heads * rep + width)
    layer_map = _random_map(heads, width, gen)
    src, own = (Pool(tier, heads, width, dtype, tokens_per_page=16, seed=s) for s in (1, 2))
    lengths = [30, 70, 130]
    rows = {id(p): [SeqBlocks() for _ in lengths] for p in (src, own)}
    for p in (src, own):
        _grow(p, rows[id(p)], lengths, chunk=64)
    for n, cut in ((1, [0, 40, 128]), (5, [0, 20, 131]), (140, [0, 90, 150])):  # the last: two query tiles
        metas = [p.write(rows[id(p)], [n] * len(lengths), commit=False) for p in (src, own)]
        query = torch.randn(len(lengths), heads * rep, n, width, generator=gen).to(dtype)
        limit, scaling = max(lengths) + n + 1, width ** -0.5
        with kernels.exact_sums(tier in FOUR_BIT), kernels.using("kernel"):
            got = attend_in_place_through_map(layer_map, query, in_place_layer(src.views, 0), metas[0],
                                              in_place_layer(own.views, 0), metas[1], cut, scaling, limit)
        gold = attend_through_map(layer_map, query.float(), [_fp32(r) for r in read_layer(src.views, 0, metas[0])],
                                  metas[0], [_fp32(r) for r in read_layer(own.views, 0, metas[1])], metas[1],
                                  torch.tensor(cut), scaling, limit)
        tol = 2e-4 if dtype == torch.float32 else 2e-2
        assert got.dtype == dtype and got.shape == gold.shape
        torch.testing.assert_close(got.float(), gold, rtol=tol, atol=tol)
        for p in (src, own):
            p.commit()


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("heads,rep,width,rank", [(2, 3, 64, 48), (3, 1, 32, 40)], ids=["gqa2x3-d64", "mha3-d32"])
@pytest.mark.parametrize("dtype", [d for d in KERNEL_DTYPES if d != torch.float16], ids=str)
def test_a_map_over_latents_in_place_gives_the_gathered_attention(heads, rep, width, rank, splits, dtype,
                                                                  monkeypatch):
    """``dca+mla``: a reuse layer's attention through a random map over a source layer's post-hoc latent and its
    own, read in place (every source head's keys rebuilt from the latent inside the op), against the K/V the
    latents stand for, rebuilt and gathered: GQA and MHA, a decode and prefill chunks, split or not, with a map and
    without one."""
    from cache_backends.dca.maps import LayerMap
    from cache_backends.dca.paged import attend_in_place_through_map
    from cache_backends.page_plan import SeqBlocks
    from cache_backends.paged import in_place_layer, read_layer
    from tests.test_kernels import _fp32, _grow
    from tests.test_kernels_mla import PosthocPool

    monkeypatch.setenv("KVSERVE_KERNEL_SPLITS", str(splits))
    gen = torch.Generator().manual_seed(heads * rep + width)
    mapped = _random_map(heads, width, gen)
    unmapped = LayerMap(None, None, None, None, mapped.rope)
    src, own = (PosthocPool(heads, rep, width, rank, dtype, tokens_per_page=16, seed=s) for s in (1, 2))
    lengths = [30, 70, 130]
    rows = {id(p): [SeqBlocks() for _ in lengths] for p in (src, own)}
    for p in (src, own):
        _grow(p, rows[id(p)], lengths, chunk=64)
    for n, cut in ((1, [0, 40, 128]), (5, [0, 20, 131]), (140, [0, 90, 150])):
        metas = [p.write(rows[id(p)], [n] * len(lengths), commit=False) for p in (src, own)]
        query = torch.randn(len(lengths), heads * rep, n, width, generator=gen).to(dtype)
        limit, scaling = max(lengths) + n + 1, width ** -0.5
        latents = (src.backend._kernel_bases(0), own.backend._kernel_bases(0), *src.backend.rope.float_tables(limit))
        kv = [p.backend.stored_kv(0, [_fp32(r) for r in read_layer(p.views, 0, m)], m) for p, m in zip((src, own), metas)]
        for layer_map in (mapped, unmapped):
            with kernels.using("kernel"):
                got = attend_in_place_through_map(layer_map, query, in_place_layer(src.views, 0), metas[0],
                                                  in_place_layer(own.views, 0), metas[1], cut, scaling, limit, latents)
            gold = attend_through_map(layer_map, query.float(), kv[0], metas[0], kv[1], metas[1], torch.tensor(cut),
                                      scaling, limit)
            tol = 5e-4 if dtype == torch.float32 else 3e-2
            assert got.dtype == dtype and got.shape == gold.shape
            torch.testing.assert_close(got.float(), gold, rtol=tol, atol=tol)
        for p in (src, own):
            p.commit()


@pytest.mark.parametrize("tier", ["int8", "int4-rotated", "latent"])
def test_a_reuse_layers_decode_is_two_ops(tier):
    """With the kernel, a reuse layer's decode step writes its own K/V in one op and attends in one: its source's
    pages through the map and its own pages, the cut between them and the merge all inside it (``latent``:
    ``dca+mla``, every source head's keys rebuilt inside it; the torch path: gathers, the rebuild, the fold, the value
    map and the softmax in many ops)."""
    from cache_backends.dca.paged import attend_in_place_through_map
    from cache_backends.page_plan import SeqBlocks
    from cache_backends.paged import in_place_layer, read_layer, write_layer
    from tests.test_kernels import CountOps, Pool, _grow
    from tests.test_kernels_mla import PosthocPool

    gen = torch.Generator().manual_seed(7)
    layer_map = _random_map(3, 64, gen)
    if tier == "latent":
        src, own = (PosthocPool(3, 3, 64, 48, torch.float32, tokens_per_page=16, seed=s) for s in (1, 2))
        latents = (src.backend._kernel_bases(0), own.backend._kernel_bases(0), *src.backend.rope.float_tables(200))
    else:
        src, own = (Pool(tier, 3, 64, torch.float32, tokens_per_page=16, seed=s) for s in (1, 2))
        latents = ()
    lengths = [50, 60, 70, 80]
    rows = {id(p): [SeqBlocks() for _ in lengths] for p in (src, own)}
    for p in (src, own):
        _grow(p, rows[id(p)], lengths, chunk=64)
    counts = {}
    for mode in ("kernel", "torch"):
        with kernels.using(mode):
            metas = [p.write(rows[id(p)], [1] * 4, commit=False) for p in (src, own)]
            query, new = torch.randn(4, 9, 1, 64), own.new_tokens(4, 1)  # K and V, or a latent's one stream
            layer_map._per_query_head(9), layer_map.rope.float_tables(200)  # the map's constants: once, not per step
            _ = metas[0].row_offsets  # the source's (the kept layers' step metadata): once per step
            with CountOps() as counter:
                write_layer(own.views, 0, metas[1], new)
                if mode == "kernel":
                    attend_in_place_through_map(layer_map, query, in_place_layer(src.views, 0), metas[0],
                                                in_place_layer(own.views, 0), metas[1], [0, 20, 40, 79], 0.125, 200,
                                                latents)
                else:
                    kv = [read_layer(p.views, 0, m) for p, m in zip((src, own), metas)]
                    if latents:
                        kv = [p.backend.stored_kv(0, r, m) for p, r, m in zip((src, own), kv, metas)]
                    attend_through_map(layer_map, query, kv[0], metas[0], kv[1], metas[1],
                                       torch.tensor([0, 20, 40, 79]), 0.125, 200)
            for p in (src, own):
                p.commit()
            counts[mode] = counter.ops
    write = "index_put_" if latents else "paged_write"  # a latent's one stream: an indexed copy
    assert counts["kernel"] == [write, "paged_dca_attention"], counts["kernel"]
    assert len(counts["torch"]) > 20


def test_the_dca_op_refuses_arguments_that_do_not_fit():
    """A key fold, value map or key bias of the wrong shape, cuts that are not four a row, a latent's bases beside
    K/V pages, or ranges with attention sinks: a RuntimeError naming what is wrong, never a read outside a tensor."""
    from cache_backends.page_plan import SeqBlocks
    from cache_backends.paged import in_place_layer
    from tests.test_kernels import Pool, _grow

    gen = torch.Generator().manual_seed(3)
    layer_map = _random_map(2, 64, gen)
    src, own = (Pool("int8", 2, 64, torch.float32, tokens_per_page=16, seed=s) for s in (1, 2))
    rows = {id(p): [SeqBlocks() for _ in range(2)] for p in (src, own)}
    for p in (src, own):
        _grow(p, rows[id(p)], [30, 40], chunk=64)
    metas = [p.write(rows[id(p)], [1, 1], commit=False) for p in (src, own)]
    query = torch.randn(2, 4, 1, 64)
    fold, value_map, value_bias = layer_map._per_query_head(4)
    cos, sin = layer_map.rope.float_tables(100)
    good = [fold, value_map, value_bias, layer_map.key_bias, cos, sin]

    def attend(map_args, cuts=(0, 0, 20, 20, 0, 0, 30, 30), latents=()):
        return kernels.dca_attention(query, in_place_layer(src.views, 0)[0], metas[0],
                                     in_place_layer(own.views, 0)[0], metas[1], list(cuts), 0.125, map_args, latents)

    assert attend(good).shape == query.shape
    for i, bad, message in ((0, fold[:, :, :64], "key_fold must be"), (1, value_map[:2], "value_map must be"),
                            (2, value_bias[:, :32], "value_bias must be"), (3, layer_map.key_bias[:1], "key_bias must be")):
        with pytest.raises(RuntimeError, match=message):
            attend(good[:i] + [bad] + good[i + 1:])
    with pytest.raises(RuntimeError, match="map must be"):
        attend(good[:4])
    with pytest.raises(RuntimeError, match="cuts must hold four entries a row"):
        attend(good, cuts=(0, 0, 20, 20))
    bases = (fold[:2], fold[:2, 0], fold[:2], fold[:2, 0])
    with pytest.raises(RuntimeError, match="must be a post-hoc latent"):
        attend(good, latents=(bases, bases, cos, sin))
    metas[1].ranges = torch.zeros(2, 1, 6, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="no attention sinks"):
        attend(good)


def test_a_windows_ranges_are_cut_in_their_own_columns():
    """On a sliding window's ranges (a fourth column: the first code seen), :meth:`StepMeta.ranges_from` raises that
    column and the first exact slot instead of adding a column, and the cut keeps what the window already hid."""
    from cache_backends.page_plan import SeqBlocks
    from tests.test_kernels import Pool, _grow

    pool = Pool("int8", 2, 64, torch.float32, tokens_per_page=16, seed=4)
    rows = [SeqBlocks() for _ in range(2)]
    _grow(pool, rows, [60, 90], chunk=50)
    meta = pool.write(rows, [1, 1], commit=False).windowed(40)
    assert meta.ranges.shape[-1] == 4
    for cut in ([[10], [70]], [[55], [85]]):
        window = _seen(meta, meta.ranges)
        after, before = meta.ranges_from(torch.tensor(cut)), meta.ranges_before(torch.tensor(cut))
        assert after.shape == before.shape == meta.ranges.shape
        for b, (c,) in enumerate(cut):
            assert _seen(meta, after)[b] == [p for p in window[b] if p >= c]
            assert _seen(meta, before)[b] == [p for p in window[b] if p < c]
