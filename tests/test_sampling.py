"""The batched sampler: each processor's values, per-row parameters in one batch, seeds, row failures."""

import pytest
import torch
from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor, TopKLogitsWarper,
                                                    TopPLogitsWarper, TypicalLogitsWarper)

from server.engine import sampling
from server.engine.sampling import RowRequest, SamplingParams, new_generator, process, sample_batch

EOS = 3


def row(params: SamplingParams = SamplingParams(), prompt=(0,), output=(), seed=None) -> RowRequest:
    gen = new_generator(params.seed if seed is None else seed, "cpu")
    return RowRequest(params, list(prompt), list(output), gen)


def one(logits, params=SamplingParams(), **kw):
    return sample_batch(torch.as_tensor(logits).unsqueeze(0), [row(params, **kw)], [EOS])[0]


def test_greedy_takes_argmax_and_reports_raw_logprob():
    logits = torch.tensor([0.1, 2.0, 1.0, -1.0])
    out = one(logits)
    assert out.token == 1
    assert out.logprob == pytest.approx(torch.log_softmax(logits, -1)[1].item(), abs=1e-6)


def test_repetition_penalty_matches_transformers_per_row():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    rows = [row(SamplingParams(repetition_penalty=1.3), prompt=[1, 2, 2], output=[5]),
            row(SamplingParams()),
            row(SamplingParams(repetition_penalty=0.7), prompt=[7], output=[8, 9, 7])]
    got = process(logits, rows)
    for i, (p, ids) in enumerate([(1.3, [1, 2, 2, 5]), (1.0, [0]), (0.7, [7, 8, 9, 7])]):
        want = RepetitionPenaltyLogitsProcessor(p)(torch.tensor([ids]), logits[i : i + 1].clone())[0]
        assert torch.allclose(got[i], want)


def test_frequency_and_presence_penalties_openai_and_tgi():
    logits = torch.zeros(1, 6)
    openai = process(logits, [row(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
                                  prompt=[4, 4], output=[1, 1, 2])])[0]
    assert openai.tolist() == [0.0, -1.25, -0.75, 0.0, 0.0, 0.0]  # prompt tokens do not count (OpenAI)
    tgi = process(logits, [row(SamplingParams(frequency_penalty=1.0, frequency_over_all=True),
                               prompt=[4, 4], output=[1, 1])])[0]
    assert tgi.tolist() == [0.0, -0.5, 0.0, 0.0, -0.5, 0.0]  # counts over prompt + output / their length


def test_logit_bias_and_eos_masking():
    logits = torch.tensor([[0.0, 1.0, 0.0, 5.0]])
    assert process(logits, [row(SamplingParams(logit_bias=((0, 2.5), (3, -100.0))))])[0].tolist() == [
        2.5, 1.0, 0.0, -95.0]
    assert one(logits[0]).token == EOS
    assert one(logits[0], SamplingParams(ignore_eos=True)).token == 1
    assert one(logits[0], SamplingParams(min_tokens=2), output=[1]).token == 1  # 1 generated < 2
    assert one(logits[0], SamplingParams(min_tokens=2), output=[1, 1]).token == EOS


@pytest.mark.parametrize("name,params,warper", [
    ("top_k", SamplingParams(do_sample=True, top_k=3), TopKLogitsWarper(3)),
    ("top_p", SamplingParams(do_sample=True, top_p=0.6), TopPLogitsWarper(0.6)),
    ("typical_p", SamplingParams(do_sample=True, typical_p=0.5), TypicalLogitsWarper(0.5)),
])
def test_warpers_keep_what_transformers_keeps(name, params, warper):
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3)) * 3
    got = process(logits, [row(params), row(SamplingParams())])  # second row greedy: untouched
    want = warper(torch.zeros(1, 1, dtype=torch.long), logits[:1].clone())
    assert torch.equal(torch.isinf(got[0]), torch.isinf(want[0])), name
    assert torch.equal(got[1], logits[1])


def test_top_k_one_is_greedy_whatever_the_seed():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(1))
    for seed in range(5):
        assert one(logits, SamplingParams(do_sample=True, top_k=1, seed=seed)).token == int(logits.argmax())


def test_top_p_keeps_only_the_nucleus():
    # probabilities ~ [0.64, 0.24, 0.09, 0.03]: top_p=0.7 keeps the first two only
    logits = torch.log(torch.tensor([0.64, 0.24, 0.09, 0.03]))
    seen = {one(logits, SamplingParams(do_sample=True, top_p=0.7, seed=s)).token for s in range(200)}
    assert seen == {0, 1}


def test_a_tiny_top_p_keeps_the_most_likely_token():
    """top_p 1e-46 is 0.0 in float32: the best token still survives (it was dropped with every other)."""
    logits = torch.randn(50, generator=torch.Generator().manual_seed(2))
    for top_p in (1e-46, 1e-9):
        for seed in range(5):
            assert one(logits, SamplingParams(do_sample=True, top_p=top_p, seed=seed)).token == int(logits.argmax())


def test_seed_reproduces_whatever_else_is_in_the_batch():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(do_sample=True, temperature=1.5, top_p=0.9, seed=42)

    def draws(others):
        target = row(params)
        out = []
        for _ in range(20):
            rows = [row(SamplingParams(do_sample=True, top_k=5, seed=s)) for s in range(others)] + [target]
            out.append(sample_batch(logits[-len(rows):], rows)[-1].token)
        return out

    assert draws(0) == draws(3)


def test_tiny_temperature_is_greedy_not_an_error():
    for t in (5e-324, 1e-9):
        assert one(torch.tensor([1.0, 3.0, 2.0]), SamplingParams(do_sample=True, temperature=t)).token == 1


def test_top_n_reports_the_raw_most_likely_tokens():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [1.0, 0.0, 0.0, 0.0]])
    out = sample_batch(logits, [row(SamplingParams(top_n=2)), row(SamplingParams())])
    raw = torch.log_softmax(logits[0], -1)
    assert [t for t, _ in out[0].top] == [1, 3]
    assert out[0].top[1][1] == pytest.approx(raw[3].item())
    assert out[1].top == []


def test_a_failing_row_fails_alone(monkeypatch):
    """An out-of-vocabulary logit_bias raises inside the batched stage; a draw raises for one seed.
    Each fails its own row only: the others get the token they get alone, generators untouched."""
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(5))
    good = [SamplingParams(), SamplingParams(do_sample=True, seed=11)]
    alone = [sample_batch(logits[i : i + 1], [row(p)])[0].token for i, p in zip((0, 2), good)]
    bad = SamplingParams(logit_bias=((99, 1.0),))
    out = sample_batch(logits, [row(good[0]), row(bad), row(good[1])])
    assert isinstance(out[1], IndexError)
    assert [out[0].token, out[2].token] == alone

    real_draw = sampling._draw

    def draw(scores, generator):
        if generator.initial_seed() == 13:
            raise RuntimeError("injected")
        return real_draw(scores, generator)

    monkeypatch.setattr(sampling, "_draw", draw)
    out = sample_batch(logits, [row(good[0]), row(SamplingParams(do_sample=True, seed=13)), row(good[1])])
    assert isinstance(out[1], RuntimeError) and [out[0].token, out[2].token] == alone
