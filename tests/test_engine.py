"""Engine values: `full` matches transformers' generate() alone and in a batch (in each precision under
test, :mod:`tests.precision`); KV is freed at once."""

import platform

import pytest
import torch

from cache_backends.store_path import StorePath
from server.engine import malloc_tuning
from server.engine.sampling import SamplingParams
from server.engine.sequence import FinishReason
from tests.engine_helpers import make_engine, make_seq, raising_once, reference_greedy, run_all, run_step

PROMPTS = ["And God said", "The LORD is my shepherd", "In the beginning",
           "And it came to pass, when the king heard", "Blessed are the"]


def test_full_backend_alone_matches_generate(value_model, precision):
    model, tok = value_model
    engine = make_engine(model, tok)
    for prompt in PROMPTS[:3]:
        seq = make_seq(tok, prompt, 24)
        run_all(engine, [seq])
        ref = reference_greedy(model, tok, prompt, 24)
        precision.assert_greedy_agrees(model, tok.encode(prompt), seq.output_ids, ref)


def test_full_backend_batched_matches_generate(value_model, precision):
    model, tok = value_model
    engine = make_engine(model, tok, max_batch_size=8)
    seqs = [make_seq(tok, p, 16 + 4 * i) for i, p in enumerate(PROMPTS)]
    run_all(engine, seqs)
    for prompt, seq in zip(PROMPTS, seqs):
        ref = reference_greedy(model, tok, prompt, seq.max_new_tokens)
        precision.assert_greedy_agrees(model, tok.encode(prompt), seq.output_ids, ref)


def test_batched_decode_logits_match_single(value_model, precision):
    """One decode step over a ragged batch gives each row the logits it gets alone (within the dtype's
    tolerance, :mod:`tests.precision`)."""
    model, tok = value_model
    engine = make_engine(model, tok)
    backend = engine.backends["full"]
    runner = StorePath(model, backend.geometry.num_layers)
    prompts = [tok.encode(p) for p in PROMPTS]
    singles, stores = [], []
    for ids in prompts:
        solo, batch_store = backend.new_store(), backend.new_store()
        runner.prefill(ids, solo)
        runner.prefill(ids, batch_store)
        singles.append(runner.decode([ids[-1]], [solo])[0])
        stores.append(batch_store)
    batched = runner.decode([ids[-1] for ids in prompts], stores)
    for row, single in enumerate(singles):
        precision.assert_close(batched[row], single, what=f"row {row}")


def test_kv_is_freed_when_sequences_finish_or_are_cancelled(ref_model):
    model, tok = ref_model
    engine = make_engine(model, tok)
    done = make_seq(tok, "And God said", 4)
    cancelled = make_seq(tok, "In the beginning", 200)
    engine.submit(done)
    engine.submit(cancelled)
    run_step(engine)
    assert engine.kv_held_bytes() > 0
    bytes_two = engine.kv_held_bytes()
    cancelled.cancel()
    run_step(engine)
    assert cancelled.finish_reason == FinishReason.CANCELLED and engine.kv.table(cancelled) is None
    assert 0 < engine.kv_held_bytes() < bytes_two
    run_all(engine, [])
    assert done.finish_reason == FinishReason.LENGTH and len(done.output_ids) == 4
    assert engine.kv_held_bytes() == 0


def test_full_store_bytes_are_the_sum_of_its_tensors(ref_model):
    model, tok = ref_model
    engine = make_engine(model, tok)
    backend = engine.backends["full"]
    store = backend.new_store()
    ids = tok.encode("And God said, Let there be light: and there was light.")
    StorePath(model, engine.runner.num_layers).prefill(ids, store)
    expected = sum(t.nelement() * t.element_size() for layer in store.layers for t in layer.materialize())
    assert store.nbytes() == expected == len(ids) * backend.bytes_per_token_per_layer() * len(store.layers)
    # Allocated: the buffers' capacity (64 tokens, the first block), each a tensor the store really holds.
    held = sum(s.buffer.data.nelement() * s.buffer.data.element_size()
               for layer in store.layers for s in (layer.key_store, layer.value_store))
    assert store.allocated_bytes() == held == 64 * backend.bytes_per_token_per_layer() * len(store.layers)


def test_reserved_store_never_allocates_past_its_reservation(ref_model):
    """A store reserved for N tokens holds at most the backend's reserved_bytes(N) for every backend."""
    model, tok = ref_model
    ids = tok.encode("And God said, Let there be light: and there was light. " * 6)
    n_new = 70
    for name in ("full", "int8", "gqa", "mla", "gqa+int8", "mla+int8", "dca", "dca+int8"):
        engine = make_engine(model, tok, name, threshold=0.9) if name.startswith("dca") else make_engine(model, tok, name)
        backend = engine.backends[name]
        store = backend.new_store()
        store.reserve(len(ids) + n_new)
        StorePath(model, engine.runner.num_layers).prefill(ids, store)
        peak = store.allocated_bytes()
        token = ids[-1]
        for _ in range(n_new):
            StorePath(model, engine.runner.num_layers).decode([token], [store])
            peak = max(peak, store.allocated_bytes())
        assert store.nbytes() <= peak <= backend.reserved_bytes(len(ids) + n_new), name


def test_seed_reproduces_sampled_output(ref_model):
    model, tok = ref_model
    engine = make_engine(model, tok)
    params = SamplingParams(do_sample=True, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    runs = []
    for _ in range(2):
        a = make_seq(tok, "And God said", 12, params=params)
        other = make_seq(tok, "Blessed are the", 12, params=SamplingParams(do_sample=True, seed=7))
        run_all(engine, [a, other] if not runs else [a])  # alone vs batched: same seed, same tokens
        runs.append(a.output_ids)
    assert runs[0] == runs[1]


def test_stop_sequence_ends_generation_without_the_stop_text(ref_model):
    model, tok = ref_model
    engine = make_engine(model, tok)
    free = make_seq(tok, "And God said", 30)
    run_all(engine, [free])
    text = free.detok.generated_text()
    stop = text[5:9]
    events = []
    stopped = make_seq(tok, "And God said", 30, stop=[stop], events=events)
    run_all(engine, [stopped])
    assert stopped.finish_reason == FinishReason.STOP
    out = "".join(e.text for e in events)
    assert out == events[-1].generated_text == text[: text.index(stop)]


@pytest.mark.parametrize("backend", ["int8", "int4", "full"])
def test_the_default_pool_holds_the_longest_request_alone(ref_model, backend):
    """With no KV budget set the pool holds ``max_batch_size`` sequences of ``max_total_tokens``: one request of that
    many tokens is admitted whatever its prompt's share, its prompt prefilled in steps cut anywhere as admission
    counts it (the pool was sized for steps of a fixed phase: on SmolLM2 an int4 prompt of 8000 tokens with 26 new
    needed 328 pages of the 327 the default pool had)."""
    from server.engine.sequence import Sequence

    model, tok = ref_model
    engine = make_engine(model, tok, backend, max_batch_size=1)
    total = model.config.max_position_embeddings
    for prompt in range(total // 2, total + 1, 7):
        seq = Sequence(request_id="0", prompt_ids=[1] * prompt, max_new_tokens=total - prompt,
                       params=SamplingParams(), stop=[], backend_name=backend)
        assert engine.scheduler.fits_alone(seq), (prompt, engine.kv.pages_to_finish(seq), engine.kv.blocks.usable_pages)


def test_kv_budget_is_a_hard_cap_for_every_backend(ref_model):
    """Concurrent requests under a small budget: the KV bytes allocated (the gauge's value) never exceed the
    budget after any step, and every request completes (before: int8 peaked at 1.95x the budget, since
    admission charged the 1024-token average of the formula while short int8 sequences are all window)."""
    model, tok = ref_model
    budget = 3_500_000
    prompts = ["And God said", "The LORD is my shepherd", "In the beginning God created the heaven and the earth.",
               "And it came to pass", "Blessed are the poor in spirit", "Let there be light"]
    for name in ("full", "int8", "mla+int8", "dca+int8"):  # the reservation bound of each is tested above
        options = {"threshold": 0.9} if name.startswith("dca") else {}
        engine = make_engine(model, tok, name, max_batch_size=6, budget=budget, **options)
        seqs = [make_seq(tok, p, 100, backend=name) for p in prompts]
        for s in seqs:
            engine.submit(s)
        steps, peak = 0, 0
        while engine.running or engine.waiting:
            run_step(engine)
            peak = max(peak, engine.kv_held_bytes())
            assert engine.kv_held_bytes() <= budget, (name, engine.kv_held_bytes())
            steps += 1
            assert steps < 2000
        assert all(s.finish_reason == FinishReason.LENGTH and len(s.output_ids) == 100 for s in seqs), name
        assert peak > 0


def test_chunked_prefill_interleaves_with_decode_and_matches_whole_prefill(ref_model):
    """A long prompt is written in chunks of the step's token budget while a running stream gets a token
    every step, each step's chunk and decode token in one forward (a mixed batch), and both outputs equal
    their outputs alone (greedy, same tokens; the long prompt's: a whole-prompt prefill)."""
    model, tok = ref_model
    long_prompt = "And God said, Let there be light: and there was light. " * 12  # ~170 tokens
    whole = make_engine(model, tok, prefill_chunk_tokens=None)
    ref = make_seq(tok, long_prompt, 12)
    alone = make_seq(tok, "In the beginning", 40)
    run_all(whole, [ref])
    run_all(whole, [alone])

    engine = make_engine(model, tok, prefill_chunk_tokens=64)
    forwards = []
    hook = engine.runner.model.register_forward_hook(lambda m, a, kw, out: forwards.append(kw["input_ids"].shape),
                                                     with_kwargs=True)
    running = make_seq(tok, "In the beginning", 40)
    engine.submit(running)
    run_step(engine)
    assert len(running.output_ids) == 1  # prefilled and sampled; it decodes from the next step on (as vLLM)
    late = make_seq(tok, long_prompt, 12)
    engine.submit(late)
    chunks = []
    while late.prefilled < len(late.prompt_ids):
        before, tokens_before, forwards_before = late.prefilled, len(running.output_ids), len(forwards)
        run_step(engine)
        chunks.append(late.prefilled - before)
        assert len(running.output_ids) == tokens_before + 1  # the running stream did not stall
        # one forward: the chunk's tokens and the decode token as one flat row
        assert forwards[forwards_before:] == [(1, chunks[-1] + 1)]
    hook.remove()
    assert len(chunks) >= 3 and max(chunks) <= 64
    run_all(engine, [])
    assert late.output_ids == ref.output_ids
    assert running.output_ids == alone.output_ids


def test_the_in_process_benchmarks_fix_glibcs_thresholds_on_glibc():
    """On glibc, the allocator's mmap and trim thresholds can be fixed (``mallopt`` takes them), as the in-process
    benchmarks' engine does: a step's freed transients are kept for the next step instead of going back to the
    OS and being faulted in, zeroed, again (server/engine/malloc_tuning.py)."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc: the setting does not apply")
    assert malloc_tuning.keep_step_memory() is True


def test_hand_back_empties_mkls_gemm_buffer_cache():
    """A prefill chunk's matmuls leave their packing buffers in MKL's own cache (10.9 MiB after SmolLM2-135M's
    256-token chunks), which glibc's trim cannot reach: :func:`malloc_tuning.hand_back` frees them (MKL's own
    counter, ``mkl_serv_mem_stat``, reads 0 after it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine's setting: the buffers are this thread's
    try:
        a, b = torch.randn(256, 576), torch.randn(576, 1536)
        torch.mm(a, b)  # a chunk's MLP up-projection
        kept = malloc_tuning.mkl_cached_bytes()
        if kept == 0:
            pytest.skip("this torch's matmuls keep no MKL buffers (no MKL, or another BLAS)")
        assert kept >= 256 * 1024  # its packed panels, at least
        malloc_tuning.hand_back()
        assert malloc_tuning.mkl_cached_bytes() == 0
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("backend", ["full", "int8"])
def test_a_long_prompt_hands_its_prefill_memory_back_once_prefilled(ref_model, backend, monkeypatch):
    """The step that completes a long prompt's prefill (at least ``HAND_BACK_PROMPT_TOKENS``) hands the memory its
    chunks left behind back once (:func:`malloc_tuning.hand_back`), before its decode; a short prompt's, and
    decode steps, do not; the tokens are those of a run that never hands back."""
    model, tok = ref_model
    long_prompt = "And God said, Let there be light: and there was light. " * 8
    short_prompt = "In the beginning"
    monkeypatch.setattr(malloc_tuning, "HAND_BACK_PROMPT_TOKENS", 64)
    assert len(tok.encode(long_prompt)) > 64 > len(tok.encode(short_prompt))

    def run(hand_back) -> tuple[list[list[int]], list[tuple[int, list[int]]]]:
        calls = []
        engine = make_engine(model, tok, backend=backend, prefill_chunk_tokens=32, prefix_caching=False)
        seqs = [make_seq(tok, p, 6, backend=backend, params=SamplingParams(ignore_eos=True))
                for p in (short_prompt, long_prompt)]

        def spy():
            calls.append((steps[0], [len(s.output_ids) for s in seqs]))
            hand_back()

        monkeypatch.setattr(malloc_tuning, "hand_back", spy)
        steps = [0]
        for s in seqs:
            engine.submit(s)
        while engine.running or engine.waiting:
            run_step(engine)
            steps[0] += 1
        return [s.output_ids for s in seqs], calls

    real = malloc_tuning.hand_back
    tokens, calls = run(real)
    # once, at the end of the step that sampled the long prompt's first token (the short one decoding beside it)
    assert len(calls) == 1 and calls[0][1][1] == 1, calls
    assert calls[0][1][0] >= 2
    untouched, _ = run(lambda: None)
    assert tokens == untouched


@pytest.mark.parametrize("backend", ["full", "int8"])
def test_every_page_a_step_hands_out_is_zeroed_before_it_is_read(ref_model, backend):
    """The pool's pages hold garbage (NaN bytes) before the run: every page the scheduler hands out must be zeroed
    by the runner before a step reads it (padded gathers read unwritten slots), so the outputs equal those of a
    run on a fresh pool. Two long prompts arrive together, so one step carries two prefill chunks (the second
    reserved without preempting) beside decode rows."""
    model, tok = ref_model
    long_prompt = "And God said, Let there be light: and there was light. " * 8
    prompts = ["In the beginning", long_prompt, "The LORD is my shepherd, I shall not want. " * 6]

    def run(poison: bool) -> list[list[int]]:
        engine = make_engine(model, tok, backend=backend, prefill_chunk_tokens=256)
        if poison:
            engine.runner.pool.arena.fill_(255)
            engine.runner.pool.arena[0].zero_()  # the null page stays zeros (the pool's invariant)
        seqs = [make_seq(tok, p, 12, backend=backend, params=SamplingParams(ignore_eos=True)) for p in prompts]
        engine.submit(seqs[0])
        run_step(engine)
        run_all(engine, seqs[1:])
        assert all(len(s.output_ids) == 12 and s.finish_reason == FinishReason.LENGTH for s in seqs)
        return [s.output_ids for s in seqs]

    assert run(poison=True) == run(poison=False)


def test_a_failed_forward_ends_only_its_own_rows(ref_model):
    """A forward that raises ends the sequences of its rows with an error event naming the failure and frees their
    KV; a request whose prompt ran in a forward of its own is not touched by it, and the engine goes on."""
    model, tok = ref_model
    engine = make_engine(model, tok)
    events = [[], []]
    batch = make_seq(tok, "And God said", 30, events=events[0])
    apart = make_seq(tok, "In the beginning", 6, events=events[1])
    apart.want_prompt_logprobs = True  # prefilled in a forward of its own
    engine.submit(batch)
    run_step(engine)
    engine.submit(apart)
    run_paged, calls = engine.runner.run_paged, []

    def failing(input_ids, groups, new_pages, all_logits=False, feedback=None):
        calls.append(all_logits)
        if not all_logits:
            raise RuntimeError("boom")
        return run_paged(input_ids, groups, new_pages, all_logits=all_logits, feedback=feedback)

    engine.runner.run_paged = failing
    run_step(engine)  # apart's prompt alone (ok), then batch's decode row (fails)
    engine.runner.run_paged = run_paged
    assert calls == [True, False]
    assert batch.finish_reason == FinishReason.ERROR and events[0][-1].error == "decode failed: boom"
    assert engine.kv.table(batch) is None
    run_all(engine, [])
    assert apart.finish_reason == FinishReason.LENGTH and len(apart.output_ids) == 6
    assert apart.output_ids == reference_greedy(model, tok, "In the beginning", 6)
    assert engine.kv_held_bytes() == 0
    later = make_seq(tok, "Blessed are the", 5)
    run_all(engine, [later])
    assert later.output_ids == reference_greedy(model, tok, "Blessed are the", 5)


def test_a_step_whose_runner_raises_ends_every_request_of_the_step(ref_model, monkeypatch):
    """Anything else the runner raises (here: zeroing the step's new pages) ends every sequence of the step with an
    error event and frees its KV blocks; the engine goes on, and a later request gets its greedy tokens."""
    model, tok = ref_model
    engine = make_engine(model, tok)
    free = engine.kv.blocks.num_free
    events = [[], []]
    seqs = [make_seq(tok, p, 10, events=ev) for p, ev in zip(PROMPTS, events)]
    for s in seqs:
        engine.submit(s)
    run_step(engine)  # both prompts
    monkeypatch.setattr(engine.runner.pool, "zero", raising_once(engine.runner.pool.zero))
    run_step(engine)  # both decode rows: the runner raises
    for s, ev in zip(seqs, events):
        assert s.finish_reason == FinishReason.ERROR and engine.kv.table(s) is None
        assert ev[-1].error == "step failed: boom" and [e.index for e in ev] == [0, 1]
    assert not engine.running and engine.kv.blocks.num_free == free
    later = make_seq(tok, "Blessed are the", 5)
    run_all(engine, [later])
    assert later.output_ids == reference_greedy(model, tok, "Blessed are the", 5)


def test_a_cancellation_in_the_step_that_admits_a_per_sequence_store(ref_model):
    """A running sequence cancelled in the step that admits a ``dca`` sequence (a per-sequence store, made once the
    step is scheduled): the cancelled one gets its closing event, and the admitted one its store and detokenizer and
    its tokens (the gauges measured at the cancellation skip nothing and fail on nothing)."""
    model, tok = ref_model
    engine = make_engine(model, tok, "dca")
    events = [[], []]
    running = make_seq(tok, "And God said", 50, backend="dca", events=events[0])
    engine.submit(running)
    run_step(engine)
    run_step(engine)
    admitted = make_seq(tok, "In the beginning", 5, backend="dca", events=events[1])
    engine.submit(admitted)
    running.cancel()
    run_step(engine)
    assert running.finish_reason == FinishReason.CANCELLED and events[0][-1].finish_reason == FinishReason.CANCELLED
    assert engine.kv.table(admitted) is not None and admitted.detok is not None
    run_all(engine, [])
    assert admitted.finish_reason == FinishReason.LENGTH and len(admitted.output_ids) == 5
    assert [e.index for e in events[1]] == list(range(5))
    assert engine.kv_held_bytes() == 0


def test_one_paged_prompt_runs_alone_per_step(ref_model):
    """Two int8 prompts that want every position's log-probability arrive together: each runs in a forward of its
    own, one a step (its transient exact pages go back only when its step is committed, and admission keeps one
    prompt's transient free), the second in the next step beside the first one's decode row. Each gets the prompt
    log-probabilities and tokens it gets alone."""
    model, tok = ref_model
    prompts = ["And God said, Let there be light", "In the beginning God created the heaven and the earth"]

    def seqs():
        out = [make_seq(tok, p, 4, backend="int8") for p in prompts]
        for s in out:
            s.want_prompt_logprobs = True
        return out

    alone = []
    for s in seqs():
        run_all(make_engine(model, tok, "int8"), [s])
        alone.append(s)
    engine = make_engine(model, tok, "int8")
    scheduled, execute = [], engine.runner.execute

    def spy(out, *args):
        scheduled.append([(r.seq_id, r.alone, r.decode) for r in out.rows])
        return execute(out, *args)

    engine.runner.execute = spy
    both = seqs()
    run_all(engine, both)
    first, second = both[0].seq_id, both[1].seq_id
    assert scheduled[0] == [(first, True, False)]
    assert (second, True, False) in scheduled[1] and (first, False, True) in scheduled[1]
    for s, ref in zip(both, alone):
        assert s.output_ids == ref.output_ids
        assert s.prompt_logprobs == pytest.approx(ref.prompt_logprobs, abs=1e-4)
