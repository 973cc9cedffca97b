"""One place for every byte count: a backend's :class:`cache_backends.kv_spec.KVSpec`.

The pool's page sizes, what a page of each tier holds, a sequence's stored bytes (admission, ``/info``, the
metrics) and the estimator's sums (``kvserve estimate``, ``advise``) are all computed by the spec's methods; a
served backend and the estimator describe the same spec for the same settings.
"""

from __future__ import annotations

import pytest
import torch

from cache_backends.geometry import ModelGeometry
from cache_backends.estimate import bytes_per_token_per_layer, kv_spec
from cache_backends.kv_spec import KVSpec, Quantization, StreamSpec, kv_streams
from cache_backends.page_plan import SeqBlocks, TierPlan
from cache_backends.registry import create

GEOMETRY = ModelGeometry(num_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32, dtype_bytes=4)
SPECS = [("full", {}), ("gqa", {"groups": 2}), ("mla", {"rank": 48}), ("int8", {}), ("int4", {"rotate": True}),
         ("int8", {"value_bits": 4, "group_size": 16, "residual": 8}), ("gqa+int8", {"groups": 1}),
         ("mla+int8", {"rank": 48}), ("mla+int4", {"rank": 48}), ("gqa+int4", {"groups": 2}), ("elastic", {}),
         ("elastic", {"bits": 4, "window": 64})]
IDS = [n + "".join(f":{k}={v}" for k, v in o.items()) for n, o in SPECS]
LENGTHS = [0, 1, 31, 32, 63, 64, 65, 100, 1000, 1024, 4097]


@pytest.mark.parametrize("name,options", SPECS, ids=IDS)
def test_a_served_backend_and_the_estimator_hold_the_same_spec(name, options):
    """The spec a backend serves (its streams, layers, element size and quantized tier, less ``rotate``, which
    costs no byte) is the one the estimator builds from the backend's sums name, so both give one byte count
    at every length."""
    backend = create(name, GEOMETRY, **options)
    served = backend.kv_spec()
    estimated = kv_spec(GEOMETRY.shape(), *backend.sums_spec(), GEOMETRY.dtype_bytes)
    if served.quantization:
        served = served.with_quantization(Quantization(**{**vars(served.quantization), "rotate": False}))
    assert served == estimated
    for t in LENGTHS:
        expected = bytes_per_token_per_layer(GEOMETRY.shape(), *backend.sums_spec(), GEOMETRY.dtype_bytes, t)
        assert backend.bytes_per_token_per_layer(t) == expected


def test_every_byte_count_is_the_specs(monkeypatch):
    """Doubling the spec's exact bytes doubles the estimator's sum, the backend's ``/info`` figure, its block
    size and a page layout's stored bytes: none of them counts bytes on its own."""
    backend = create("full", GEOMETRY)
    layout = backend.page_layout(torch.float32, backend.block_bytes(16))
    blocks = SeqBlocks(exact=[1, 2], exact_len=20)
    before = (bytes_per_token_per_layer(GEOMETRY.shape(), "full", {}, 4, 100), backend.bytes_per_token_per_layer(100),
              backend.block_bytes(16), layout.stored_bytes(blocks))
    exact_bytes = KVSpec.exact_bytes
    monkeypatch.setattr(KVSpec, "exact_bytes", lambda self, tokens, aligned=False: 2 * exact_bytes(self, tokens,
                                                                                                   aligned))
    after = (bytes_per_token_per_layer(GEOMETRY.shape(), "full", {}, 4, 100), backend.bytes_per_token_per_layer(100),
             backend.block_bytes(16), layout.stored_bytes(blocks))
    assert after == tuple(2 * b for b in before)


def test_the_sums_count_what_a_page_layout_holds():
    """A full page of each tier holds the tokens whose aligned slabs the spec counts, and a sequence's stored bytes
    are the spec's for its tiers' tokens."""
    backend = create("int8", GEOMETRY, group_size=16, residual=8)
    spec = backend.kv_spec()
    layout = backend.page_layout(torch.float32, 3 * backend.block_bytes(16))
    assert layout.used_bytes() == spec.q_bytes(layout.q_tokens, aligned=True) <= layout.page_bytes
    assert spec.exact_bytes(layout.exact_tokens, aligned=True) <= layout.page_bytes
    assert spec.exact_bytes(layout.exact_tokens + 1, aligned=True) > layout.page_bytes
    blocks = layout.written(SeqBlocks(), 100)
    assert (blocks.exact_len, blocks.q_len) == spec.tokens_held(100) == (8 + (100 - 8) % 16, 100 - 8 - (100 - 8) % 16)
    assert layout.stored_bytes(blocks) == spec.bytes_at(100)


@pytest.mark.parametrize("chunk", [1, 7, 16, 50, None])
def test_the_exact_window_is_the_pools_drain_rule_however_the_tokens_are_written(chunk):
    """:meth:`Quantization.exact_held` (what the sums count as exact) is what the pool's tier planning keeps
    exact after writing the same tokens, whole or in chunks."""
    q = Quantization(group_size=16, residual=8)
    plan = TierPlan(exact_tokens=24, q_tokens=32, quantization=q)
    blocks, written = SeqBlocks(), 0
    while written < 300:
        n = chunk or 300
        p = plan.plan(blocks, n)
        plan.extend(blocks, p, [0] * p.new_exact_pages, [0] * p.new_q_pages)
        plan.commit(blocks, p)
        written += n
        assert blocks.exact_len == q.exact_held(written)


def test_a_spec_refuses_what_no_page_can_hold():
    with pytest.raises(ValueError, match="two channels per byte"):
        KVSpec((StreamSpec(1, 33),), 2, 2, Quantization(32, 32, key_bits=4, value_bits=4))
    with pytest.raises(ValueError, match="needs streams"):
        KVSpec((), 2, 2)
    with pytest.raises(ValueError, match="no quantized tier"):
        KVSpec(tuple(kv_streams(2, 8)), 2, 2).q_bytes(32)
    backend = create("full", GEOMETRY)
    with pytest.raises(ValueError, match="cannot hold a KV spec"):
        backend.page_layout(torch.float16, backend.block_bytes(16))


@pytest.mark.parametrize("bits", [8, 4])
def test_elastic_alone_in_fp16_gets_pages_that_hold_a_group(bits):
    """Served alone in fp16, ``elastic``'s page was its 16-token exact block, too small for one 32-token group of its
    codes (scales and zero points included): the pool could not be laid out, after the weights loaded."""
    from server.engine.kv_cache import page_layouts

    geometry = ModelGeometry(num_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, dtype_bytes=2)
    page, layouts = page_layouts({"elastic": create("elastic", geometry, bits=bits)}, torch.float16, 16)
    assert layouts["elastic"].q_tokens >= 32 and layouts["elastic"].exact_tokens >= 16


def _walk(plan: TierPlan, prompt: int, total: int, chunk: int) -> int:
    """The most pages a sequence holds, step by step: its prompt in chunks, then one token a step (an on-demand
    tier compressing all it may after each step)."""
    blocks, most, left = SeqBlocks(), 0, prompt

    def step(n: int) -> None:
        nonlocal most
        p = plan.plan(blocks, n)
        plan.extend(blocks, p, [0] * p.new_exact_pages, [0] * p.new_q_pages)
        most = max(most, len(blocks.pages()))
        plan.commit(blocks, p)
        if plan.on_demand:
            c = plan.plan_compress(blocks, plan.compressible(blocks))
            plan.extend(blocks, c, [], blocks.exact[: c.new_q_pages])
            plan.commit(blocks, c)

    while left > 0:
        step(min(chunk, left))
        left -= min(chunk, left)
    for _ in range(total - prompt):
        step(1)
    return most


@pytest.mark.parametrize("on_demand", [False, True])
def test_the_pages_to_finish_bound_the_walk_of_every_step_closely(on_demand):
    """A fit check's pages (prompt in chunks, then one token a step) are never below what the steps hold, and at
    most two pages above them or above the prompt's peak cut anywhere (:meth:`TierPlan.prefill_peak`), for every
    layout whose quantized page holds at least an exact page's tokens."""
    for te, tq, g, r in [(10, 32, 16, 8), (10, 96, 32, 32), (32, 32, 32, 32), (32, 96, 32, 32), (32, 64, 16, 0),
                         (96, 96, 32, 8)]:
        plan = TierPlan(te, tq, Quantization(g, None, window=r) if on_demand else Quantization(g, r))
        for prompt in (1, 5, 40, 300):
            for total in (prompt, prompt + 1, prompt + 7, prompt + 63, prompt + 300):
                walked, bound = _walk(plan, prompt, total, 256), plan.pages_to_generate(prompt, total, 256)
                # above the walk of whole chunks by the peak of a prompt cut anywhere (the test below), which is tight
                assert walked <= bound <= max(walked, plan.prefill_peak(prompt, 256)) + 2, (te, tq, g, r, prompt, total)
    exact = TierPlan(32, 0)
    assert exact.pages_to_generate(5, 305, 256) == _walk(exact, 5, 305, 256) == 10


def _random_walk(plan: TierPlan, prompt: int, chunk: int, rng) -> int:
    """The most pages a sequence holds writing its prompt in steps of at most ``chunk`` tokens, each cut at random
    (as a step budget shared with other sequences cuts them: an on-demand tier compressing all it may after each)."""
    blocks, most, left = SeqBlocks(), 0, prompt
    while left:
        n = min(left, rng.choice([chunk, chunk, rng.randint(1, chunk)]))
        p = plan.plan(blocks, n)
        plan.extend(blocks, p, [0] * p.new_exact_pages, [0] * p.new_q_pages)
        most = max(most, len(blocks.pages()))
        plan.commit(blocks, p)
        left -= n
        if plan.on_demand:
            c = plan.plan_compress(blocks, plan.compressible(blocks))
            plan.extend(blocks, c, [], blocks.exact[: c.new_q_pages])
            plan.commit(blocks, c)
    return most


@pytest.mark.parametrize("on_demand", [False, True])
def test_the_pages_to_generate_bound_every_cut_of_the_prompt_into_steps(on_demand):
    """The scheduler cuts a prompt's steps anywhere (a budget shared with decoding sequences and other prefills,
    :meth:`KVCacheManager.step_tokens`), not in whole chunks from position 0, and a step that starts where the
    residual window is fullest and the exact pages least aligned holds more: a 141-token int8 prompt in steps of 95
    (a 100-token chunk beside 5 decoding tokens) held 15 pages where the bound, walking steps of 100, said 12. The
    bound is the most over every start ``p`` of a step of ``min(chunk, prompt - p)`` tokens (no looser: some cut
    reaches it), and no random cut holds more."""
    import random

    rng = random.Random(0)
    for te, tq, g, r in [(10, 32, 32, 32), (5, 32, 32, 32), (16, 16, 16, 16), (16, 48, 32, 32), (48, 160, 32, 32),
                         (7, 20, 8, 5), (10, 32, 16, 0), (3, 64, 32, 8), (96, 96, 32, 8)]:
        plan = TierPlan(te, tq, Quantization(g, None, window=r) if on_demand else Quantization(g, r))
        for prompt in (1, 5, 33, 75, 141, 300):
            for chunk in (1, 7, 16, 24, 64, 95, 100, 256):
                bound = plan.pages_to_generate(prompt, prompt, chunk)
                most = max(plan.prefill_pages(plan.written(SeqBlocks(), p), min(chunk, prompt - p))
                           for p in range(prompt))
                assert bound == most, (te, tq, g, r, prompt, chunk)
                for _ in range(3):
                    assert _random_walk(plan, prompt, chunk, rng) <= bound, (te, tq, g, r, prompt, chunk)
                for total in (prompt + 1, prompt + 40):
                    assert plan.pages_to_generate(prompt, total, chunk) >= bound
    int8 = TierPlan(10, 32, Quantization(32, 32))  # the reference model's int8 pages
    assert (int8.pages_for(141, 100), int8.pages_for(141, 95)) == (12, 15)
    assert int8.pages_to_generate(141, 141, 100) == 18  # a step of 100 from position 41 on, after one of 41


def test_a_quantized_request_is_not_charged_its_generated_tokens_as_prompt_chunks():
    """A 5-token prompt with 300 tokens to generate: int8 holds its quantized groups and a residual window, so it
    finishes in fewer pages than full, not more (its generated tokens were priced as if written 256 at a time,
    exact before they drain: 11 pages against full's 10 on the pages of a pool serving both)."""
    from server.engine.kv_cache import KVCacheManager
    from server.engine.sampling import SamplingParams
    from server.engine.sequence import Sequence

    backends = {"full": create("full", GEOMETRY), "int8": create("int8", GEOMETRY)}
    page = -(-max(b.block_bytes(32) for b in backends.values()) // 64) * 64
    layouts = {name: b.page_layout(torch.float32, page) for name, b in backends.items()}
    kv = KVCacheManager(backends, layouts, page, num_pages=11, prefill_chunk_tokens=256)
    need = {}
    for name in backends:
        seq = Sequence(request_id=name, prompt_ids=[1, 2, 3, 4, 5], max_new_tokens=300, params=SamplingParams(),
                       stop=[], backend_name=name)
        need[name] = kv.pages_to_finish(seq)
    assert need["full"] == 10 and need["int8"] < need["full"]
    assert need["int8"] <= _walk(layouts["int8"], 5, 305, 256) + 2


def test_info_gives_elastics_size_as_a_range():
    """``/info`` showed ``elastic`` at its most (every token exact) only; its least is the estimator's minimum."""
    from cache_backends.estimate import elastic_min_bytes_per_token_per_layer
    from server.engine_loading import kv_sizes

    backends = {name: create(name, GEOMETRY) for name in ("full", "int8", "elastic")}
    sizes = kv_sizes(backends, GEOMETRY.num_layers, 2048)
    least = elastic_min_bytes_per_token_per_layer(GEOMETRY.shape(), {}, GEOMETRY.dtype_bytes, 1024)
    assert sizes["kv_min_bytes_per_token"] == {"elastic": least * GEOMETRY.num_layers}
    assert sizes["kv_min_bytes_per_token"]["elastic"] < sizes["kv_bytes_per_token"]["elastic"] \
        == sizes["kv_bytes_per_token"]["full"]
