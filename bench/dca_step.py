"""Where a ``dca`` decode step's time goes: one engine decode step of ``--batch`` sequences x ``--context`` cached
tokens for ``full``, for ``dca`` with every reuse candidate reusing (``threshold=-1``), with none reusing
(``threshold=1.01``: every layer kept, dca's own bookkeeping only), and reusing with ``align=none`` (the source's
K/V as they are, no map), and for ``mla`` and ``dca+mla`` (every candidate reusing, its map over the source's
latent), alternating over ``--rounds`` rounds; median ms and aten op counts
(:func:`bench.budget.step_time`). ``--paths kernel torch`` times each setting with the attention kernel (the pages
read in place: a reuse layer's own and its source's, :func:`cache_backends.dca.paged.attend_in_place_through_map`)
and with the torch path (gathered), in turn.

    python -m bench.dca_step [--paths kernel torch] [--out docs/bench/dca_step.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SETTINGS = [("full", "full", {}), ("dca, every candidate reusing", "dca", {"threshold": -1.0}),
            ("dca, none reusing", "dca", {"threshold": 1.01}),
            ("dca align=none, every candidate reusing", "dca", {"threshold": -1.0, "align": "none"}),
            ("mla:rank=128", "mla", {"rank": 128}),
            ("dca+mla:rank=128, every candidate reusing", "dca+mla", {"threshold": -1.0, "rank": 128})]


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.budget import step_time
    from cache_backends.geometry import ModelGeometry
    from cache_backends.calibration import calibration_ids
    from cache_backends.registry import create
    from server.engine.malloc_tuning import keep_step_memory

    p = argparse.ArgumentParser(prog="python -m bench.dca_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/kjv-llama-mha")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--paths", nargs="+", choices=["kernel", "torch"], default=["kernel"],
                   help="attention paths (KV_ATTENTION) each setting runs on, in turn")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from cache_backends import kernels
    keep_step_memory()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    geometry = ModelGeometry.from_config(model.config, torch.float32)
    calib = calibration_ids(model, tok, max_tokens=4096)
    ids = calibration_ids(model, tok, max_tokens=args.batch * 97 + args.context + 100)
    rows: dict[str, dict] = {}
    for _ in range(args.rounds):
        for label, name, options in SETTINGS:
            backend = create(name, geometry, **options)
            backend.prepare(model, calib)
            for path in args.paths:
                with kernels.using(path):
                    seconds, ops = step_time(model, tok, backend, ids, args.context, args.batch, args.steps, ops=True)
                key = label if args.paths == ["kernel"] else f"{label} [{path}]"
                row = rows.setdefault(key, {"spec": name, "options": options, "path": path, "ms": [], "ops": ops})
                row["ms"].append(round(seconds * 1000, 1))
                print(f"{key}: {seconds * 1000:.1f} ms, {ops} aten ops", flush=True)
    report = {"model": args.model, "batch": args.batch, "context": args.context, "threads": torch.get_num_threads(),
              "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
