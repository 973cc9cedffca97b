"""Prefix caching over the paged pool: the block manager's cache bookkeeping, hits that change nothing a client
sees (full: token-identical, logits within fp32 rounding; int8: codes that do not depend on chunking), eviction
under pressure, and what never uses the cache (prompt log-probabilities, another cache_salt)."""

from __future__ import annotations

import pytest

from server.engine.block_manager import BlockManager, OutOfPages
from server.engine.prefix_cache import extend_hashes, root_key
from server.engine.sampling import SamplingParams
from tests.engine_helpers import make_engine, make_seq, reference_greedy, run_all
from tests.precision import LOGIT_FACTOR

FP32_EPS = 1.2e-7
PREFIX = " ".join(["In the beginning God created the heaven and the earth."] * 12)  # ~150 tokens


def _logprobs(events) -> list[float]:
    return [e.logprob for e in events if e.token_id >= 0]


def _serve(engine, tok, prompt: str, n: int, backend: str = "full", **fields):
    events = []
    seq = make_seq(tok, prompt, n, backend=backend, events=events)
    for k, v in fields.items():
        setattr(seq, k, v)
    run_all(engine, [seq])
    return seq, events


def test_block_manager_keeps_released_cached_blocks_and_evicts_the_oldest_first():
    bm = BlockManager(5)  # 4 usable pages
    a = bm.allocate(2)
    bm.register(a[0], b"h0")
    bm.register(a[1], b"h1")
    assert bm.lookup([b"h0", b"h1", b"h2"]) == a and bm.lookup([b"h1"]) == [a[1]] and bm.lookup([b"x"]) == []
    bm.free([a[1], a[0]])  # deepest block released first: first in line for eviction
    assert bm.num_free == 4 and bm.num_used == 0 and bm.num_evictable == 2 and bm.usage() == 0
    bm.acquire([a[0]])  # a hit takes it back from the eviction order
    assert bm.num_evictable == 1 and bm.num_used == 1 and bm.evictable_among(a) == 1
    got = bm.allocate(3)  # two free pages, then the oldest evictable one: a[1]
    assert a[1] in got and bm.lookup([b"h0", b"h1"]) == [a[0]]
    with pytest.raises(OutOfPages):
        bm.allocate(1)
    bm.free(got + [a[0]])
    assert bm.num_free == 4 and bm.lookup([b"h0"]) == [a[0]]
    bm.register(got[0], b"h0")  # a block another page holds already is not registered twice
    assert bm.lookup([b"h0"]) == [a[0]]


def test_block_hashes_chain_the_prefix_backend_and_salt():
    root = root_key("full", {}, None)
    h = extend_hashes([], root, list(range(40)), 16)
    assert len(h) == 2  # full blocks only
    assert extend_hashes(list(h), root, list(range(48)), 16)[:2] == h  # extended, not recomputed
    assert extend_hashes([], root, [99] + list(range(1, 40)), 16)[1] != h[1]  # a block's key depends on the past
    for other in (root_key("int8", {}, None), root_key("full", {"x": 1}, None), root_key("full", {}, "salt")):
        assert extend_hashes([], other, list(range(40)), 16)[0] != h[0]


def test_a_full_hit_is_token_identical_and_its_logits_equal_a_miss(ref_model):
    """A second request sharing a ~150-token prefix prefills only past its cached blocks; its greedy tokens
    are generate()'s and its log-probabilities equal those of the same request served without a cache."""
    model, tok = ref_model
    prompt = PREFIX + " And God said"
    engine = make_engine(model, tok)
    _serve(engine, tok, PREFIX + " And the earth was", 4)  # fills the cache
    seq, events = _serve(engine, tok, prompt, 24)
    bt = engine.kv.layouts["full"].cache_block_tokens
    assert seq.cached_tokens == (len(tok.encode(PREFIX)) // bt) * bt > 100
    miss, miss_events = _serve(make_engine(model, tok, prefix_caching=False), tok, prompt, 24)
    assert miss.cached_tokens == 0
    assert seq.output_ids == miss.output_ids == reference_greedy(model, tok, prompt, 24)
    assert _logprobs(events) == pytest.approx(_logprobs(miss_events), abs=LOGIT_FACTOR * FP32_EPS * 20)


def test_int8_prefill_gives_the_same_logits_however_it_is_chunked(ref_model):
    """Each prompt token reads its past as it would decoding alone (codes before its residual window, exact
    within it), so chunking, and hence the server's load, changes no int8 output beyond rounding."""
    model, tok = ref_model
    prompt = PREFIX + " And God said"
    out = []
    for chunk in (None, 48):
        engine = make_engine(model, tok, "int8", prefill_chunk_tokens=chunk, prefix_caching=False)
        out.append(_serve(engine, tok, prompt, 16, backend="int8"))
    (whole, ew), (chunked, ec) = out
    assert whole.output_ids == chunked.output_ids
    assert _logprobs(ew) == pytest.approx(_logprobs(ec), abs=LOGIT_FACTOR * FP32_EPS * 20)


@pytest.mark.parametrize("name,options", [("int8", {}), ("gqa", {"groups": 2}), ("mla", {"rank": 64}),
                                          ("mla+int8", {"rank": 64})], ids=["int8", "gqa", "mla", "mla+int8"])
def test_every_paged_backend_hits_with_the_logits_of_a_miss(ref_model, name, options):
    """Exact-tier backends (gqa, mla) hit with a miss's logits to fp32 rounding. int8-family backends share
    their quantized pages (whole groups), never their residual window: a hit's logits differ from a miss only
    where the tokens just before the hit are read as their codes instead of exact."""
    model, tok = ref_model
    prompt = PREFIX + " And God said"
    engine = make_engine(model, tok, name, **options)
    _serve(engine, tok, PREFIX + " And the earth was", 4, backend=name)
    seq, events = _serve(engine, tok, prompt, 16, backend=name)
    layout = engine.kv.layouts[name]
    assert seq.cached_tokens >= 3 * layout.cache_block_tokens and seq.cached_tokens % layout.cache_block_tokens == 0
    miss, miss_events = _serve(make_engine(model, tok, name, prefix_caching=False, **options), tok, prompt, 16,
                               backend=name)
    assert seq.output_ids == miss.output_ids
    # int8 measured: 7e-5 (fp32), against 4e-4 between a whole and a chunked prefill before prefill read its past
    # as decode does (test above)
    tol = 1e-3 if layout.quantization else LOGIT_FACTOR * FP32_EPS * 20
    assert _logprobs(events) == pytest.approx(_logprobs(miss_events), abs=tol)


def test_cached_blocks_are_evicted_when_the_pool_needs_them(ref_model):
    """A pool of 20 blocks: distinct prompts push the older prefixes out; everything is still served exactly."""
    model, tok = ref_model
    engine = make_engine(model, tok, budget=21 * 262144, max_batch_size=1)
    texts = [f"{w} " + " ".join([w] * 60) for w in ("And", "The", "Blessed", "Then")]  # ~4 blocks each
    for t in texts:
        seq, _ = _serve(engine, tok, t, 8)
        assert seq.output_ids == reference_greedy(model, tok, t, 8)
    assert engine.kv.blocks.num_free == engine.kv.blocks.usable_pages and engine.kv.blocks.num_evictable > 0
    again, _ = _serve(engine, tok, texts[-1], 8)
    assert again.cached_tokens > 0  # the newest prefix is still cached
    big = " ".join(["Israel"] * 300)  # ~19 blocks: takes the evictable pages
    seq, _ = _serve(engine, tok, big, 2)
    assert seq.output_ids == reference_greedy(model, tok, big, 2)
    first, _ = _serve(engine, tok, texts[0], 8)
    assert first.cached_tokens == 0


def test_prompt_logprobs_and_another_salt_do_not_hit(ref_model):
    model, tok = ref_model
    engine = make_engine(model, tok)
    prompt = PREFIX + " And God said"
    _serve(engine, tok, prompt, 2)
    salted, _ = _serve(engine, tok, prompt, 2, cache_salt="tenant-b")
    assert salted.cached_tokens == 0
    want, _ = _serve(engine, tok, prompt, 2, want_prompt_logprobs=True)
    assert want.cached_tokens == 0 and len(want.prompt_logprobs) == len(want.prompt_ids)
    same, _ = _serve(engine, tok, prompt, 2, cache_salt="tenant-b")
    assert same.cached_tokens > 0


def test_a_prompt_scored_alone_leaves_its_blocks_cached(ref_model):
    """``echo`` with ``max_tokens: 0`` (prompt log-probabilities, one token generated and dropped) cached nothing,
    though the docs say such prompts' blocks serve later requests."""
    model, tok = ref_model
    engine = make_engine(model, tok)
    prompt = PREFIX + " And God said"
    scored, _ = _serve(engine, tok, prompt, 1, want_prompt_logprobs=True)
    assert scored.cached_tokens == 0 and len(scored.prompt_logprobs) == len(scored.prompt_ids)
    later, _ = _serve(engine, tok, prompt, 2)
    bt = engine.kv.layouts["full"].cache_block_tokens
    assert later.cached_tokens == ((len(later.prompt_ids) - 1) // bt) * bt > 100
    assert later.output_ids == reference_greedy(model, tok, prompt, 2)


def test_a_preempted_sequence_takes_its_own_cached_blocks_back(ref_model):
    """Under a pool too small for four streams, a readmitted sequence recomputes only what left the cache."""
    model, tok = ref_model
    engine = make_engine(model, tok, budget=12 * 262144, max_batch_size=4)
    prompts = ["And God said", "The LORD is my shepherd", "In the beginning", "Blessed are the"]
    seqs = [make_seq(tok, p, 60) for p in prompts]
    hits = []
    engine.recorder = type("R", (), {"prefix_cache": lambda self, s, q, h: hits.append(h),
                                     "__getattr__": lambda self, name: (lambda *a, **k: None)})()
    run_all(engine, seqs)
    assert sum(s.preemptions for s in seqs) > 0 and any(h > 0 for h in hits)
    for p, s in zip(prompts, seqs):
        assert s.output_ids == reference_greedy(model, tok, p, 60)


def test_bench_prefix_refuses_a_bad_spec_before_loading_anything(capsys):
    from bench.prefix import main

    assert main(["--eviction-specs", "int8:group_size=0"]) == 2
    assert capsys.readouterr().err.startswith("bench.prefix: ")
