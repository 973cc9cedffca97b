"""Sampling: one batched step from a decode batch's logits to each row's next token.

:func:`sample_batch` takes ``logits`` (batch, vocab) and one :class:`RowRequest` per row and applies
each row's processors as tensor operations over the rows that need them, in the order of transformers'
``generate()`` and TGI: repetition penalty, frequency/presence penalty, ``logit_bias``, end-of-text masking
(``min_tokens``, ``ignore_eos``), then a structured output's grammar mask (the tokens its grammar does not allow
next become -inf: :func:`apply_allowed`); then, for sampled rows only, temperature, top-k,
top-p and typical-p. Greedy rows take one batched arg-max of their processed scores; each sampled row
draws with its own ``torch.Generator`` seeded from its ``seed``, so a seed reproduces the output
whatever else is in the batch.

Reported log-probabilities (the chosen token's and the top ones) are those of the model's raw
distribution: log-softmax of the unprocessed logits, as TGI reports them.

A failure is confined to its row: if a batched processing stage raises, the rows are processed one by
one and only the row that raises gets an exception in place of its result; each row's draw is
separate too, so a row that fails never costs another row its token nor a draw of its generator.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

# Below this temperature sampling is greedy (as in vLLM): dividing by a tinier number overflows.
MIN_TEMPERATURE = 1e-5
NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingParams:
    """One request's decoding parameters (validated at the API edge).

    Attributes:
        do_sample: sample from the distribution (True) or take the arg-max (False).
        temperature: divides the logits; > 0.
        top_k: keep the k most likely tokens; 0 disables.
        top_p: keep the smallest set whose probability reaches top_p; 1.0 disables.
        typical_p: locally typical sampling (Meister et al., arXiv 2202.00666): keep the tokens whose
            information is closest to the entropy until their mass reaches typical_p; 1.0 disables.
        repetition_penalty: CTRL-style penalty (Keskar et al., arXiv 1909.05858) on tokens already in
            the prompt or output; 1.0 disables.
        frequency_penalty: subtracted from a token's logit once per occurrence (OpenAI; see
            ``frequency_over_all``); 0 disables.
        presence_penalty: subtracted from the logit of every token already generated (OpenAI); 0 disables.
        frequency_over_all: TGI's definition of the frequency penalty: occurrences counted over the
            prompt and the output, divided by their length. False: OpenAI's, raw counts over the output.
        logit_bias: ``(token_id, bias)`` pairs added to the logits before sampling.
        min_tokens: end-of-text ids are masked until this many tokens are generated.
        ignore_eos: end-of-text ids are always masked (generation runs to its length or a stop).
        top_n: how many most likely tokens (with log-probabilities) to report per step; 0: none.
        seed: the generator's seed.
        grammar_kind: a structured output's grammar (:data:`server.engine.grammar.KINDS`), or ``""`` for none.
        grammar: its JSON schema (JSON text) or regular expression; ``""`` for ``json_object``.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    frequency_over_all: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    top_n: int = 0
    seed: int = 0
    grammar_kind: str = ""
    grammar: str = ""

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature < MIN_TEMPERATURE


@dataclass
class RowRequest:
    """One row of a batch, as the sampler sees it.

    Attributes:
        params: the request's sampling parameters.
        prompt_ids: the prompt's token ids.
        output_ids: the tokens generated so far.
        generator: the request's seeded generator, on the logits' device (used only when sampling).
        allowed: a structured output's next-token mask, (ceil(vocab / 32),) int32 words: bit ``j`` of word ``i``
            allows token ``32 * i + j`` (llguidance's and xgrammar's bitmask layout); ``None``: every token.
    """

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    generator: torch.Generator | None = None
    allowed: torch.Tensor | None = None


@dataclass
class Sampled:
    """One row's result: ``token``, its raw ``logprob``, and ``top``: the ``params.top_n`` most likely
    ``(token_id, logprob)`` pairs, most likely first (empty when ``top_n`` is 0)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def new_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed`` (one per request)."""
    return torch.Generator(device=device).manual_seed(seed)


# ---- processors: each takes the scores of some rows (rows, vocab) and those rows' requests ---------

def _padded(lists: list[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad int lists into (rows, longest) ids and a float mask of the real entries."""
    width = max(1, max(len(ids) for ids in lists))
    ids = torch.zeros(len(lists), width, dtype=torch.long)
    mask = torch.zeros(len(lists), width)
    for r, row in enumerate(lists):
        if row:
            ids[r, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
            mask[r, : len(row)] = 1.0
    return ids.to(device), mask.to(device)


_BYTE_BITS: dict[torch.device, torch.Tensor] = {}


def _byte_bits(device: torch.device) -> torch.Tensor:
    """(256, 8) bool: the bits of each byte value, lowest first (one table per device)."""
    if device not in _BYTE_BITS:
        values = torch.arange(256, device=device).unsqueeze(1)
        _BYTE_BITS[device] = ((values >> torch.arange(8, device=device)) & 1).bool()
    return _BYTE_BITS[device]


def allowed_tokens(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """Unpack bitmask rows into booleans: each int32 word read as its four bytes (little-endian, as x86, ARM and
    CUDA store it), each byte looked up in a 256-entry table; one gather, no loop over the vocabulary.

    Args:
        words: (rows, ceil(vocab / 32)) int32 bitmask (bit ``j`` of word ``i``: token ``32 * i + j``).
        vocab: the logits' width (the words' bits past it are dropped).

    Returns:
        (rows, vocab) bool: True where the token is allowed.
    """
    data = words.contiguous().view(torch.uint8).reshape(-1).int()  # byte 4 i + k holds tokens 32 i + 8 k ...
    return _byte_bits(words.device).index_select(0, data).reshape(words.shape[0], -1)[:, :vocab]


def apply_allowed(scores: torch.Tensor, rows: list[RowRequest]) -> torch.Tensor:
    """Set every token a row's grammar does not allow next (its ``allowed`` bitmask) to -inf: one batched unpack
    and fill over the rows, no loop over the vocabulary."""
    words = torch.stack([r.allowed for r in rows]).to(scores.device)
    return scores.masked_fill(~allowed_tokens(words, scores.shape[-1]), NEG_INF)


def apply_repetition_penalty(scores: torch.Tensor, rows: list[RowRequest]) -> torch.Tensor:
    """Divide positive (multiply negative) scores of tokens in each row's prompt or output by its
    ``repetition_penalty``.

    Args:
        scores: (rows, vocab) float.
        rows: one request per row.

    Returns:
        (rows, vocab) new scores.
    """
    ids, mask = _padded([list(r.prompt_ids) + list(r.output_ids) for r in rows], scores.device)
    # Padding points at a token of the row itself: writing its penalised value twice changes nothing.
    ids = torch.where(mask > 0, ids, ids[:, :1])
    penalty = torch.tensor([[r.params.repetition_penalty] for r in rows], device=scores.device)
    picked = scores.gather(1, ids)
    picked = torch.where(picked > 0, picked / penalty, picked * penalty)
    return scores.scatter(1, ids, picked)


def apply_frequency_presence(scores: torch.Tensor, rows: list[RowRequest]) -> torch.Tensor:
    """Subtract ``frequency_penalty`` x count and ``presence_penalty`` x [count > 0] per token.

    Counts are over the output (OpenAI), or over prompt and output divided by their length when
    ``frequency_over_all`` (TGI).

    Args:
        scores: (rows, vocab) float.
        rows: one request per row.
    """
    lists, scale = [], []
    for r in rows:
        if r.params.frequency_over_all:
            ids = list(r.prompt_ids) + list(r.output_ids)
            lists.append(ids)
            scale.append(1.0 / max(1, len(ids)))
        else:
            lists.append(list(r.output_ids))
            scale.append(1.0)
    ids, mask = _padded(lists, scores.device)
    counts = torch.zeros_like(scores).scatter_add_(1, ids, mask)
    dev = scores.device
    freq = torch.tensor([[r.params.frequency_penalty * s] for r, s in zip(rows, scale)], device=dev)
    presence = torch.tensor([[r.params.presence_penalty] for r in rows], device=dev)
    return scores - freq * counts - presence * (counts > 0).to(scores.dtype)


def apply_logit_bias(scores: torch.Tensor, rows: list[RowRequest]) -> torch.Tensor:
    """Add each row's ``logit_bias`` to its scores (raises IndexError for an id outside the vocabulary)."""
    r_idx = [r for r, row in enumerate(rows) for _ in row.params.logit_bias]
    t_idx = [t for row in rows for t, _ in row.params.logit_bias]
    vals = [b for row in rows for _, b in row.params.logit_bias]
    if not r_idx:
        return scores
    dev = scores.device
    index = (torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev))
    return scores.index_put(index, torch.tensor(vals, device=dev, dtype=scores.dtype), accumulate=True)


def mask_eos(scores: torch.Tensor, rows: list[RowRequest], eos_ids: Iterable[int]) -> torch.Tensor:
    """Set the end-of-text ids of every row to -inf."""
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=scores.device)
    scores = scores.clone()
    scores[:, eos] = NEG_INF
    return scores


def apply_temperature(scores: torch.Tensor, rows: list[RowRequest]) -> torch.Tensor:
    return scores / torch.tensor([[r.params.temperature] for r in rows], device=scores.device)


def apply_top_k(scores: torch.Tensor, rows: list[RowRequest]) -> torch.Tensor:
    """Keep each row's ``top_k`` best scores (ties with the k-th kept); other scores become -inf."""
    vocab = scores.shape[-1]
    k = torch.tensor([min(r.params.top_k, vocab) for r in rows], device=scores.device)
    kth = scores.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
    return scores.masked_fill(scores < kth, NEG_INF)


def apply_top_p(scores: torch.Tensor, rows: list[RowRequest]) -> torch.Tensor:
    """Keep each row's smallest set of best tokens whose probability reaches its ``top_p`` (the best
    token always stays)."""
    top_p = torch.tensor([[r.params.top_p] for r in rows], device=scores.device)
    sorted_scores, order = torch.sort(scores, descending=True)
    probs = torch.softmax(sorted_scores, dim=-1)
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p  # the mass before the token already reaches top_p
    drop_sorted[:, 0] = False  # a top_p of 0.0 in float32 (1e-46 from a client) would drop every token
    return scores.masked_fill(drop_sorted.scatter(1, order, drop_sorted), NEG_INF)


def apply_typical_p(scores: torch.Tensor, rows: list[RowRequest]) -> torch.Tensor:
    """Locally typical sampling as transformers' ``TypicalLogitsWarper``, with a ``typical_p`` per row."""
    mass = torch.tensor([[r.params.typical_p] for r in rows], device=scores.device)
    normalized = torch.log_softmax(scores, dim=-1)
    p = torch.exp(normalized)
    entropy = -(normalized * p).nansum(-1, keepdim=True)
    shifted = torch.abs(-normalized - entropy)
    sorted_shift, order = torch.sort(shifted, descending=False)
    cumulative = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=1).clamp(max=scores.shape[-1] - 1)
    drop_sorted = sorted_shift > sorted_shift.gather(1, last.unsqueeze(1))
    drop_sorted[:, 0] = False
    return scores.masked_fill(drop_sorted.scatter(1, order, drop_sorted), NEG_INF)


def _on(scores: torch.Tensor, rows: list[RowRequest], wanted, fn, *args) -> torch.Tensor:
    """Apply ``fn`` to the rows for which ``wanted(row)`` holds, as one tensor operation."""
    idx = [i for i, r in enumerate(rows) if wanted(r)]
    if not idx:
        return scores
    if len(idx) == len(rows):
        return fn(scores, rows, *args)
    index = torch.tensor(idx, device=scores.device)
    sub = fn(scores[index], [rows[i] for i in idx], *args)
    scores = scores.clone()
    scores[index] = sub
    return scores


def process(logits: torch.Tensor, rows: list[RowRequest], eos_ids: Iterable[int] = ()) -> torch.Tensor:
    """Every row's processors applied to its logits.

    Args:
        logits: (rows, vocab) float32 logits.
        rows: one request per row.
        eos_ids: the end-of-text ids that ``min_tokens`` and ``ignore_eos`` mask.

    Returns:
        (rows, vocab) scores: greedy rows take their arg-max, sampled rows their softmax.
    """
    eos_ids = list(eos_ids)
    s = logits
    s = _on(s, rows, lambda r: r.params.repetition_penalty != 1.0, apply_repetition_penalty)
    s = _on(s, rows, lambda r: r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0,
            apply_frequency_presence)
    s = _on(s, rows, lambda r: bool(r.params.logit_bias), apply_logit_bias)
    if eos_ids:
        s = _on(s, rows, lambda r: r.params.ignore_eos or len(r.output_ids) < r.params.min_tokens, mask_eos, eos_ids)
    # the grammar's mask last: whatever the processors before made of a score (a repetition penalty that is 0 in
    # float32 turns -inf into NaN), a token the grammar does not allow ends at -inf
    s = _on(s, rows, lambda r: r.allowed is not None, apply_allowed)
    sampled = lambda r: not r.params.greedy  # noqa: E731
    s = _on(s, rows, lambda r: sampled(r) and r.params.temperature != 1.0, apply_temperature)
    s = _on(s, rows, lambda r: sampled(r) and r.params.top_k > 0, apply_top_k)
    s = _on(s, rows, lambda r: sampled(r) and r.params.top_p < 1.0, apply_top_p)
    s = _on(s, rows, lambda r: sampled(r) and r.params.typical_p < 1.0, apply_typical_p)
    return s


def _draw(scores: torch.Tensor, generator: torch.Generator | None) -> int:
    """One sampled row: a token id drawn from softmax(``scores``) (vocab,) with ``generator``."""
    probs = torch.softmax(scores, dim=-1)
    if not torch.isfinite(probs).all():  # degenerate scores (all -inf): the arg-max
        return int(torch.argmax(scores))
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_batch(logits: torch.Tensor, rows: list[RowRequest], eos_ids: Iterable[int] = (),
                 logprobs: torch.Tensor | None = None) -> list[Sampled | Exception]:
    """Choose the next token of every row of a batch.

    Args:
        logits: (batch, vocab) raw logits of the last position (any float dtype).
        rows: ``batch`` requests, row by row.
        eos_ids: end-of-text ids (masked for rows under ``min_tokens`` or with ``ignore_eos``).
        logprobs: (batch, vocab) log-softmax of ``logits`` if already computed.

    Returns:
        One entry per row: its :class:`Sampled`, or the exception that its sampling raised (the other
        rows are unaffected).
    """
    logits = logits.float()
    if logprobs is None:
        logprobs = torch.log_softmax(logits, dim=-1)
    eos_ids = list(eos_ids)
    results: list[Sampled | Exception | None] = [None] * len(rows)
    try:
        scores = process(logits, rows, eos_ids)
        row_scores = list(scores)
    except Exception:  # noqa: BLE001 - find the row that fails; the others go on
        row_scores = []
        for i, row in enumerate(rows):
            try:
                row_scores.append(process(logits[i : i + 1], [row], eos_ids)[0])
            except Exception as exc:  # noqa: BLE001
                results[i] = exc
                row_scores.append(None)
    tokens: list[int | None] = [None] * len(rows)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy and results[i] is None]
    if greedy:
        picked = torch.stack([row_scores[i] for i in greedy]).argmax(dim=-1).tolist()
        for i, t in zip(greedy, picked):
            tokens[i] = t
    for i, row in enumerate(rows):
        if results[i] is None and not row.params.greedy:
            try:
                tokens[i] = _draw(row_scores[i], row.generator)
            except Exception as exc:  # noqa: BLE001
                results[i] = exc
    live = [i for i in range(len(rows)) if results[i] is None]
    chosen = logprobs[live, [tokens[i] for i in live]].tolist() if live else []
    top_n = max((rows[i].params.top_n for i in live), default=0)
    top_vals = top_ids = None
    if top_n:
        top_vals, top_ids = logprobs[live].topk(min(top_n, logprobs.shape[-1]), dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for j, i in enumerate(live):
        n = rows[i].params.top_n
        top = list(zip(top_ids[j][:n], top_vals[j][:n])) if n else []
        results[i] = Sampled(token=tokens[i], logprob=chosen[j], top=top)
    return results


def prompt_logprobs(logits: torch.Tensor, prompt_ids: Sequence[int], top_n: int = 0
                    ) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """Log-probability of each prompt token given the ones before it (the first has none).

    Args:
        logits: (prompt_len, vocab) logits of every prompt position.
        prompt_ids: the prompt's ``prompt_len`` token ids.
        top_n: also return the ``top_n`` most likely ``(id, logprob)`` at each position (0: none).

    Returns:
        ``(logprobs, tops)``: ``prompt_len`` entries each, ``None`` for the first token; ``tops`` holds
        empty lists when ``top_n`` is 0.
    """
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)  # (prompt_len - 1, vocab)
    targets = torch.tensor(list(prompt_ids[1:]), device=logits.device).unsqueeze(1)
    chosen = [None] + logprobs.gather(1, targets).squeeze(1).tolist()
    tops: list[list[tuple[int, float]] | None] = [None]
    if top_n and len(prompt_ids) > 1:
        vals, ids = logprobs.topk(min(top_n, logprobs.shape[-1]), dim=-1)
        tops += [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    else:
        tops += [[] for _ in prompt_ids[1:]]
    return chosen, tops
