"""``dca`` on long prompts: greedy agreement with ``full`` against the KV bytes it saves.

For each setting: ``--prompts`` prompts of ``--prompt-tokens`` tokens (every 1000 tokens of the held-out
slice), ``--new-tokens`` greedy tokens decoded as one batch, and, against ``full``'s tokens:

* prefix agreement: per prompt, the tokens before the first difference / ``--new-tokens``, averaged;
* position agreement: the share of positions with the same token;
* compression: ``full``'s bytes over the setting's bytes, summed over the prompts' stores at the end of the
  generation (what the stores really hold: their reuse decisions, residual windows and fall-backs);
* reuse layers per prompt and decode fall-backs; the calibrated reuse candidates and runtime thresholds.

Writes ``dca_long.json`` and ``dca_long.md`` to ``--out``. Run: ``python -m bench.dca_long`` (``make bench-dca``).
This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench.fidelity import agreement, greedy_tokens
from bench.quality import CALIB_SLICE, EVAL_SLICE, model_slice_ids
from cache_backends.geometry import ModelGeometry
from cache_backends.registry import create
from cache_backends.spec import echo_recorded, format_spec, parse_spec

REPO = Path(__file__).resolve().parents[1]
SPECS = ["full", "dca:window=0", "dca", "dca:window=64", "dca+int8", "dca+mla:rank=128"]


def generate(model, backend, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], dict]:
    """Greedy continuations of every prompt, one batch; and what the stores held at the end: ``bytes`` (sum),
    ``reuse_layers`` per prompt (decided at prefill), ``fallbacks`` (sum)."""
    held = {}

    def inspect(stores):
        held.update(bytes=sum(s.nbytes() for s in stores), fallbacks=sum(getattr(s, "fallbacks", 0) for s in stores),
                    reuse_layers=[[layer.index for layer in s.layers if getattr(layer, "mode", "") == "reuse"]
                                  for s in stores])

    return greedy_tokens(model, backend, prompts, new_tokens, inspect), held


def prefix_agreement(ours: list[list[int]], reference: list[list[int]]) -> float:
    """Mean over prompts of (tokens before the first difference) / length."""
    def prefix(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
    return sum(prefix(a, b) / len(b) for a, b in zip(ours, reference)) / len(reference)


def table(rows: list[dict], args) -> str:
    lines = [f"{args.prompts} prompts x {args.prompt_tokens} tokens (held-out slice), {args.new_tokens} greedy "
             "tokens, fp32 CPU. Compression: `full`'s bytes / the setting's, stores at the end of generation.", "",
             "| setting | compression | prefix agreement | position agreement | reuse layers (most prompts) | "
             "fall-backs | reuse candidates | runtime threshold per layer (1 / 16 / 1024 tokens) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        common = max(map(tuple, r["reuse_layers"]), key=r["reuse_layers"].count) if r["reuse_layers"] else ()
        thresholds = "; ".join(f"{layer}: {t['1']:.3f} / {t['16']:.3f} / {t['1024']:.3f}"
                               for layer, t in r.get("runtime_thresholds_by_layer", {}).items())
        lines.append(f"| {echo_recorded(r['spec'])} | {r['compression']:.2f}x | {r['prefix_agreement']:.3f} | "
                     f"{r['position_agreement']:.3f} | {', '.join(map(str, common)) or '-'} | {r['fallbacks']} | "
                     f"{', '.join(map(str, r.get('reuse_candidates', []))) or '-'} | {thresholds or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from server.model_loading import load_model

    ap = argparse.ArgumentParser(prog="python -m bench.dca_long", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "models" / "kjv-llama-mha"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=900)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--backends", nargs="+", default=SPECS, help="specs; full is always measured first")
    ap.add_argument("--out", default=str(REPO / "docs" / "bench"))
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model, torch.device("cpu"), torch.float32)
    geometry = ModelGeometry.from_config(model.config, torch.float32)
    eval_ids = model_slice_ids(Path(args.model), EVAL_SLICE, tokenizer)
    calib_ids = model_slice_ids(Path(args.model), CALIB_SLICE, tokenizer)
    prompts = [eval_ids[i * 1000 : i * 1000 + args.prompt_tokens] for i in range(args.prompts)]
    rows, reference = [], None
    for spec in ["full"] + [s for s in args.backends if s != "full"]:
        t0 = time.perf_counter()
        name, options = parse_spec(spec)
        backend = create(name, geometry, **options)
        backend.prepare(model, calib_ids)
        tokens, held = generate(model, backend, prompts, args.new_tokens)
        reference = reference or {"tokens": tokens, "bytes": held["bytes"]}
        details = backend.details()
        rows.append({"spec": format_spec(name, backend.params()), **held,
                     "compression": reference["bytes"] / held["bytes"],
                     "prefix_agreement": prefix_agreement(tokens, reference["tokens"]),
                     "position_agreement": agreement(tokens, reference["tokens"]),
                     **{k: details[k] for k in ("reuse_candidates", "runtime_thresholds_by_layer",
                                                "served_similarity_by_layer") if k in details},
                     "seconds": time.perf_counter() - t0})
        print(f"{rows[-1]['spec']}: {rows[-1]['compression']:.2f}x, prefix {rows[-1]['prefix_agreement']:.3f}, "
              f"positions {rows[-1]['position_agreement']:.3f}", file=sys.stderr, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dca_long.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1, default=str))
    (out / "dca_long.md").write_text("# dca on long prompts\n\n`python -m bench.dca_long`\n\n" + table(rows, args))
    print(table(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
