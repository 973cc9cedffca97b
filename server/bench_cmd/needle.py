"""Key retrieval at long context: the needle probes ``kvserve bench --needle-context`` scores and
``python -m bench.needle`` runs on their own.

A quality price measured on 1K-token windows (the quality budget's perplexity and agreement) cannot see a method
that loses an old token's detail, because every window is short. This probe, after RULER's needle tasks (Hsieh et
al., arXiv 2404.06654), is generated here, with no download: a *needle* sentence ("The special magic number for
<key> is <7 digits>.") is placed at a chosen depth (0: the start, 1: the end) of filler text (the packaged
evaluation text, :mod:`cache_backends.calibration`'s ``evaluation.txt``) cut to the context's length, the question
("What is the special magic number for <key>?") follows, and the answer's start ("The special magic number for
<key> is") is given after the chat template's assistant turn, as RULER does for small models. The greedy answer
counts as found when the 7 digits are in it.

Every backend answers the same prompts through the server's engine in-process
(:func:`server.bench_cmd.in_process.new_engine`), so ``full``'s score is the model's own accuracy and each other
backend's difference is what its stored form loses.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

KEYS = ("amber-harbor", "silent-meadow", "copper-lantern", "northern-orchard", "velvet-canyon", "crimson-ledger",
        "hollow-summit", "granite-willow")
ANSWER_TOKENS = 12


def needle(key: str, value: str) -> str:
    return f"The special magic number for {key} is {value}."


def question(key: str) -> str:
    return f"What is the special magic number for {key} mentioned in the text above? Answer with the number."


def answer_start(key: str) -> str:
    return f"The special magic number for {key} is"


def filler_lines() -> list[str]:
    """The packaged evaluation text's lines (the haystack)."""
    from cache_backends.calibration import DEFAULT_EVAL_TEXT

    return [line for line in Path(DEFAULT_EVAL_TEXT).read_text().splitlines() if line.strip()]


def render(tok, text: str, key: str) -> str:
    """The user turn ``text`` + the question through the chat template (when the tokenizer has one), then the
    answer's start."""
    user = f"{text}\n\n{question(key)}"
    if getattr(tok, "chat_template", None):
        head = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                       add_generation_prompt=True)
    else:
        head = f"{user}\n\n"
    return head + answer_start(key)


def build_prompt(tok, lines: list[str], context: int, depth: float, key: str, value: str) -> list[int]:
    """Token ids of a prompt of at most ``context`` tokens: the filler's first lines, the needle inserted at the line
    boundary nearest ``depth`` (0-1) of their characters, the question and the answer's start.

    Raises:
        ValueError: if the filler is too short for ``context`` or the question alone does not fit.
    """
    def ids_for(count: int) -> list[int]:
        body = lines[:count]
        ends = list(itertools.accumulate(len(line) + 1 for line in body))  # each line boundary's character offset
        at = min(range(len(body) + 1), key=lambda i: abs((ends[i - 1] if i else 0) - depth * (ends[-1] if ends else 0)))
        return tok.encode(render(tok, "\n".join(body[:at] + [needle(key, value)] + body[at:]), key),
                          add_special_tokens=False)

    lo, hi = 0, len(lines)  # the most lines that fit: a binary search on the rendered prompt's length
    if len(ids_for(hi)) <= context:
        raise ValueError(f"the filler text holds fewer than {context} tokens")
    if len(ids_for(0)) > context:
        raise ValueError(f"context {context} is too short for the question")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(ids_for(mid)) <= context else (lo, mid)
    return ids_for(lo)


def probes(tok, contexts: list[int], depths: list[float], trials: int, seed: int = 0) -> list[dict]:
    """The prompts: each context x depth x trial, with its key and 7-digit value (seeded)."""
    rng, lines, out = random.Random(seed), filler_lines(), []
    for context in contexts:
        for depth in depths:
            for trial in range(trials):
                key, value = rng.choice(KEYS), str(rng.randrange(1_000_000, 10_000_000))
                start = rng.randrange(0, len(lines) // 2)  # a different stretch of filler per trial
                ids = build_prompt(tok, lines[start:] + lines[:start], context, depth, key, value)
                out.append({"context": context, "depth": depth, "trial": trial, "key": key, "value": value,
                            "ids": ids})
    return out


def answer(model, tok, backend, prompts: list[list[int]], chunk: int) -> list[str]:
    """Greedy answers of ``backend`` to ``prompts``, served together by the engine."""
    from server.bench_cmd.in_process import new_engine
    from server.engine.sampling import SamplingParams
    from server.engine.sequence import Sequence

    engine = new_engine(model, tok, backend, len(prompts), None, chunk=chunk, prefix_caching=False)
    seqs = [Sequence(request_id=str(i), prompt_ids=ids, max_new_tokens=ANSWER_TOKENS, params=SamplingParams(),
                     stop=[], backend_name=backend.name) for i, ids in enumerate(prompts)]
    for s in seqs:
        engine.submit(s)
    while engine.running or engine.waiting:
        engine.step()
    return [tok.decode(s.output_ids, skip_special_tokens=True) for s in seqs]


def table(rows: list[dict], backends: list[str]) -> str:
    """Found / asked per context and depth, one column per backend."""
    head = "| context | depth | " + " | ".join(f"`{b}`" for b in backends) + " |"
    lines = [head, "|" + "---|" * (2 + len(backends))]
    cells: dict = {}
    for r in rows:
        cell = cells.setdefault((r["context"], r["depth"]), {}).setdefault(r["backend"], [0, 0])
        cell[0] += r["found"]
        cell[1] += 1
    for (context, depth), by in sorted(cells.items()):
        lines.append(f"| {context} | {depth:g} | " + " | ".join(f"{by[b][0]}/{by[b][1]}" for b in backends) + " |")
    totals = {b: [sum(r["found"] for r in rows if r["backend"] == b), sum(r["backend"] == b for r in rows)]
              for b in backends}
    lines.append("| all | | " + " | ".join(f"**{totals[b][0]}/{totals[b][1]}**" for b in backends) + " |")
    return "\n".join(lines)
