"""The quality budget's long price, for any backend: KL, perplexity change and top-1 agreement on the last tokens
of one long input, and the needles found in it (:mod:`server.long_context`), against ``full``.

At start-up the server long-prices only the backends that can drop far tokens (``window`` and its compositions:
:meth:`cache_backends.base.KVBackend.drops_tokens`); this prices every backend named, so a quantized one can be set
beside them. Nothing is cached or timed.

    python -m bench.long_price --model models/smollm2-135m-instruct --context 8192 \\
        --backends window int8 --threads 1 --out docs/bench/long_price.json
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    from bench.budget import bad_spec, load_reference, make_backend
    from bench.needle import write_json
    from cache_backends.geometry import ModelGeometry
    from cache_backends.calibration import calibration_ids
    from server.long_context import MIN_LONG_CONTEXT, build_long_probe
    from server.quality_price import Scorer

    p = argparse.ArgumentParser(prog="python -m bench.long_price", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--context", type=int, default=8192, help="tokens of the long input")
    p.add_argument("--backends", nargs="+", default=["window", "int8"], help="specs priced against full")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if bad_spec(p.prog, args.backends):
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, _ = load_reference(args.model)
    if not MIN_LONG_CONTEXT <= args.context <= model.config.max_position_embeddings:
        p.error(f"--context must lie in [{MIN_LONG_CONTEXT}, {model.config.max_position_embeddings}] (the model's "
                "positions)")
    ids = calibration_ids(model, tok)
    scorer = Scorer(model, ModelGeometry.from_config(model.config, torch.float32), ids,
                    long_probe=build_long_probe(tok, ids, args.context))
    started = time.perf_counter()
    _, _, found = scorer.long_reference()
    rows = [{"backend": "full", "kl": 0.0, "ppl_increase_pct": 0.0, "ppl_change_pct": 0.0, "agreement": 1.0,
             "found": found, "retrieval": sum(found) / len(found), "seconds": time.perf_counter() - started}]
    print(f"full: {sum(found)}/{len(found)} found ({rows[0]['seconds']:.0f} s)", flush=True)
    for spec in args.backends:
        t = time.perf_counter()
        price = scorer._measure_long(make_backend(spec, model, tok))
        rows.append({"backend": spec, **asdict(price), "seconds": time.perf_counter() - t})
        print(f"{spec}: +{price.ppl_increase_pct:.2f}% perplexity, agreement {price.agreement:.3f}, "
              f"{sum(price.found)}/{len(price.found)} found ({rows[-1]['seconds']:.0f} s)", flush=True)
    from server.long_context import DEPTHS

    lines = ["| backend | KL-implied ppl | realized ppl change | top-1 agreement | found | "
             + " | ".join(f"depth {d:g}" for d in DEPTHS) + " |", "|---" * (5 + len(DEPTHS)) + "|"]
    for r in rows:
        lines.append(f"| `{r['backend']}` | +{r['ppl_increase_pct']:.2f}% | {r['ppl_change_pct']:+.2f}% | "
                     f"{r['agreement']:.3f} | {sum(r['found'])}/{len(r['found'])} | "
                     + " | ".join("yes" if f else "no" for f in r["found"]) + " |")
    md = "\n".join(lines)
    print(f"\n{md}\n\n{args.context} tokens, last {scorer.long_probe.scored[1] - scorer.long_probe.scored[0]} "
          f"scored ({time.perf_counter() - started:.0f} s)")
    if args.out:
        write_json(args.out, args, rows, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
