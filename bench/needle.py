"""Key retrieval at long context: does a backend still find one fact placed deep in a long prompt?

A quality price measured on 1K-token windows (the quality budget's perplexity and agreement) cannot see a method
that loses an old token's detail, because every window is short. This probe, after RULER's needle tasks (Hsieh et
al., arXiv 2404.06654), is generated here, with no download: a *needle* sentence ("The special magic number for
<key> is <7 digits>.") is placed at a chosen depth (0: the start, 1: the end) of filler text (the packaged
evaluation text, :mod:`cache_backends.calibration`'s ``evaluation.txt``) cut to the context's length, the question
("What is the special magic number for <key>?") follows, and the answer's start ("The special magic number for
<key> is") is given after the chat template's assistant turn, as RULER does for small models. The greedy answer
counts as found when the 7 digits are in it.

Every backend answers the same prompts through the server's engine in-process (:func:`bench.budget.new_engine`,
prefill in chunks of ``--chunk`` tokens), so ``full``'s score is the model's own accuracy and each other backend's
difference is what its stored form loses.

    python -m bench.needle --model models/smollm2-135m-instruct --contexts 2048 4096 8000 \\
        --depths 0.1 0.5 0.9 --trials 2 --backends full int8 int4 --out docs/bench/needle.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time
from pathlib import Path

import torch

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
    from bench.budget import new_engine
    from server.engine.sampling import SamplingParams
    from server.engine.sequence import Sequence

    engine = new_engine(model, tok, backend, len(prompts), None, chunk=chunk, prefix_caching=False)
    seqs = [Sequence(request_id=str(i), prompt_ids=ids, max_new_tokens=ANSWER_TOKENS, params=SamplingParams(),
                     stop=[], emit=lambda e: None, backend_name=backend.name) for i, ids in enumerate(prompts)]
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


def main(argv: list[str] | None = None) -> int:
    from bench.budget import bad_spec, load_reference, make_backend

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    p.add_argument("--trials", type=int, default=2, help="prompts per context and depth (other keys and filler)")
    p.add_argument("--backends", nargs="+", default=["full", "int8", "int4"])
    p.add_argument("--chunk", type=int, default=256, help="prefill tokens per step (MAX_NUM_BATCHED_TOKENS)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if bad_spec(p.prog, args.backends):
        return 2
    if any(not 0 <= d <= 1 for d in args.depths) or args.trials < 1:
        p.error("--depths must lie in [0, 1] and --trials be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, _ = load_reference(args.model)
    limit = model.config.max_position_embeddings - ANSWER_TOKENS
    if max(args.contexts) > limit:
        p.error(f"--contexts above {limit}: the model's {model.config.max_position_embeddings} positions hold the "
                f"prompt and a {ANSWER_TOKENS}-token answer")
    asked = probes(tok, args.contexts, args.depths, args.trials)
    rows, started = [], time.perf_counter()
    for spec in args.backends:
        backend = make_backend(spec, model, tok)
        t = time.perf_counter()
        for probe, text in zip(asked, answer(model, tok, backend, [a["ids"] for a in asked], args.chunk)):
            rows.append({"backend": spec, "context": probe["context"], "depth": probe["depth"],
                         "trial": probe["trial"], "prompt_tokens": len(probe["ids"]), "value": probe["value"],
                         "answer": text, "found": probe["value"] in text})
        print(f"{spec}: {sum(r['found'] for r in rows if r['backend'] == spec)}/{len(asked)} found "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
    md = table(rows, args.backends)
    print(f"\n{md}\n\nCommand: `python -m bench.needle` ({time.perf_counter() - started:.0f} s)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v
                                                 for k, v in vars(args).items()},
                                        "rows": rows, "table": md}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
