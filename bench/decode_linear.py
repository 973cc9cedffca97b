"""A decode step with the model's linear layers through ``kvserve::skinny_linear`` against ``F.linear``, in one
process (:mod:`server.engine.decode_linear`): the median step time of each (:func:`bench.budget.step_time`),
alternated twice, the better of the two runs each, for each backend and batch.

    python -m bench.decode_linear [--model models/smollm2-135m-instruct] [--backends full int8] [--batches 1 2 4 6 9 12]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    from bench.budget import make_backend, step_time
    from cache_backends.calibration import calibration_ids
    from server.engine import decode_linear
    from server.model_loading import load_model

    p = argparse.ArgumentParser(prog="python -m bench.decode_linear", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--backends", nargs="+", default=["full", "int8"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 6, 9, 12])
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, torch.device("cpu"), torch.float32)
    ids = calibration_ids(model, tok, max_tokens=max(args.batches) * 97 + args.context + 100)
    low = decode_linear.MIN_ROWS
    rows = []
    try:
        for spec in args.backends:
            backend = make_backend(spec, model, tok)
            for batch in args.batches:
                runs: dict[bool, list[float]] = {False: [], True: []}
                for on in (False, True, False, True):
                    decode_linear.MIN_ROWS = low if on else 1 << 30  # off: every step through F.linear
                    runs[on].append(step_time(model, tok, backend, ids, args.context, batch, args.steps))
                off, kernel = min(runs[False]), min(runs[True])
                rows.append({"backend": spec, "batch": batch, "linear_ms": round(1000 * off, 1),
                             "kernel_ms": round(1000 * kernel, 1), "speedup": round(off / kernel, 2)})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        decode_linear.MIN_ROWS = low
    report = {"model": args.model, "context": args.context, "threads": args.threads, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
