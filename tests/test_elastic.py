"""``elastic``: exact while the pool has room (full's tokens), int8 for the oldest groups when it runs short (no
preemption while something is compressible), its mixed pages attended in their stored form, and its figures."""

from __future__ import annotations

import pytest
import torch

from cache_backends.geometry import ModelGeometry
from cache_backends.paged import read_layer
from cache_backends.paged_attention import attend_pair
from cache_backends.step_meta import StepMeta
from cache_backends.registry import create
from server.engine.sequence import FinishReason
from server.metrics import Metrics, Recorder
from tests.engine_helpers import first_compression, make_engine, make_seq, raising_once, reference_greedy, run_all, run_step
from tests.precision import ATTENTION_FACTOR
from tests.test_paged import PagedDriver

PROMPTS = ["And God said", "The LORD is my shepherd"]
PAGE = 524288  # an elastic page on the reference model in fp32: 32 exact tokens (two blocks of 16) or 96 int8


def _value(registry, name, **labels):
    return registry.get_sample_value(name, labels)


def test_without_pressure_elastic_is_full(ref_model):
    model, tok = ref_model
    engine = make_engine(model, tok, "elastic")
    seqs = [make_seq(tok, p, 40, backend="elastic") for p in PROMPTS]
    run_all(engine, seqs)
    for p, s in zip(PROMPTS, seqs):
        assert s.output_ids == reference_greedy(model, tok, p, 40)
        assert s.kv_stats["compressed_fraction"] == 0


def test_under_pressure_it_compresses_instead_of_preempting(ref_model):
    """Two streams of ~200 tokens in 11 usable pages (352 exact tokens): full must preempt; elastic quantizes its
    oldest groups instead, stays within the pool, and says so in its metrics."""
    model, tok = ref_model
    full = make_engine(model, tok, budget=22 * 262144)
    full_seqs = [make_seq(tok, p, 200) for p in PROMPTS]
    run_all(full, full_seqs)
    assert sum(s.preemptions for s in full_seqs) > 0

    engine = make_engine(model, tok, "elastic", budget=12 * PAGE)
    assert engine.kv.page_bytes == PAGE and engine.kv.blocks.usable_pages == 11
    metrics = Metrics()
    engine.recorder = Recorder(metrics, "m", ["elastic"])
    events = [[] for _ in PROMPTS]
    seqs = [make_seq(tok, p, 200, backend="elastic", events=ev) for p, ev in zip(PROMPTS, events)]
    for s in seqs:
        engine.submit(s)
    tiers = []
    while engine.running or engine.waiting:
        run_step(engine)
        assert engine.kv_held_bytes() <= 12 * PAGE
        tiers.append(_value(metrics.registry, "kvserve_kv_cache_tier_tokens", model="m", backend="elastic",
                            tier="int8"))
    assert sum(s.preemptions for s in seqs) == 0
    for s, ev in zip(seqs, events):
        assert [e.index for e in ev] == list(range(200)) and s.finish_reason.value == "length"
        # some of its context, never its window of the newest 32 tokens
        assert 0 < s.kv_stats["compressed_fraction"] <= 1 - 32 / s.total_tokens
    r = metrics.registry
    assert _value(r, "kvserve_elastic_compressed_blocks_total", model="m", backend="elastic") > 0
    assert _value(r, "kvserve_elastic_preemptions_avoided_total", model="m", backend="elastic") > 0
    assert max(tiers) > 0 and tiers[-1] == 0  # codes held while running, none once done
    # the quantized tokens change few greedy choices on this model: the streams still read as full's
    agree = [sum(a == b for a, b in zip(s.output_ids, f.output_ids)) / 200 for s, f in zip(seqs, full_seqs)]
    assert min(agree) > 0.5, agree


def test_a_failed_compression_ends_the_sequences_it_compressed(ref_model, monkeypatch):
    """A compression that raises part-way (their block tables already name its codes) ends the sequences it
    compressed with an error event and frees their pages; the other stream runs to its end, the pool's free pages
    come back, and a later request gets a fresh engine's greedy tokens."""
    import server.engine.runner as runner_module

    model, tok = ref_model
    engine = make_engine(model, tok, "elastic", budget=12 * PAGE)
    free = engine.kv.blocks.num_free
    compressed = first_compression(engine)
    monkeypatch.setattr(runner_module, "drain_layer", raising_once(runner_module.drain_layer))
    events = [[] for _ in PROMPTS]
    seqs = [make_seq(tok, p, 200, backend="elastic", events=ev) for p, ev in zip(PROMPTS, events)]
    run_all(engine, seqs)
    failed = [s for s in seqs if s.finish_reason == FinishReason.ERROR]
    assert compressed and {s.seq_id for s in failed} == set(compressed) and len(failed) < len(seqs)
    for s, ev in zip(seqs, events):
        assert [e.index for e in ev[:-1]] == list(range(len(ev) - 1)) and engine.kv.table(s) is None
        if s in failed:
            assert ev[-1].finish_reason == FinishReason.ERROR and ev[-1].error == "compression failed: boom"
        else:
            assert s.finish_reason == FinishReason.LENGTH and len(s.output_ids) == 200
    assert engine.kv.blocks.num_free == free and engine.kv_held_bytes() == 0
    later, fresh = (make_seq(tok, "Blessed are the", 20, backend="elastic") for _ in range(2))
    run_all(engine, [later])
    run_all(make_engine(model, tok, "elastic", budget=12 * PAGE), [fresh])
    assert later.output_ids == fresh.output_ids and later.finish_reason == FinishReason.LENGTH


def test_mixed_pages_are_attended_as_their_dequantized_copy(ref_model):
    """After compression a row holds codes (oldest) and exact tokens: scoring on the codes equals exact attention
    over the dequantized copy of the same tokens (the stored-form identity)."""
    model, tok = ref_model
    g = ModelGeometry.from_config(model.config, next(model.parameters()).dtype)
    backend = create("elastic", g)
    driver = PagedDriver(model, backend, block_size=32)
    layout = driver.layout
    rows = [driver_blocks(driver, tok.encode(" ".join([p] * 60))) for p in PROMPTS]
    plans = [(b, layout.plan_compress(b, layout.compressible(b))) for b in rows]
    new = []
    for blocks, plan in plans:
        taken = driver.manager.allocate(plan.new_q_pages)
        layout.extend(blocks, plan, [], taken)
        new += taken
    driver.runner.compress([(backend, plans)], new)
    for blocks, plan in plans:
        driver.manager.free(layout.commit(blocks, plan))
    assert all(b.q_len >= 64 and b.exact_len >= 32 for b in rows)
    step = [(b, layout.plan(b, 1)) for b in rows]
    for blocks, plan in step:
        pages = driver.manager.allocate(plan.pages_needed)
        layout.extend(blocks, plan, pages, [])
    meta = StepMeta(layout, step, torch.device("cpu"))
    reads = read_layer(driver.pool.views["elastic"], 0, meta)
    assert reads[0].codes is not None
    query = torch.randn(len(rows), g.num_attention_heads, 1, g.head_dim)
    got = attend_pair(query, reads[0], reads[1], meta, g.head_dim ** -0.5)
    keys, values = (r.read().transpose(0, 1) for r in reads)  # (B, H, T, d), dequantized
    mask = meta.mask[:, None]  # (B, 1, 1, T)
    rep = g.num_attention_heads // g.num_key_value_heads
    ref = torch.nn.functional.scaled_dot_product_attention(query, keys.repeat_interleave(rep, 1),
                                                           values.repeat_interleave(rep, 1), attn_mask=mask,
                                                           scale=g.head_dim ** -0.5)
    scale = max(1.0, float((query @ keys.transpose(-1, -2)).abs().max()) * g.head_dim ** -0.5) * float(values.abs().max())
    assert torch.allclose(got, ref, atol=ATTENTION_FACTOR * torch.finfo(torch.float32).eps * scale * 4)


def driver_blocks(driver, ids):
    from cache_backends.page_plan import SeqBlocks

    blocks = SeqBlocks()
    driver.step([blocks], [ids])
    return blocks


def test_estimate_gives_elastic_a_range_and_spec_options_are_checked():
    from cache_backends.estimate import PRESETS, estimate_rows

    (row,) = estimate_rows(PRESETS["llama-3-8b"], [("elastic", {"window": 64})], [4096], [1], 2)
    (full,) = estimate_rows(PRESETS["llama-3-8b"], [("full", {})], [4096], [1], 2)
    (int8,) = estimate_rows(PRESETS["llama-3-8b"], [("int8", {"residual": 64})], [4096], [1], 2)
    assert row["bytes_per_token_per_layer"] == full["bytes_per_token_per_layer"]
    assert row["min_bytes_per_token_per_layer"] == int8["bytes_per_token_per_layer"]
    g = ModelGeometry(num_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=8, dtype_bytes=4)
    with pytest.raises(ValueError, match="window"):
        create("elastic", g, window=-1)
    with pytest.raises(ValueError, match="takes no option rank"):
        create("elastic", g, rank=4)


def test_the_compressed_share_is_reported_for_elastic_only():
    """TGI details (and the stream's last event) and OpenAI usage (completions and responses) carry
    kv_compressed_fraction for an elastic request (0 here: no pressure), and nothing new for other backends."""
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.config import load_settings
    from tests.conftest import MODEL_DIR

    app = create_app(load_settings(model_id=str(MODEL_DIR), kv_backend="full", kv_backends="full,elastic"),
                     load_in_background=False)
    with TestClient(app) as c:
        for backend, want in (("elastic", 0.0), ("full", None)):
            params = {"max_new_tokens": 3, "details": True, "kv_backend": backend}
            details = c.post("/generate", json={"inputs": "And God said", "parameters": params}).json()["details"]
            assert details.get("kv_compressed_fraction") == want and ("kv_compressed_fraction" in details) == bool(
                want is not None)
            usage = c.post("/v1/completions", json={"prompt": "And God said", "max_tokens": 3,
                                                    "kv_backend": backend}).json()["usage"]
            assert usage.get("kv_compressed_fraction") == want and ("kv_compressed_fraction" in usage) == bool(
                want is not None)
            usage = c.post("/v1/responses", json={"input": "And God said", "max_output_tokens": 3,
                                                  "kv_backend": backend}).json()["usage"]
            assert usage.get("kv_compressed_fraction") == want and ("kv_compressed_fraction" in usage) == bool(
                want is not None)
            with c.stream("POST", "/generate_stream", json={"inputs": "And God said", "parameters": params}) as r:
                last = [line for line in r.iter_lines() if line.startswith("data:")][-1]
            assert ("kv_compressed_fraction" in last) == (want is not None)


def test_advise_sizes_elastic_fully_compressed_and_says_why():
    from server.advise_cli import advise, rows_from_estimate

    rows = rows_from_estimate("models/kjv-llama-mha", "fp32", 1024, ["elastic", "int8", "full"])
    by = {r["backend"]: r for r in advise(rows, 1024, 4, 64 << 20, None)}
    assert by["elastic"]["need_bytes"] == by["int8"]["need_bytes"] < by["full"]["need_bytes"]
    assert "under pressure" in by["elastic"]["reason"]


def test_a_4bit_compressed_tier_is_int4_under_pressure_and_in_the_sums(ref_model):
    from cache_backends.estimate import PRESETS, estimate_rows

    model, tok = ref_model
    engine = make_engine(model, tok, "elastic", budget=12 * PAGE, bits=4)
    assert engine.kv.layouts["elastic"].q_tier == "int4"
    metrics = Metrics()
    engine.recorder = Recorder(metrics, "m", ["elastic"])
    seqs = [make_seq(tok, p, 200, backend="elastic") for p in PROMPTS]
    for s in seqs:
        engine.submit(s)
    most = 0
    while engine.running or engine.waiting:
        run_step(engine)
        most = max(most, _value(metrics.registry, "kvserve_kv_cache_tier_tokens", model="m", backend="elastic",
                                tier="int4") or 0)
    assert most > 0 and all(s.kv_stats["compressed_fraction"] > 0 for s in seqs)
    assert sum(s.preemptions for s in seqs) == 0
    (row,) = estimate_rows(PRESETS["llama-3-8b"], [("elastic", {"bits": 4})], [4096], [1], 2)
    (int4,) = estimate_rows(PRESETS["llama-3-8b"], [("int4", {})], [4096], [1], 2)
    assert row["min_bytes_per_token_per_layer"] == int4["bytes_per_token_per_layer"]


def test_a_request_int8_could_hold_alone_is_not_refused(ref_model):
    """15 usable pages hold 480 exact tokens: a 503-token request is refused by full, but elastic holds it
    compressed (as int8 would), so it is admitted and served."""
    model, tok = ref_model
    with pytest.raises(ValueError, match="KV blocks"):
        make_engine(model, tok, budget=32 * 262144).submit(make_seq(tok, "And God said", 500))
    engine = make_engine(model, tok, "elastic", budget=16 * PAGE)
    seq = make_seq(tok, "And God said", 500, backend="elastic")
    run_all(engine, [seq])
    assert len(seq.output_ids) == 500 and seq.preemptions == 0 and seq.kv_stats["compressed_fraction"] > 0


def test_whole_prompt_prefills_beside_running_streams_are_not_readmitted_in_a_loop(ref_model):
    """Prompts that want their log-probabilities are prefilled whole (their exact pages at once): admission charges
    that, instead of the chunked, compressed size, so they wait for room instead of being admitted and preempted
    again at every step (the attack that found it: 45-54 preemptions in half a second, the same prompt each time)."""
    model, tok = ref_model
    engine = make_engine(model, tok, "elastic", budget=16 * PAGE)
    text = " ".join(["And the LORD spake unto Moses, saying,"] * 60)
    ids = tok.encode(text)
    running = [make_seq(tok, "x", 300, backend="elastic") for _ in range(3)]
    for i, s in enumerate(running):
        s.prompt_ids = ids[i : i + 100]
        engine.submit(s)
    for _ in range(15):
        run_step(engine)
    scored = [make_seq(tok, "x", 60, backend="elastic") for _ in range(3)]
    for s, n in zip(scored, (300, 300, 331)):
        s.prompt_ids, s.want_prompt_logprobs = ids[:n], True
    run_all(engine, scored)
    assert sum(s.preemptions for s in running + scored) <= 3, [s.preemptions for s in running + scored]  # 9 before
    assert [len(s.prompt_logprobs) for s in scored] == [300, 300, 331]
    assert all(len(s.output_ids) == 300 for s in running)
