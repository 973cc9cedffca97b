"""The quality budget's long input (``KV_QUALITY_LONG_CONTEXT``): one prompt as long as the served context allows,
holding a stretch of calibration text to price on and key-retrieval needles to find.

The budget's short price (:mod:`server.quality_budget`) reads windows of 512 tokens, so a backend that drops
tokens (``window``: attention sinks and the last N tokens) costs nothing there and fails at long context. The long
input is RULER's multi-query needle task (Hsieh et al., arXiv 2404.06654, ``niah_multiquery``), generated here with
no download, in one pass a backend:

* the filler is the end of the calibration text, cut so the whole input is ``length`` tokens;
* :data:`DEPTHS` needles ("The special magic number for <key> is <7 digits>.", the sentences of
  :mod:`server.bench_cmd.needle`, one key each) are spliced into it at those depths (0: its start, 1: its end), at
  the token after the nearest line break;
* its last :data:`LONG_SCORED` tokens are the scored tail: the price (KL against ``full``, the perplexity change,
  the top-1 agreement) is counted there, after every earlier token was read through the backend's store;
* then the question ("What are the special magic numbers for <k1>, <k2>, ... mentioned in the text above?") and
  one answer sentence per key, the answer's start given ("The special magic number for <k> is") as RULER does for
  small models. A needle is *found* when, at every token of its value, the backend's most likely next token is the
  value's (teacher forcing: the greedy answer would be the value, digit for digit).

A chat model reads it as one user turn (the filler and the question) and its answer (the tokenizer's chat
template); a model without one reads plain text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

DEFAULT_LONG_CONTEXT = 8192
"""The longest input priced when ``KV_QUALITY_LONG_CONTEXT`` is unset (``auto``): capped by the model's positions
and ``MAX_TOTAL_TOKENS``."""
MIN_LONG_CONTEXT = 1024
"""The shortest long input (tokens). The input holds, besides its filler (:data:`LONG_SCORED` scored tokens and 64
before them), the chat template, four needles, the question and the answers: 601 tokens in all on the reference
model's tokenizer, 549 on SmolLM2's, 519 on Gemma 3's; a setting of 512-600 passed, then priced nothing with a
warning in the log alone. 1024 leaves room for a longer chat template (a default system prompt) and is two short
windows (the short price's are 512 tokens), the least that is a long input."""
LONG_SCORED = 256
"""Tokens of the filler's end scored for the long price (KL, perplexity, agreement)."""
DEPTHS = (0.1, 0.35, 0.6, 0.85)
"""Where the needles go, as a share of the filler before the scored tail (0: its start)."""
LONG_PROBE_VERSION = 1
"""Of the long input's layout: part of a long price's cache key (a price of another layout is not read back)."""


def parse_long_context(value) -> int | None:
    """``KV_QUALITY_LONG_CONTEXT`` as the settings hold it: ``None`` for ``auto`` (or unset, empty), 0 for ``off``
    (or ``0``), else a length in tokens.

    Raises:
        ValueError: anything else, or a length under :data:`MIN_LONG_CONTEXT` (one line, naming what is allowed).
    """
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
        return None
    if isinstance(value, str) and value.strip().lower() == "off":
        return 0
    if isinstance(value, bool):
        raise ValueError(f"must be auto, off (or 0), or a number of tokens >= {MIN_LONG_CONTEXT}")
    try:
        tokens = int(value) if not isinstance(value, float) or value.is_integer() else None
    except (TypeError, ValueError):
        tokens = None
    if tokens is None or (tokens != 0 and tokens < MIN_LONG_CONTEXT):
        raise ValueError(f"must be auto, off (or 0), or a number of tokens >= {MIN_LONG_CONTEXT} (what the long "
                         "input's needles, question and answers leave room for a scored tail in)")
    return tokens


def long_context_length(setting: int | None, max_positions: int, max_total_tokens: int | None) -> int:
    """The long input's length in tokens: the setting (``None``: :data:`DEFAULT_LONG_CONTEXT`) capped by the
    model's ``max_positions`` and ``max_total_tokens`` (``None``: the model's); 0 when the setting is off or the cap
    is under :data:`MIN_LONG_CONTEXT`."""
    if setting == 0:
        return 0
    length = min(DEFAULT_LONG_CONTEXT if setting is None else setting, max_positions,
                 max_total_tokens or max_positions)
    return length if length >= MIN_LONG_CONTEXT else 0


@dataclass
class LongProbe:
    """One long input (the module docstring): ``ids`` (``length`` token ids); ``scored``, the ``[start, end)`` of the
    scored tail; ``values``, each needle's value tokens as ``[start, end)`` positions of ``ids``; ``keys`` and
    ``answers`` (the 7-digit values) by needle, in :data:`DEPTHS` order; ``needles`` their positions in ``ids``."""

    ids: list[int]
    scored: tuple[int, int]
    values: list[tuple[int, int]]
    keys: list[str]
    answers: list[str]
    needles: list[int]

    def params(self) -> dict:
        """What identifies the layout in a price's cache key (with the ids' own digest, which the cache adds)."""
        return {"length": len(self.ids), "scored": list(self.scored), "depths": list(DEPTHS),
                "version": LONG_PROBE_VERSION}


def _template(tok, user: str) -> tuple[str, str]:
    """The text before and after a user turn's content, through the generation prompt (plain: none)."""
    if not getattr(tok, "chat_template", None):
        return "", ""
    mark = "\x00USER\x00"
    text = tok.apply_chat_template([{"role": "user", "content": mark + user}], tokenize=False,
                                   add_generation_prompt=True)
    head, _, tail = text.partition(mark)
    return head, tail


def build_long_probe(tok, filler_ids: list[int], length: int, seed: int = 0) -> LongProbe:
    """The long input of ``length`` tokens (the module docstring), its filler from the end of ``filler_ids``.

    Args:
        tok: the model's tokenizer (a fast one: the answer's value tokens are found by character offsets).
        filler_ids: the calibration text's token ids.
        length: tokens of the whole input, at least :data:`MIN_LONG_CONTEXT`.
        seed: picks the keys and values.

    Raises:
        ValueError: ``filler_ids`` too short for ``length``, or ``length`` too short for the question and answers.
    """
    from server.bench_cmd.needle import KEYS, answer_start, needle

    rng = random.Random(seed)
    keys = rng.sample(KEYS, len(DEPTHS))
    values = [str(rng.randrange(1_000_000, 10_000_000)) for _ in DEPTHS]
    ask = (f"What are the special magic numbers for {', '.join(keys[:-1])} and {keys[-1]} mentioned in the text "
           "above? Answer with the numbers.")
    head, tail = _template(tok, "")
    head_ids = tok.encode(head, add_special_tokens=False) if head else []
    answer = " ".join(f"{answer_start(k)} {v}." for k, v in zip(keys, values))
    closing = f"\n\n{ask}{tail or chr(10)}"
    closing_ids = tok.encode(closing, add_special_tokens=False)
    encoded = tok(answer, add_special_tokens=False, return_offsets_mapping=True)
    answer_ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    needle_ids = [tok.encode(f"\n{needle(k, v)}\n", add_special_tokens=False) for k, v in zip(keys, values)]
    filler_len = length - len(head_ids) - len(closing_ids) - len(answer_ids) - sum(map(len, needle_ids))
    if filler_len < LONG_SCORED + 64:
        raise ValueError(f"a long input of {length} tokens leaves {filler_len} for its filler text; it needs "
                         f"{LONG_SCORED + 64}")
    if len(filler_ids) < filler_len:
        raise ValueError(f"the calibration text has {len(filler_ids)} tokens; a long input of {length} needs "
                         f"{filler_len}")
    filler = list(filler_ids[len(filler_ids) - filler_len:])
    breaks = [i + 1 for i, t in enumerate(tok.convert_ids_to_tokens(filler)) if "\n" in t or "Ċ" in t]
    body, cut, needles = head_ids[:], 0, []
    spliced = filler_len - LONG_SCORED  # the needles go in before the scored tail
    for depth, ids in zip(DEPTHS, needle_ids):
        at = round(depth * spliced)
        near = [b for b in breaks if cut <= b <= spliced]
        at = min(near, key=lambda b: abs(b - at)) if near else max(at, cut)
        body += filler[cut:at]
        needles.append(len(body))
        body += ids
        cut = at
    body += filler[cut:]
    scored = (len(body) - LONG_SCORED, len(body))
    body += closing_ids
    base, spans = len(body), []
    for k, v in zip(keys, values):
        start = answer.index(f"{answer_start(k)} {v}.") + len(answer_start(k))  # the space before the value
        end = start + 1 + len(v)
        inside = [i for i, (a, b) in enumerate(offsets) if b > start and a < end and b > a]
        spans.append((base + inside[0], base + inside[-1] + 1))
    body += answer_ids
    return LongProbe(ids=body, scored=scored, values=spans, keys=keys, answers=values, needles=needles)
