"""Prefix caching of ``int8``/``int4`` on a hybrid model (:mod:`cache_backends.hybrid`): each group's code pages are
its blocks, keyed per group; a hit of ``L`` tokens needs every global code page of ``[0, L)`` and each sliding
group's code pages of ``[L - W + 1, L)``. On the tiny Gemma 3 of :mod:`tests.test_sliding_window` (window 8, one
global layer and three sliding ones), groups of 4 tokens and 4 exact: a global code page holds 12 tokens, a sliding
one 4, so a hit is a multiple of 12 tokens.
"""

from __future__ import annotations

import pytest
import torch

from cache_backends import kernels
from cache_backends.geometry import ModelGeometry
from cache_backends.page_plan import NULL_PAGE, SeqBlocks
from cache_backends.registry import create
from tests.test_sliding_window import QUANTIZED, WINDOW, _attention_modes, _hybrid_layout, tiny  # noqa: F401

IDS = [n for n, _ in QUANTIZED]


@pytest.mark.parametrize("name,options", QUANTIZED, ids=IDS)
def test_a_quantized_hybrid_hit_is_every_global_code_page_and_the_last_windows(tiny, name, options):
    """The rule on keys alone: 61 tokens looked up give 60 (5 global code pages, the sliding code pages of [52, 60),
    what the window of the next query, [53, 60), needs; the 13 before it null). The hit's tables hold the 60 tokens
    as codes, a sliding group from a page's start; written on by 20 tokens (more than the residual) they are what a
    walk of the 80 tokens from nothing leaves. A missing window page shortens the hit, a missing global page ends it
    there, and the global group alone (every sliding page gone) is no hit. ``window`` (sinks) and ``elastic``
    (on demand) stay uncached."""
    layout = _hybrid_layout(tiny, name, **options)
    (tq_g, tq_s), bt = [g.q_tokens for g in layout.groups], layout.cache_block_tokens
    assert (tq_g, tq_s, bt, layout.windows) == (12, 4, 12, [None, WINDOW]) and layout.cacheable
    assert [g.cache_block_tokens for g in layout.groups] == [12, 4]
    hashes = [[b"g%d" % i for i in range(10)], [b"s%d" % i for i in range(30)]]
    pages = {h: 100 + i for i, h in enumerate(hashes[0] + hashes[1])}

    def hit(missing=()):
        return layout.cache_hit(lambda h: None if h in missing else pages[h], hashes, 61)

    full = hit()
    assert full == [pages[h] for h in hashes[0][:5]] + [NULL_PAGE] * 13 + [pages[hashes[1][13]], pages[hashes[1][14]]]
    blocks = layout.cached_prefix(full)
    assert blocks.length == 60
    assert blocks.groups[0] == SeqBlocks(q=[100, 101, 102, 103, 104], q_len=60)
    assert blocks.groups[1] == SeqBlocks(q=[pages[hashes[1][13]], pages[hashes[1][14]]], q_len=8, first=52)
    on, walked = layout.written(blocks, 20), layout.written(layout.cached_prefix([]), 80)
    for own, ref in zip(on.groups, walked.groups):
        assert (own.first, own.q_len, own.exact_len, len(own.q), len(own.exact)) == (
            ref.first, ref.q_len, ref.exact_len, len(ref.q), len(ref.exact))
    assert len(hit(missing=hashes[1][:13])) == len(full)  # code pages the window left are not needed
    assert layout.cached_prefix(hit(missing=[hashes[1][14]])).length == 48  # 48 needs [41, 48): pages 10, 11
    assert layout.cached_prefix(hit(missing=[hashes[1][11], hashes[1][14]])).length == 36
    assert layout.cached_prefix(hit(missing=[hashes[0][2]])).length == 24
    assert hit(missing=[hashes[0][0]]) == [] and hit(missing=hashes[1]) == []  # the global group alone: no hit
    assert not _hybrid_layout(tiny, "window", window=16, sinks=4).cacheable
    assert not _hybrid_layout(tiny, "window+int8", window=64, sinks=4).cacheable
    assert not _hybrid_layout(tiny, "elastic").cacheable  # every token in every layer, quantized on demand


@pytest.mark.parametrize("name,options", QUANTIZED, ids=IDS)
def test_every_code_page_is_registered_before_the_window_frees_it(tiny, name, options):
    """Walks of 70 tokens in steps of 1, 3, 8 and 13 (a step longer than the window drains and drops code pages at
    once): :meth:`HybridLayout.full_blocks` names each group's code block ``b`` once, in order, with the page that
    holds positions ``[b * q_tokens, (b + 1) * q_tokens)``, before the commit that frees it; the exact pages (the
    residual window) are never named."""
    layout = _hybrid_layout(tiny, name, **options)
    for chunk in (1, 3, 8, 13):
        blocks, plan_pages, named, at = layout.cached_prefix([]), iter(range(1, 10_000)), {}, 0
        code_page_of = [{}, {}]  # group -> block -> the page its codes were written to
        while blocks.length < 70:
            n = min(chunk, 70 - blocks.length)
            plan = layout.plan(blocks, n)
            layout.extend(blocks, plan, [next(plan_pages) for _ in range(plan.new_exact_pages)],
                          [next(plan_pages) for _ in range(plan.new_q_pages)])
            for g, (own, p) in enumerate(zip(blocks.groups, plan.groups)):
                tq = layout.groups[g].q_tokens
                for t in range(own.first + own.q_len, own.first + own.q_len + p.drained):
                    code_page_of[g].setdefault(t // tq, own.q[(t - own.first) // tq])
            for g, b, page in layout.full_blocks(blocks, plan):
                assert (g, b) not in named
                named[g, b] = page
            exact = {p for own in blocks.groups for p in own.exact}
            freed = layout.commit(blocks, plan)
            assert all(p in named.values() for p in freed if p not in exact), (chunk, at)
            at += n
        codes = (70 - 4) // 4 * 4
        for g, tq in enumerate(group.q_tokens for group in layout.groups):
            assert sorted(b for gg, b in named if gg == g) == list(range(codes // tq))
            assert all(named[g, b] == code_page_of[g][b] for b in range(codes // tq))
        assert not set(named.values()) & {p for own in blocks.groups for p in own.exact}


@pytest.mark.parametrize("name,options", QUANTIZED, ids=IDS)
def test_a_walk_from_a_hit_stays_within_the_admission_bounds(tiny, name, options):
    """From hits of 12-60 tokens, the rest of a 75-token prompt in steps of 1, 3, 8 and 13, then decodes to 100: no
    prefill step holds more pages (the hit's included) than the stored form of the whole prompt plus
    :meth:`HybridLayout.transient_pages`, the stored form is the walk's, and no decode step holds more than
    :meth:`HybridLayout.pages_to_generate` (the bound a prompt with no hit gets; its prefill walk is that of steps cut
    at multiples of the chunk, which a hit's are not, nor a prompt's whose steps are cut shorter)."""
    layout = _hybrid_layout(tiny, name, **options)
    for length in range(12, 61, 12):
        hit = [7] * (length // 12) + [7] * (length // 4)
        for chunk in (1, 3, 8, 13):
            start = layout.cached_prefix(hit)
            stored = layout.written(start, 75 - length)
            transient, bound = layout.transient_pages(stored, chunk), layout.pages_to_generate(75, 100, chunk)
            blocks = start.copy()
            while blocks.length < 100:
                prefill = blocks.length < 75
                plan = layout.plan(blocks, min(chunk, 75 - blocks.length) if prefill else 1)
                layout.extend(blocks, plan, [0] * plan.new_exact_pages, [0] * plan.new_q_pages)
                if prefill:
                    assert len(blocks.pages()) <= len(stored.pages()) + transient, (length, chunk, blocks.length)
                else:
                    assert len(blocks.pages()) <= bound, (length, chunk, blocks.length)
                layout.commit(blocks, plan)
                if blocks.length == 75:
                    assert len(blocks.pages()) == len(stored.pages())


def _engine(tiny, name: str, options: dict, prefix_caching: bool = True):
    from transformers import AutoTokenizer

    from server.engine.setup import build_engine
    from tests.conftest import MODEL_DIR

    backend = create(name, ModelGeometry.from_config(tiny[0].config, torch.float32), **options)
    return build_engine(tiny[0], AutoTokenizer.from_pretrained(str(MODEL_DIR)), {name: backend}, set(),
                        max_batch_size=4, budget_bytes=None, max_total_tokens=256, block_size=4,
                        prefill_chunk_tokens=16, prefix_caching=prefix_caching)


def hit_code_pages(engine, name: str, prefix: list[int], length: int) -> list[bytes]:
    """The bytes of the code pages ``engine``'s prefix cache holds for a hit of ``length`` tokens of ``prefix``
    (each group's keys, :func:`server.engine.prefix_cache.group_root`): every global group's of ``[0, length)``, each
    sliding group's of its last window; a page's bytes are whole (pages are zeroed when taken)."""
    from server.engine.prefix_cache import extend_hashes, group_root, root_key

    kv, arena = engine.scheduler.kv, engine.runner.pool.arena
    layout, root = kv.layouts[name], root_key(name, kv.backends[name].params(), None)
    out = []
    for g, (group, window) in enumerate(zip(layout.groups, layout.windows)):
        tq = group.q_tokens
        hashes = extend_hashes([], group_root(root, g), prefix[:length], tq)
        lo = 0 if window is None else max(0, length - window + 1) // tq
        pages = [kv.blocks.cached_page(h) for h in hashes[lo:]]
        assert None not in pages
        out += [arena[p].cpu().numpy().tobytes() for p in pages]
    return out


def _serve(engine, ids: list[int], name: str):
    from tests.engine_helpers import serve_counting_pages

    return serve_counting_pages(engine, ids, 12, backend=name)


@pytest.mark.parametrize("mode", _attention_modes())
@pytest.mark.parametrize("name,options", QUANTIZED, ids=IDS)
def test_a_quantized_hybrid_prefix_longer_than_the_window_is_a_hit_with_the_same_tokens(tiny, mode, name, options):
    """A second request sharing a 60-token prefix (7.5 windows, 15 residual windows) prefills only past its cached
    tokens (int8: 60, 5 global and 2 sliding code pages; int4, whose pages in this pool hold 24 and 8 codes: 48, 2
    and 1), whose bytes are those the second request writes itself in a fresh engine, takes fewer pages from the
    pool, and decodes what it decodes with no prefix cache; every page is back in the pool after each request."""
    torch.manual_seed(2)
    prefix = torch.randint(3, 128, (60,)).tolist()
    first, second = prefix + [5, 6, 7], prefix + [9, 10, 11, 12]
    with kernels.using(mode):
        engine = _engine(tiny, name, options)
        kv = engine.scheduler.kv
        usable = kv.blocks.usable_pages
        layout = kv.layouts[name]
        bt, (tq_g, tq_s) = layout.cache_block_tokens, [g.q_tokens for g in layout.groups]
        assert kv.info()["prefix_cached_backends"] == [name] and kv.info()["block_size_tokens"] == {name: bt}
        hit = 60 // bt * bt
        pages = hit // tq_g + hit // tq_s - max(0, hit - WINDOW + 1) // tq_s  # global ones, the last window's
        _serve(engine, first, name)
        assert kv.blocks.num_free == usable and kv.blocks.num_evictable > 0
        acquired = []
        take = kv.blocks.acquire
        kv.blocks.acquire = lambda pages: acquired.extend(pages) or take(pages)
        seq, taken = _serve(engine, second, name)
        del kv.blocks.acquire
        assert kv.blocks.num_free == usable and kv.blocks.num_used == 0
        miss, taken_miss = _serve(_engine(tiny, name, options, prefix_caching=False), second, name)
        alone = _engine(tiny, name, options)  # a miss that caches: the code pages it writes itself
        _serve(alone, second, name)
        assert hit_code_pages(alone, name, prefix, hit) == hit_code_pages(engine, name, prefix, hit)
    assert (bt, hit, pages) == ((12, 60, 5 + 2) if name == "int8" else (24, 48, 2 + 1))  # int4: 8 codes a page
    assert (seq.cached_tokens, miss.cached_tokens, len(acquired)) == (hit, 0, pages)
    assert seq.output_ids == miss.output_ids
    assert taken < taken_miss


@pytest.mark.parametrize("name,options", QUANTIZED, ids=IDS)
def test_a_quantized_hybrid_prefix_whose_window_pages_were_evicted_gives_a_shorter_hit(tiny, name, options):
    """Pages taken under pressure evict the cached code pages released first (the sliding ones the window left, then
    the deepest global ones): the second request gets a shorter hit or none, and the tokens of a miss."""
    torch.manual_seed(3)
    prefix = torch.randint(3, 128, (60,)).tolist()
    second = prefix + [9, 10, 11, 12]
    engine = _engine(tiny, name, options)
    kv = engine.scheduler.kv
    _serve(engine, prefix + [5, 6, 7], name)
    kept = 6  # of the cached pages: those released last
    kv.blocks.free(kv.blocks.allocate(kv.blocks.num_free - kept))
    assert kv.blocks.num_evictable == kept
    seq, _ = _serve(engine, second, name)
    miss, _ = _serve(_engine(tiny, name, options, prefix_caching=False), second, name)
    assert seq.cached_tokens < 60 and seq.output_ids == miss.output_ids
    assert kv.blocks.num_free == kv.blocks.usable_pages


@pytest.mark.parametrize("name,options", QUANTIZED, ids=IDS)
def test_a_quantized_hybrid_hit_shares_the_code_pages_of_a_running_request(tiny, name, options):
    """A second request admitted while the first decodes takes the first's code pages (the global ones it holds,
    the sliding ones its window left, now evictable): the global ones are then held twice, both requests decode what
    they decode alone with no prefix cache, and every page is back in the pool at the end."""
    from server.engine.sampling import SamplingParams
    from server.engine.sequence import Sequence
    from tests.engine_helpers import run_all, run_step, serve_counting_pages

    # seed 5: with seed 4 int4's first token is a near tie (a miss's differs from full's), which the hit's reading
    # of [44, 48) as 4-bit codes, where a miss reads them exact, flips (over seeds 2-11 a hit agrees with a miss on
    # all 12 tokens 8 times, and disagrees only where the miss disagrees with full)
    torch.manual_seed(5)
    prefix = torch.randint(3, 128, (60,)).tolist()
    first, second = prefix + [5, 6, 7], prefix + [9, 10, 11, 12]
    engine = _engine(tiny, name, options)
    kv = engine.scheduler.kv
    a = Sequence(request_id="a", prompt_ids=first, max_new_tokens=30, params=SamplingParams(ignore_eos=True), stop=[],
                 backend_name=name)
    engine.submit(a)
    while len(a.output_ids) < 3:
        run_step(engine)
    hit = 60 // kv.layouts[name].cache_block_tokens * kv.layouts[name].cache_block_tokens
    shared = kv.table(a).groups[0].q[: hit // kv.layouts[name].groups[0].q_tokens]  # its global code pages
    b = Sequence(request_id="b", prompt_ids=second, max_new_tokens=12, params=SamplingParams(ignore_eos=True),
                 stop=[], backend_name=name)
    engine.submit(b)
    run_step(engine)
    assert b.cached_tokens == hit and [kv.blocks.ref[p] for p in shared] == [2] * len(shared) and shared
    run_all(engine, [])
    alone = _engine(tiny, name, options, prefix_caching=False)
    assert a.output_ids == serve_counting_pages(alone, first, 30, backend=name)[0].output_ids
    assert b.output_ids == serve_counting_pages(alone, second, 12, backend=name)[0].output_ids
    assert kv.blocks.num_free == kv.blocks.usable_pages
