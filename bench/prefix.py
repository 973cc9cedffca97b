"""The prefix-caching benchmark: what reusing cached KV blocks saves, per backend, with caching on and off.

The server's engine runs in-process (pool, scheduler, chunked prefill, batched decode, sampler), stepped by
this script; prompts are token ids from the held-out slice, greedy, EOS ignored.

(a) **Shared system prompt**: ``--streams`` concurrent streams share one ``--system-tokens`` system prompt,
    each with its own ``--question-tokens`` question, ``--new-tokens`` new tokens each. One request with the
    system prompt is served first (in steady state a shared system prompt is cached: a cold burst all
    admitted in one step would find nothing cached yet). TTFT p50/p95 and output tokens/s, caching on vs off.
(b) **Multi-turn**: ``--conversations`` chats of ``--turns`` turns, run concurrently, each opening with the
    system prompt of (a) (not cached beforehand); every turn re-sends the whole history (the system prompt,
    each earlier user message and answer) plus a new user message of ``--question-tokens`` tokens and
    generates ``--answer-tokens``. Hit rate (prompt tokens served from the cache / prompt tokens) and TTFT p50
    per turn.
(c) **Eviction**: ``--prefixes`` distinct ``--system-tokens`` prefixes requested one at a time in a seeded
    random order (``--requests`` requests), each with a short question, under a pool of ``--pool-prefixes``
    full-precision prefixes: the hit rate per backend (compressed blocks hold more prefixes in one pool).

Writes ``prefix.json`` and ``prefix.md`` to ``--out``. Run: ``python -m bench.prefix`` (about 10 minutes on a
2-core CPU; ``--quick`` for a smoke run). This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from bench.budget import bad_spec, load_reference, make_backend, new_engine, percentile
from cache_backends.registry import create
from cache_backends.spec import format_spec, parse_spec

REPO = Path(__file__).resolve().parents[1]


def _seq(i, prompt: list[int], new_tokens: int, backend_name: str):
    from server.engine.sampling import SamplingParams
    from server.engine.sequence import Sequence

    return Sequence(request_id=str(i), prompt_ids=prompt, max_new_tokens=new_tokens, params=SamplingParams(),
                    stop=[], backend_name=backend_name)


def _drain(engine) -> None:
    while engine.running or engine.waiting:
        engine.step()


def shared_prompt(model, tok, backend, ids: list[int], args, caching: bool) -> dict:
    """(a): one warm-up request, then ``args.streams`` concurrent streams sharing the system prompt."""
    system = ids[: args.system_tokens]
    questions = [ids[args.system_tokens + i * args.question_tokens: args.system_tokens + (i + 1) * args.question_tokens]
                 for i in range(args.streams + 1)]
    engine = new_engine(model, tok, backend, args.streams, None, args.chunk, prefix_caching=caching)
    engine.submit(_seq("warm", system + questions[-1], 1, backend.name))
    _drain(engine)
    seqs = [_seq(i, system + q, args.new_tokens, backend.name) for i, q in enumerate(questions[:-1])]
    t0 = time.perf_counter()
    for s in seqs:
        s.times.arrival = t0
        engine.submit(s)
    _drain(engine)
    wall = time.perf_counter() - t0
    ttft = [s.times.first_token - s.times.arrival for s in seqs]
    return {"caching": caching, "ttft_p50_s": percentile(ttft, 0.5), "ttft_p95_s": percentile(ttft, 0.95),
            "output_tokens_per_s": sum(len(s.output_ids) for s in seqs) / wall, "wall_s": wall,
            "cached_tokens": sum(s.cached_tokens for s in seqs), "prompt_tokens": sum(len(s.prompt_ids) for s in seqs)}


def multi_turn(model, tok, backend, ids: list[int], args) -> list[dict]:
    """(b): conversations advance one turn at a time, all at once; per turn, hit rate and TTFT p50."""
    engine = new_engine(model, tok, backend, args.conversations, None, args.chunk)
    system, piece = ids[: args.system_tokens], args.turns * args.question_tokens
    history = [list(system) for _ in range(args.conversations)]
    turns = []
    for turn in range(args.turns):
        seqs = []
        for c in range(args.conversations):
            start = args.system_tokens + c * piece + turn * args.question_tokens
            history[c] = history[c] + ids[start: start + args.question_tokens]
            seqs.append(_seq(f"{c}.{turn}", list(history[c]), args.answer_tokens, backend.name))
        t0 = time.perf_counter()
        for s in seqs:
            s.times.arrival = t0
            engine.submit(s)
        _drain(engine)
        for c, s in enumerate(seqs):
            history[c] = history[c] + s.output_ids
        prompt = sum(len(s.prompt_ids) for s in seqs)
        turns.append({"turn": turn + 1, "prompt_tokens": prompt, "cached_tokens": sum(s.cached_tokens for s in seqs),
                      "hit_rate": sum(s.cached_tokens for s in seqs) / prompt,
                      "ttft_p50_s": percentile([s.times.first_token - s.times.arrival for s in seqs], 0.5)})
    return turns


def eviction(model, tok, backend, ids: list[int], args, budget: int) -> dict:
    """(c): distinct prefixes in a seeded random order, one request at a time, under ``budget`` bytes."""
    n, size = args.prefixes, args.system_tokens
    prefixes = [ids[i * size: (i + 1) * size] for i in range(n)]
    tail = ids[n * size: n * size + 8]
    order = random.Random(args.seed).choices(range(n), k=args.requests)
    engine = new_engine(model, tok, backend, 1, budget, args.chunk)
    cached = prompt = 0
    for i, p in enumerate(order):
        s = _seq(i, prefixes[p] + tail, 1, backend.name)
        engine.submit(s)
        _drain(engine)
        cached, prompt = cached + s.cached_tokens, prompt + len(s.prompt_ids)
    return {"requests": len(order), "distinct": len(set(order)), "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": cached / prompt, "pool_bytes": engine.kv.num_pages * engine.kv.page_bytes,
            "pool_tokens_of_this_backend": engine.kv.blocks.usable_pages
            * engine.kv.layouts[backend.name].cache_block_tokens}


def tables(res: dict, args) -> str:
    out = [f"(a) {args.streams} concurrent streams sharing a {args.system_tokens}-token system prompt, each with "
           f"its own {args.question_tokens}-token question, {args.new_tokens} new tokens (one warm-up request first). "
           f"Command: `python -m bench.prefix`.", "",
           "| backend | caching | TTFT p50 / p95 (s) | output tok/s | prompt tokens from cache | TTFT p50 off/on | tok/s on/off |",
           "|---|---|---|---|---|---|---|"]
    for spec, (off, on) in res["shared"].items():
        for r in (off, on):
            ratio = (f"{off['ttft_p50_s'] / on['ttft_p50_s']:.1f}x | {on['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}x"
                     if r is on else " | ")
            out.append(f"| {spec} | {'on' if r['caching'] else 'off'} | {r['ttft_p50_s']:.3f} / {r['ttft_p95_s']:.3f} "
                       f"| {r['output_tokens_per_s']:.0f} | {r['cached_tokens'] / r['prompt_tokens']:.0%} | {ratio} |")
    turns = next(iter(res["multi_turn"].values()))
    out += ["", f"(b) {args.conversations} chats x {args.turns} turns, each opening with the {args.system_tokens}-token "
            f"system prompt (each turn re-sends the history plus a "
            f"{args.question_tokens}-token message, {args.answer_tokens}-token answers): share of prompt tokens "
            "served from the cache, and TTFT p50 (s), per turn.", "",
            "| backend | " + " | ".join(f"turn {t['turn']}" for t in turns) + " |",
            "|---|" + "---|" * len(turns)]
    for spec, turns in res["multi_turn"].items():
        out.append(f"| {spec} | " + " | ".join(f"{t['hit_rate']:.0%} ({t['ttft_p50_s']:.3f})" for t in turns) + " |")
    out += ["", f"(c) {args.prefixes} distinct {args.system_tokens}-token prefixes, {args.requests} requests one at a "
            f"time in a seeded random order, pool of {args.pool_prefixes} full-precision prefixes "
            f"({res['eviction_budget']} bytes).", "",
            "| backend | prompt tokens from cache | vs full | tokens the pool holds |", "|---|---|---|---|"]
    base = None
    for spec, r in res["eviction"].items():
        base = base or r["hit_rate"]
        out.append(f"| {spec} | {r['hit_rate']:.1%} | {r['hit_rate'] / base:.2f}x | {r['pool_tokens_of_this_backend']} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / "models" / "kjv-llama-mha"))
    ap.add_argument("--specs", nargs="+", default=["full", "int8"], help="backends of (a) and (b)")
    ap.add_argument("--eviction-specs", nargs="+", default=["full", "int8", "mla+int8:rank=64"])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--prefixes", type=int, default=16)
    ap.add_argument("--pool-prefixes", type=int, default=4)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=256, help="MAX_NUM_BATCHED_TOKENS of the engine")
    ap.add_argument("--quick", action="store_true", help="4 streams, 2 conversations x 3 turns, 16 requests")
    ap.add_argument("--out", default=str(REPO / "docs" / "bench"))
    args = ap.parse_args(argv)
    if args.quick:
        args.streams, args.new_tokens, args.conversations, args.turns, args.requests = 4, 8, 2, 3, 16
        args.eviction_specs = args.eviction_specs[:2]
    if bad_spec("bench.prefix", args.specs + args.eviction_specs):
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok, ids = load_reference(args.model)
    res = {"args": vars(args), "shared": {}, "multi_turn": {}, "eviction": {}}
    with torch.inference_mode():
        for spec in args.specs:
            backend = make_backend(spec, model, tok)
            name = format_spec(*parse_spec(spec))
            res["shared"][name] = [shared_prompt(model, tok, backend, ids, args, c) for c in (False, True)]
            res["multi_turn"][name] = multi_turn(model, tok, backend, ids, args)
            print(f"{name}: (a) and (b) done", file=sys.stderr)
        for spec in args.eviction_specs:
            backend = make_backend(spec, model, tok)
            full = create("full", backend.geometry)
            res["eviction_budget"] = budget = (args.pool_prefixes * full.reserved_bytes(args.system_tokens)
                                               + 2 * full.reserved_bytes(16))  # the null page and a spare block
            res["eviction"][format_spec(*parse_spec(spec))] = eviction(model, tok, backend, ids, args, budget)
            print(f"{spec}: (c) done", file=sys.stderr)
    (out / "prefix.json").write_text(json.dumps(res, indent=1))
    (out / "prefix.md").write_text(tables(res, args))
    print(tables(res, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
