"""A step's prefill budget shared between the sequences still prefilling (server/engine/prefill_share.py): the rule's
values, and the scheduler obeying it: short prompts admitted behind a long one are written in the step that admits
them, beside the long one's chunk, and decode from the next; the outputs are those each gets alone."""

from __future__ import annotations

import pytest

from server.engine.prefill_share import MIN_SHARE, prefill_shares


def test_one_prefill_takes_the_whole_budget():
    assert prefill_shares([5900], 256) == [256]
    assert prefill_shares([40], 256) == [40]


def test_short_prefills_take_what_they_need_and_the_long_one_the_rest():
    assert prefill_shares([5900, 12, 14, 11, 13], 256) == [206, 12, 14, 11, 13]


def test_two_long_prefills_split_the_budget_the_oldest_and_the_one_with_fewest_left():
    assert prefill_shares([5900, 4000, 3000], 256) == [128, 0, 128]
    assert prefill_shares([5900, 3000, 60], 256) == [98, 98, 60]
    assert prefill_shares([5900, 3001, 60, 4000], 255) == [98, 97, 60, 0]  # the remainder to the most left
    assert prefill_shares([900] * 16, 256) == [128, 128] + [0] * 14  # equal prompts finish two by two


def test_a_small_budget_serves_the_oldest_then_the_fewest_left():
    left = [5900, 3000, 20, 900, 10]
    assert prefill_shares(left, 3 * MIN_SHARE) == [19, 0, 19, 0, 10]  # three slots: the oldest, then 10 and 20
    assert prefill_shares(left, MIN_SHARE) == [8, 0, 0, 0, 8]  # two always: the oldest and the shortest
    assert prefill_shares([5900, 3000, 5, 5, 5, 5], 48) == [28, 0, 5, 5, 5, 5]  # short ones need less than a block


def test_nothing_to_share():
    assert prefill_shares([], 256) == []
    assert prefill_shares([100, 5], 0) == [0, 0]


def record_steps(engine) -> list[dict]:
    """The rows of each step ``engine`` runs from now on, as ``{seq_id: (tokens, decode)}``, appended to the list."""
    steps, execute = [], engine.runner.execute

    def spy(out, *args):
        steps.append({r.seq_id: (len(r.token_ids), r.decode) for r in out.rows})
        return execute(out, *args)

    engine.runner.execute = spy
    return steps


@pytest.mark.parametrize("left,budget,bound", [([0], 10, None), ([5], -1, None), ([5], 10, -1)])
def test_bad_arguments_are_refused(left, budget, bound):
    with pytest.raises(ValueError, match="budget >= 0 and positive tokens left"):
        prefill_shares(left, budget, bound)


def test_a_step_that_finishes_a_prompt_bounds_the_ones_it_does_not_finish():
    """A 32-token prompt beside a 5,900-token one, nothing decoding: its step carried the long one's 224-token rest of
    the budget (a whole long chunk's cost for its first token); the long one now gets the bound of a step with decode
    tokens, and the short one its whole prompt."""
    assert prefill_shares([5900, 32], 256) == [224, 32]  # no bound: as before
    assert prefill_shares([5900, 32], 256, 40) == [40, 32]
    assert prefill_shares([5900, 12, 14, 11, 13], 256, 16) == [16, 12, 14, 11, 13]  # several short ones
    assert prefill_shares([5900, 3000, 60], 256, 40) == [20, 20, 60]  # two long ones share the bound
    assert prefill_shares([5900, 3001, 60], 256, 41) == [21, 20, 60]  # the remainder to the most left
    assert prefill_shares([5900, 20], 48, 40) == [28, 20]  # within the bound already


def test_without_a_prompt_to_finish_the_bound_does_not_apply():
    """No starvation: with nothing short waiting the long prompts get the whole budget, and so do prompts that all
    finish in the step."""
    assert prefill_shares([5900], 256, 16) == [256]
    assert prefill_shares([5900, 3000], 256, 16) == [128, 128]
    assert prefill_shares([100, 50], 256, 16) == [100, 50]
    assert prefill_shares([5900, 300, 200], 256, 16) == [86, 85, 85]  # 200 > its share: not finished


def test_short_requests_are_prefilled_beside_a_long_one_not_after_it(ref_model):
    """A long prompt is being written in chunks of 64 tokens when four short requests arrive: the step that admits
    them writes each short prompt whole beside the long one's chunk (64 tokens in all), and the next step carries
    their first decode tokens, though the long prompt has many chunks left (before: every chunk of the long prompt
    came first). Each output equals the one it gets alone (greedy)."""
    from tests.engine_helpers import make_engine, make_seq, run_all, run_step

    model, tok = ref_model
    long_prompt = "And God said, Let there be light: and there was light. " * 40  # ~520 tokens
    shorts = ["In the beginning", "The LORD is my shepherd", "And the earth was without form", "Let there be"]
    alone = []
    for p in shorts:
        seq = make_seq(tok, p, 6)
        run_all(make_engine(model, tok, prefill_chunk_tokens=64), [seq])
        alone.append(seq.output_ids)

    engine = make_engine(model, tok, prefill_chunk_tokens=64)
    steps = record_steps(engine)
    long = make_seq(tok, long_prompt, 2)
    engine.submit(long)
    run_step(engine)
    short = [make_seq(tok, p, 6) for p in shorts]
    for s in short:
        engine.submit(s)
    run_step(engine)  # admits the short ones and writes their prompts
    admitted = steps[-1]
    assert {s.seq_id: admitted.get(s.seq_id) for s in short} == {s.seq_id: (len(s.prompt_ids), False) for s in short}
    assert admitted[long.seq_id] == (64 - sum(len(s.prompt_ids) for s in short), False)
    run_step(engine)
    assert all(steps[-1].get(s.seq_id) == (1, True) for s in short)  # they decode while the long one prefills
    assert long.prefilled < len(long.prompt_ids) - 64 * 3
    run_all(engine, [])
    assert [s.output_ids for s in short] == alone


@pytest.mark.parametrize("measured", [True, False])
def test_a_short_prompts_step_beside_a_long_one_costs_a_step_with_decode_tokens(ref_model, measured):
    """Nothing decodes while a long prompt is written in 256-token chunks; a short prompt arrives: its step writes it
    whole and the long one's chunk only as a step with decode tokens would (``PREFILL_ITL_RATIO``: 40 tokens from the
    figures set here, one block before anything is measured), not the 256-token budget's rest (before: 256 less the
    short prompt). The long one gets the whole budget again once the short request is done; both outputs equal
    those each gets alone (greedy)."""
    from server.engine.itl_budget import MIN_ITL_CHUNK, ChunkBudget
    from tests.engine_helpers import make_engine, make_seq, run_all, run_step
    from tests.test_itl_budget import measured as measured_budget

    model, tok = ref_model
    long_prompt = "And God said, Let there be light: and there was light. " * 60  # ~780 tokens
    alone = []
    for p, n in ((long_prompt, 2), ("In the beginning", 2)):
        seq = make_seq(tok, p, n)
        run_all(make_engine(model, tok, prefill_chunk_tokens=256), [seq])
        alone.append(seq.output_ids)

    engine = make_engine(model, tok, prefill_chunk_tokens=256)
    if measured:
        engine.scheduler.itl = measured_budget(ratio=1.4, decode_s=0.010, token_s=0.0001)  # a bound of 40 tokens
        engine.scheduler.itl.weight = 0.0  # the test's figures, not this machine's steps
    else:
        engine.scheduler.itl = ChunkBudget(2.0)
    steps = record_steps(engine)
    long = make_seq(tok, long_prompt, 2)
    engine.submit(long)
    run_step(engine)
    assert steps[-1] == {long.seq_id: (256, False)}  # alone: the whole budget
    short = make_seq(tok, "In the beginning", 2)
    engine.submit(short)
    run_step(engine)
    assert steps[-1] == {short.seq_id: (len(short.prompt_ids), False),
                         long.seq_id: (40 if measured else MIN_ITL_CHUNK, False)}
    while short.finish_reason is None:
        run_step(engine)
    run_step(engine)
    assert steps[-1] == {long.seq_id: (256, False)}  # the short request done: the whole budget again
    run_all(engine, [])
    assert [long.output_ids, short.output_ids] == alone
