"""The prefill budget bounded by step cost (server/engine/itl_budget.py, ``PREFILL_ITL_RATIO``): sized from the
measured cost of a decode step and of a prefilled token, applied only while sequences decode, and obeyed by the
scheduler: a long prompt beside a decoding stream is written in chunks of that size, its tokens unchanged."""

from __future__ import annotations

import pytest

from server.engine.itl_budget import MAX_TOKENS_PER_DECODE_STEP, MIN_ITL_CHUNK, ChunkBudget


def measured(ratio=2.0, decode_s=0.010, token_s=0.0001) -> ChunkBudget:
    b = ChunkBudget(ratio, weight=1.0)
    b.observe(0, 8, decode_s)
    b.observe(100, 8, decode_s + 100 * token_s)
    return b


def test_the_bound_is_the_tokens_that_cost_ratio_minus_one_decode_steps():
    b = measured(ratio=2.0, decode_s=0.010, token_s=0.0001)
    assert b.decode_s == pytest.approx(0.010) and b.token_s == pytest.approx(0.0001)
    assert b.tokens(8, 248) == 100  # 100 tokens x 0.1 ms = one decode step more
    assert measured(ratio=3.0).tokens(8, 248) == 200
    assert measured(ratio=3.0).tokens(8, 120) == 120  # within the configured budget


def test_it_never_goes_below_a_block():
    assert measured(token_s=0.01).tokens(8, 248) == MIN_ITL_CHUNK


@pytest.mark.parametrize("budget", [None, 248])
def test_without_decoding_rows_or_a_ratio_the_configured_budget_holds(budget):
    assert measured().tokens(0, budget) == budget  # nothing decodes: no stream to protect
    assert ChunkBudget(None).tokens(8, budget) == budget


def test_before_both_costs_are_measured_a_chunk_beside_decoding_rows_is_one_block():
    """The first long prompt after start-up stalled the running streams for a whole 256-token chunk (6-8 decode
    steps on SmolLM2-135M) before anything was measured."""
    b = ChunkBudget(2.0, weight=1.0)
    assert b.tokens(8, 248) == MIN_ITL_CHUNK and b.tokens(0, 248) == 248
    b.observe(0, 8, 0.010)
    assert b.tokens(8, 248) == MIN_ITL_CHUNK  # a decode step measured, a prefilled token not yet
    b.observe(MIN_ITL_CHUNK, 8, 0.010 + MIN_ITL_CHUNK * 0.0001)
    assert b.tokens(8, 248) == 100


def test_whole_prompt_prefill_is_left_whole():
    assert measured().tokens(8, None) is None  # MAX_NUM_BATCHED_TOKENS=0


def test_the_averages_move_with_each_step():
    b = ChunkBudget(2.0, weight=0.5)
    b.observe(50, 4, 0.02)  # a chunk before any decode step: nothing to subtract yet
    assert b.token_s is None
    b.observe(0, 4, 0.010)
    b.observe(0, 4, 0.020)
    assert b.decode_s == pytest.approx(0.015)
    b.observe(100, 4, 0.025)  # 0.010 s over a decode step for 100 tokens
    assert b.token_s == pytest.approx(0.0001)
    b.observe(0, 0, 5.0)  # a step of nothing: not a decode step
    assert b.decode_s == pytest.approx(0.015)


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_a_step_cheaper_than_a_decode_step_is_refused(ratio):
    with pytest.raises(ValueError, match="> 1"):
        ChunkBudget(ratio)


def test_the_scheduler_writes_a_long_prompt_beside_a_decoding_stream_in_chunks_of_the_bound(ref_model):
    from tests.engine_helpers import make_engine, make_seq, run_all, run_step

    model, tok = ref_model
    long_prompt = "And God said, Let there be light: and there was light. " * 12  # ~170 tokens
    whole = make_engine(model, tok, prefill_chunk_tokens=None)
    ref = make_seq(tok, long_prompt, 6)
    run_all(whole, [ref])

    engine = make_engine(model, tok, prefill_chunk_tokens=256)
    engine.scheduler.itl = measured(ratio=1.4, decode_s=0.010, token_s=0.0001)  # a bound of 40 tokens
    engine.scheduler.itl.weight = 0.0  # the test's figures, not this machine's steps
    running = make_seq(tok, "In the beginning", 40)
    engine.submit(running)
    run_step(engine)
    late = make_seq(tok, long_prompt, 6)
    engine.submit(late)
    chunks = []
    while late.prefilled < len(late.prompt_ids):
        before = late.prefilled
        run_step(engine)
        chunks.append(late.prefilled - before)
    assert chunks[:-1] == [40] * (len(chunks) - 1) and 0 < chunks[-1] <= 40
    run_all(engine, [])
    assert late.output_ids == ref.output_ids


def test_a_decode_step_slower_than_a_chunks_step_leaves_the_cost_positive():
    """On a loaded machine a decode step took longer than the next step with a 64-token chunk: that step's share
    was 0, ``token_s`` was 0.0, and ``tokens`` treated it as never measured."""
    b = ChunkBudget(2.0)
    b.observe(0, 1, 0.030)  # a decode step slowed by another job
    b.observe(64, 1, 0.020)
    assert b.token_s == pytest.approx(0.030 / MAX_TOKENS_PER_DECODE_STEP) and b.token_s > 0
    assert b.tokens(1, 248) == 248  # nothing measured over a decode step: the configured budget
    for _ in range(40):  # the machine's own costs again: 10 ms a decode step, 0.1 ms a prefilled token
        b.observe(0, 1, 0.010)
        b.observe(64, 1, 0.010 + 64 * 0.0001)
    assert b.token_s == pytest.approx(0.0001, rel=0.02) and b.tokens(1, 248) == pytest.approx(100, abs=2)


@pytest.mark.parametrize("seed", range(5))
def test_the_cost_stays_positive_and_near_the_steps_under_noise(seed):
    """Synthetic steps (10 ms a decode step, 0.1 ms a prefilled token) each off by up to 3 ms either way: the
    step-by-step average of clamped shares hit 0.0 (seeds 0 and 2); the pooled cost never does, and stays near
    0.1 ms."""
    import random

    rng = random.Random(seed)
    b = ChunkBudget(2.0)
    costs = []
    for _ in range(200):
        b.observe(0, 8, 0.010 + rng.uniform(-0.003, 0.003))
        chunk = rng.choice([16, 32, 64])
        b.observe(chunk, 8, 0.010 + chunk * 0.0001 + rng.uniform(-0.003, 0.003))
        costs.append(b.token_s)
    assert min(costs) > 0
    assert sum(costs[50:]) / len(costs[50:]) == pytest.approx(0.0001, rel=0.15)


def test_the_engine_feeds_the_budget_its_steps(ref_model):
    """The engine gives each step's prefilled tokens and decode rows, with its time; the budget is fed synthetic
    times here (10 ms a decode step, 0.1 ms a prefilled token), so the figures are the rule's, not this machine's
    (``token_s > 0`` on real timings failed on a loaded machine)."""
    from tests.engine_helpers import make_engine, make_seq, run_all, run_step

    class Fed(ChunkBudget):
        def __init__(self):
            super().__init__(2.0)
            self.steps = []

        def observe(self, prefill_tokens, decode_rows, seconds):
            self.steps.append((prefill_tokens, decode_rows, seconds))
            super().observe(prefill_tokens, decode_rows, 0.010 + 0.0001 * prefill_tokens)

    model, tok = ref_model
    engine = make_engine(model, tok, prefill_chunk_tokens=64)
    engine.scheduler.itl = fed = Fed()
    running = make_seq(tok, "In the beginning", 12)
    engine.submit(running)
    run_step(engine)
    run_step(engine)  # a decode step
    assert fed.decode_s == pytest.approx(0.010) and fed.token_s is None
    late = make_seq(tok, "And God said, Let there be light: and there was light. " * 4, 4)
    run_all(engine, [late])
    assert fed.token_s == pytest.approx(0.0001)
    assert all(seconds > 0 for *_, seconds in fed.steps)
    assert sum(p for p, _, _ in fed.steps) == len(running.prompt_ids) + len(late.prompt_ids)
    assert fed.steps[:2] == [(len(running.prompt_ids), 0, fed.steps[0][2]), (0, 1, fed.steps[1][2])]
    assert any(p and d == 1 for p, d, _ in fed.steps)  # a chunk beside the decoding stream
