"""What the attention kernel's integer sums cost in quality: held-out perplexity of each backend's decode steps
with the scores a decode's 4-bit keys get by default (the query rounded to int8 once per key group, int8 dot
products with the codes) and with fp32 sums throughout (``KVSERVE_KERNEL_EXACT_SUMS=1``, what the torch path
computes), beside ``full``'s.

Each of ``--windows`` windows of ``--window`` held-out tokens is prefilled up to ``--prefix`` tokens, then decoded
one token a step through the paged pool and the kernel (the windows batched, one row each, as the server steps
them: :func:`bench.fidelity.paged_perplexity`); the perplexity is over the positions after the prefix, every one of
them but the first of each window predicted by a decode step that reads the stored codes. Speed is :mod:`bench.longctx`'s ``--paths kernel
kernel-exact``.

    python -m bench.exact_sums --model models/smollm2-135m-instruct --backends int4 int4:rotate=true --window 2048 --prefix 1536
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    from bench.budget import load_reference, make_backend
    from bench.fidelity import paged_perplexity
    from bench.needle import write_json
    from cache_backends import kernels

    p = argparse.ArgumentParser(prog="python -m bench.exact_sums", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--backends", nargs="+", default=["int4", "int4:rotate=true"],
                   help="backend specs (those without 4-bit keys give the same figure both ways)")
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--prefix", type=int, default=1536, help="tokens prefilled before the decoded positions")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not 0 < args.prefix < args.window:
        p.error("--prefix must be between 0 and --window")
    torch.set_num_threads(args.threads)
    if not kernels.load():
        p.error(f"the attention kernel is not available: {kernels.status()['reason']}")
    model, tok, ids = load_reference(args.model)
    if len(ids) < args.window:
        p.error(f"the held-out text has {len(ids)} tokens, fewer than --window {args.window}")

    def perplexity(spec: str, exact: bool) -> float:
        with kernels.using("kernel"), kernels.exact_sums(exact):
            return paged_perplexity(model, make_backend(spec, model, tok), ids, args.window, args.prefix,
                                    args.windows)

    full = perplexity("full", False)
    rows = [{"backend": "full", "integer_sums_ppl": round(full, 4), "fp32_sums_ppl": round(full, 4)}]
    print(json.dumps(rows[0]), flush=True)
    for spec in args.backends:
        ours, exact = perplexity(spec, False), perplexity(spec, True)
        rows.append({"backend": spec, "integer_sums_ppl": round(ours, 4), "fp32_sums_ppl": round(exact, 4),
                     "integer_vs_fp32_pct": round(100 * (ours / exact - 1), 3),
                     "fp32_vs_full_pct": round(100 * (exact / full - 1), 3),
                     "integer_vs_full_pct": round(100 * (ours / full - 1), 3)})
        print(json.dumps(rows[-1]), flush=True)
    md = markdown(rows)
    print(md)
    if args.out:
        write_json(args.out, args, rows, md)
    return 0


def markdown(rows: list[dict]) -> str:
    lines = ["| backend | ppl, integer sums | ppl, fp32 sums | integer vs fp32 | fp32 vs `full` | integer vs `full` |",
             "|---|---|---|---|---|---|"]
    for r in rows[1:]:
        lines.append(f"| `{r['backend']}` | {r['integer_sums_ppl']} | {r['fp32_sums_ppl']} | "
                     f"{r['integer_vs_fp32_pct']:+.3f}% | {r['fp32_vs_full_pct']:+.3f}% | "
                     f"{r['integer_vs_full_pct']:+.3f}% |")
    lines.append(f"| `full` | {rows[0]['integer_sums_ppl']} | | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
