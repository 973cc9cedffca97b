"""Sampling: a pure function from one step's logits and each request's parameters to token ids.

The order of operations follows transformers' ``generate()`` logits processors: repetition penalty,
then temperature, then top-k, then top-p; greedy decoding (``do_sample=False``) takes the arg-max of
the penalised logits. Each request owns a ``torch.Generator`` seeded from its ``seed``, so a seed
reproduces the output whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Below this temperature sampling is greedy (as in vLLM): dividing by a tinier number overflows.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """One request's decoding parameters (validated at the API edge).

    Attributes:
        do_sample: sample from the distribution (True) or take the arg-max (False).
        temperature: divides the logits; > 0.
        top_k: keep the k most likely tokens; 0 disables.
        top_p: keep the smallest set whose probability reaches top_p; 1.0 disables.
        repetition_penalty: CTRL-style penalty (Keskar et al., arXiv 1909.05858) on tokens already in
            the prompt or output; 1.0 disables.
        seed: the generator's seed.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor | None, penalty: float) -> torch.Tensor:
    """Divide positive (multiply negative) logits of ``seen`` token ids by ``penalty``.

    Args:
        logits: (vocab_size,) float logits.
        seen: (n,) int64 token ids already in the sequence.
        penalty: > 0; 1.0 returns ``logits`` unchanged.
    """
    if penalty == 1.0 or seen is None or seen.numel() == 0:
        return logits
    logits = logits.clone()
    scores = logits[seen]
    logits[seen] = torch.where(scores > 0, scores / penalty, scores * penalty)
    return logits


def sample_token(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None,
                 generator: torch.Generator | None, logprobs: torch.Tensor | None = None) -> tuple[int, float]:
    """Choose the next token for one sequence.

    Args:
        logits: (vocab_size,) raw logits of the last position (any float dtype).
        params: the request's sampling parameters.
        seen: (n,) prompt and generated token ids (for the repetition penalty; ``None`` when it is 1.0).
        generator: the request's seeded generator (used only when sampling).
        logprobs: log-softmax of ``logits`` if already computed (a batch computes them at once).

    Returns:
        ``(token_id, logprob)``: the chosen id and its log-probability under the model's raw
        distribution (log-softmax of the unprocessed logits, as TGI reports it).
    """
    logits = logits.float()
    if logprobs is None:
        logprobs = torch.log_softmax(logits, dim=-1)
    scores = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if not params.do_sample or params.temperature < MIN_TEMPERATURE:
        token = int(torch.argmax(scores))
        return token, float(logprobs[token])
    scores = scores / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, scores.numel())
        kth = torch.topk(scores, k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        # Drop a token once the mass *before* it already reaches top_p (the top token always stays).
        drop_sorted = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= params.top_p
        scores = scores.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if not torch.isfinite(probs).all():  # degenerate scores (e.g. all -inf): fall back to the arg-max
        token = int(torch.argmax(logits))
        return token, float(logprobs[token])
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logprobs[token])
