"""Key retrieval at long context: does a backend still find one fact placed deep in a long prompt?

The command line of the needle probes (:mod:`server.bench_cmd.needle`, where the probes and their rationale
live: ``kvserve bench --needle-context`` scores them too). Every backend answers the same prompts through the
server's engine in-process (prefill in chunks of ``--chunk`` tokens).

    python -m bench.needle --model models/smollm2-135m-instruct --contexts 2048 4096 8000 \\
        --depths 0.1 0.5 0.9 --trials 2 --backends full int8 int4 --out docs/bench/needle.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from server.bench_cmd.needle import *  # noqa: F403 - the probes, as bench.needle has always offered them
from server.bench_cmd.needle import ANSWER_TOKENS, answer, probes, table


def main(argv: list[str] | None = None) -> int:
    from bench.budget import bad_spec, load_reference, make_backend

    p = argparse.ArgumentParser(prog="python -m bench.needle", description=__doc__.split("\n\n")[0])
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
        write_json(args.out, args, rows, md)
    return 0


def write_json(out: Path, args: argparse.Namespace, rows: list[dict], md: str) -> None:
    """``{"args", "rows", "table"}`` as JSON at ``out`` (its folder made): a benchmark's flags, rows and table."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                               "rows": rows, "table": md}, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
