"""Block tables live in the KV cache manager, by sequence (issue #43): ``KVCacheManager.tables`` holds exactly the
started sequences' tables, by ``seq_id``, through admission, preemption, finishing and aborts; the prefix cache's
per-sequence keys are the manager's too, kept for live sequences only; a :class:`Sequence` carries no block
table."""

from __future__ import annotations

import dataclasses

from server.engine.sampling import SamplingParams
from server.engine.sequence import Sequence
from tests.engine_helpers import make_engine, make_seq, reference_greedy, run_step

PROMPT = "And God said, Let there be light: and there was light. And God saw the light, that it was good"


def _check(engine) -> None:
    """The manager's tables are the running sequences' (each row's tables its own object), and its prefix keys
    belong to live sequences."""
    kv = engine.kv
    running = {s.seq_id for s in engine.running}
    assert set(kv.tables) == running
    assert set(kv.prefix.keys) <= running | {s.seq_id for s in engine.waiting}
    assert all(kv.table(s) is kv.tables[s.seq_id] for s in engine.running)
    assert all(kv.table(s) is None for s in engine.waiting)


def test_the_managers_tables_follow_admission_preemption_finish_and_abort(ref_model):
    """Six generations of one prompt under one request id (request ids may repeat: the tables are keyed by
    ``seq_id``) on a pool of 32 blocks too small for all of them: after every step the manager's tables are the
    running sequences' exactly, through admissions (the later five from the first one's cached blocks),
    preemptions, finishes, a running sequence's cancellation and a waiting one's; every page comes back, the
    manager keeps nothing once all are done, and every generation that ran to its end has the greedy tokens of the
    prompt served alone."""
    model, tok = ref_model
    engine = make_engine(model, tok, max_batch_size=8, budget=33 * 262144)
    assert engine.kv.blocks.usable_pages == 32
    seqs = [make_seq(tok, PROMPT, 100, params=SamplingParams(ignore_eos=True)) for _ in range(6)]
    assert len({s.request_id for s in seqs}) == 1 and len({s.seq_id for s in seqs}) == 6
    engine.submit(seqs[0])
    run_step(engine)  # its prompt's full blocks are in the prefix cache: the others start from them
    _check(engine)
    for s in seqs[1:]:
        engine.submit(s)
    steps, late, keyed = 0, None, set()
    while engine.running or engine.waiting:
        run_step(engine)
        steps += 1
        _check(engine)
        keyed |= set(engine.kv.prefix.keys)
        if steps == 10:
            seqs[0].cancel()  # running: aborted mid-generation
        if late is None and engine.waiting and steps > 10:
            late = make_seq(tok, PROMPT, 50)  # queued behind a full pool, then aborted before it starts
            engine.submit(late)
            run_step(engine)
            _check(engine)
            assert late in engine.waiting and engine.kv.table(late) is None
            late.cancel()
        assert steps < 2000
    assert late is not None and late.finish_reason.value == "cancelled" and not late.output_ids
    assert seqs[0].finish_reason.value == "cancelled" and 0 < len(seqs[0].output_ids) < 100
    assert sum(s.preemptions for s in seqs) > 0
    assert keyed and all(s.cached_tokens > 0 for s in seqs[1:])
    assert engine.kv.tables == {} and engine.kv.prefix.keys == {}
    assert engine.kv.blocks.num_free == engine.kv.blocks.usable_pages and engine.kv_held_bytes() == 0
    alone = reference_greedy(model, tok, PROMPT, 100)
    for s in seqs[1:]:
        assert s.finish_reason.value == "length" and s.output_ids == alone


def test_a_sequence_carries_no_block_table():
    """The tables, their store view and the prefix-cache keys are the manager's: none is a field of
    :class:`Sequence` (a reader left behind fails loudly)."""
    names = {f.name for f in dataclasses.fields(Sequence)}
    assert names.isdisjoint({"blocks", "store", "hash_root", "block_hashes", "group_hashes", "registered_blocks"})
    seq = Sequence(request_id="r", prompt_ids=[1, 2], max_new_tokens=1, params=SamplingParams(), stop=[],
                   backend_name="full")
    assert not hasattr(seq, "blocks") and not hasattr(seq, "store")
