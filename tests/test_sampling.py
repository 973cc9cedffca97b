import torch

from server.engine.sampling import SamplingParams, apply_repetition_penalty, sample_token


def test_greedy_takes_argmax_and_reports_raw_logprob():
    logits = torch.tensor([0.1, 2.0, 1.0, -1.0])
    token, logprob = sample_token(logits, SamplingParams(), torch.tensor([], dtype=torch.long), None)
    assert token == 1
    assert abs(logprob - torch.log_softmax(logits, -1)[1].item()) < 1e-6


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([2.0, -1.0, 3.0])
    out = apply_repetition_penalty(logits, torch.tensor([0, 1]), 2.0)
    assert out.tolist() == [1.0, -2.0, 3.0]
    # greedy choice moves away from a penalised token
    token, _ = sample_token(torch.tensor([3.0, 2.9]), SamplingParams(repetition_penalty=1.2), torch.tensor([0]), None)
    assert token == 1


def test_top_k_one_is_greedy_whatever_the_seed():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(1))
    for seed in range(5):
        params = SamplingParams(do_sample=True, top_k=1, seed=seed)
        token, _ = sample_token(logits, params, torch.tensor([], dtype=torch.long),
                                torch.Generator().manual_seed(seed))
        assert token == int(logits.argmax())


def test_top_p_keeps_only_the_nucleus():
    # probabilities ~ [0.64, 0.24, 0.09, 0.03]: top_p=0.7 keeps the first two only
    logits = torch.log(torch.tensor([0.64, 0.24, 0.09, 0.03]))
    seen = set()
    for seed in range(200):
        token, _ = sample_token(logits, SamplingParams(do_sample=True, top_p=0.7, seed=seed),
                                torch.tensor([], dtype=torch.long), torch.Generator().manual_seed(seed))
        seen.add(token)
    assert seen == {0, 1}


def test_seed_reproduces_a_sampled_sequence():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(do_sample=True, temperature=1.5, seed=42)
    draw = lambda: [sample_token(logits, params, torch.tensor([], dtype=torch.long), g)[0]  # noqa: E731
                    for g in [torch.Generator().manual_seed(42)] for _ in range(20)]
    assert draw() == draw()


def test_tiny_temperature_is_greedy_not_an_error():
    logits = torch.tensor([1.0, 3.0, 2.0])
    for t in (5e-324, 1e-9):
        token, _ = sample_token(logits, SamplingParams(do_sample=True, temperature=t), None,
                                torch.Generator().manual_seed(0))
        assert token == 1
