"""The engine's batched sampling: one row's sampling failure fails that request only."""

from server.engine import sampling
from server.engine.sampling import SamplingParams
from server.engine.sequence import FinishReason
from tests.engine_helpers import make_engine, make_seq, run_all

PROMPTS = ["And God said", "The LORD is my shepherd", "In the beginning"]


def test_one_rows_sampling_failure_fails_that_request_only(ref_model, monkeypatch):
    """Three requests decode together; from the 4th token on, the sampling of the one seeded 13 raises.
    It ends with ``error`` and its KV is freed; the other two get every token they get alone."""
    model, tok = ref_model
    engine = make_engine(model, tok, max_batch_size=8)
    params = [SamplingParams(do_sample=True, seed=5), SamplingParams(do_sample=True, seed=13), SamplingParams()]
    alone = []
    for prompt, p in zip(PROMPTS, params):
        seq = make_seq(tok, prompt, 12, params=p)
        run_all(engine, [seq])
        alone.append(seq.output_ids)

    real_draw = sampling._draw
    calls = {"n": 0}

    def draw(scores, generator):
        if generator.initial_seed() == 13:
            calls["n"] += 1
            if calls["n"] > 3:
                raise RuntimeError("injected sampling failure")
        return real_draw(scores, generator)

    monkeypatch.setattr(sampling, "_draw", draw)
    events = [[], [], []]
    seqs = [make_seq(tok, pr, 12, params=p, events=ev) for pr, p, ev in zip(PROMPTS, params, events)]
    run_all(engine, seqs)
    assert seqs[1].finish_reason == FinishReason.ERROR and "injected" in events[1][-1].error
    assert len(seqs[1].output_ids) == 3 and engine.kv.table(seqs[1]) is None
    for i in (0, 2):
        assert seqs[i].finish_reason == FinishReason.LENGTH and seqs[i].output_ids == alone[i]
        assert [e.token_id for e in events[i]] == alone[i]  # one event per token, none repeated or lost
    assert not engine.running and engine.kv_held_bytes() == 0
