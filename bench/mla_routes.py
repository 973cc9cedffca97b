"""The two MLA routes side by side: post-hoc latent on the MHA model vs the converted MLA model.

- post-hoc: ``KV_BACKEND=mla`` on ``models/kjv-llama-mha`` (a calibrated joint K/V latent; RoPE keeps the key
  side from being absorbed, so decode rebuilds keys from the latent);
- converted: ``models/kjv-llama-mla`` (MHA2MLA, arXiv 2502.14837: partial RoPE + joint latent + fine-tune,
  ``scripts/convert_mha2mla.py``) served by ``mla`` with fully absorbed attention, and by ``mla+int8`` (the
  latent and the rope key quantized per channel, attended on the codes).

Per route: KV bytes per token (the backend's sum, all layers), held-out perplexity through the cache path
(``--windows`` windows of 1024 tokens, the last 512 scored through decode), single-stream TPOT (one decode
step's median seconds at 512 and 1008 cached tokens), and the memory-bound serving run of ``bench.budget``
(16 streams, 512-token prompts, 448 new tokens) under one KV budget for all routes: two full-precision
1024-token sequences of the MHA model (32 MiB).

Writes ``mla_routes.json`` and ``mla_routes.md`` to ``--out``. Run: ``python -m bench.mla_routes``.
This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bench.budget import budget_run, make_backend, step_time
from bench.fidelity import cache_path_perplexity
from bench.quality import EVAL_SLICE, model_slice_ids
from cache_backends.registry import create

REPO = Path(__file__).resolve().parents[1]
MHA, MLA = REPO / "models" / "kjv-llama-mha", REPO / "models" / "kjv-llama-mla"
ROUTES = [("MHA, full", MHA, "full"), ("MHA, mla post-hoc rank 128", MHA, "mla:rank=128"),
          ("MHA, mla post-hoc rank 64", MHA, "mla:rank=64"), ("converted MLA model, mla (absorbed)", MLA, "mla"),
          ("converted MLA model, mla+int8 (absorbed, int8 latent)", MLA, "mla+int8")]


def table(rows: list[dict], budget: int) -> str:
    lines = [f"KV budget {budget:,} bytes (two 1024-token sequences of `full` on the MHA model); 16 streams x "
             "(512-token prompt + 448 new tokens), greedy.", "",
             "| route | KV bytes/token | vs full | held-out ppl (cache path) | TPOT 512 / 1008 ctx (ms) | "
             "output tok/s under the budget | streams at once | peak KV / budget |",
             "|---|---|---|---|---|---|---|---|"]
    base = rows[0]
    for r in rows:
        lines.append(f"| {r['route']} | {r['bytes_per_token']:,.0f} | {base['bytes_per_token'] / r['bytes_per_token']:.1f}x"
                     f" smaller | {r['ppl']:.2f} ({100 * (r['ppl'] / base['ppl'] - 1):+.1f}%) | "
                     f"{1000 * r['tpot_512_s']:.1f} / {1000 * r['tpot_1008_s']:.1f} | "
                     f"{r['output_tokens_per_s']:.0f} ({r['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x) | "
                     f"{r['most_running']} | {r['peak_kv_allocated_bytes'] / budget:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.mla_routes", description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=4, help="1024-token held-out windows for perplexity")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=448)
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per TPOT point")
    ap.add_argument("--routes", nargs="+", type=int, default=None,
                    help=f"route numbers to run, 1-{len(ROUTES)} (1, MHA full, the baseline, always runs)")
    ap.add_argument("--out", default=str(REPO / "docs" / "bench"))
    args = ap.parse_args(argv)
    chosen = sorted({1, *(args.routes or range(1, len(ROUTES) + 1))})
    if not set(chosen) <= set(range(1, len(ROUTES) + 1)):
        ap.error(f"--routes: numbers 1-{len(ROUTES)}")
    from server.model_loading import load_model

    torch.manual_seed(0)
    rows, budget, models = [], None, {}
    for route, path, spec in (ROUTES[i - 1] for i in chosen):
        if path not in models:
            models[path] = load_model(str(path), torch.device("cpu"), torch.float32)
        model, tokenizer = models[path]
        ids = model_slice_ids(path, EVAL_SLICE, tokenizer)
        backend = make_backend(spec, model, tokenizer)
        if budget is None:
            budget = 2 * create("full", backend.geometry).reserved_bytes(1024)
        step = (len(ids) - 512) // args.streams
        prompts = [ids[i * step : i * step + 512] for i in range(args.streams)]
        r = {"route": route, "model": path.name, "spec": spec,
             "bytes_per_token": backend.bytes_per_token_per_layer(1024) * backend.geometry.num_layers,
             "ppl": cache_path_perplexity(model, backend, ids, max_windows=args.windows),
             "tpot_512_s": step_time(model, tokenizer, backend, ids, 512, 1, args.steps),
             "tpot_1008_s": step_time(model, tokenizer, backend, ids, 1008, 1, args.steps)}
        r.update(budget_run(model, tokenizer, backend, prompts, args.new_tokens, budget, 256))
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if not isinstance(v, list)}), file=sys.stderr, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mla_routes.json").write_text(json.dumps({"args": vars(args), "budget": budget, "rows": rows}, indent=1))
    (out / "mla_routes.md").write_text(table(rows, budget))
    print(table(rows, budget))
    return 0 if all(r["within_budget"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
