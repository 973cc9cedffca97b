"""``kvserve bench``'s command line: its defaults, its arguments and the command that repeats a run, with no torch
import (``kvserve --help`` and every other subcommand build this parser; :mod:`server.bench_cmd.report` runs it)."""

from __future__ import annotations

import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SPECS = ["full", "gqa:groups=4,method=mean", "gqa:groups=4,method=pca", "gqa:groups=2,method=mean",
                 "gqa:groups=2,method=pca", "mla:rank=128", "mla:rank=64", "mla:rank=32",
                 "int8:group_size=32,residual=32", "int8:group_size=64,residual=64",
                 "dca:threshold=0.95,align=linear", "dca:threshold=0.9,align=none",
                 "gqa+int8:groups=4", "mla+int8:rank=64", "dca+int8:threshold=0.95", "dca+mla:threshold=0.95,rank=128"]
QUICK_SPECS = ["full", "gqa:groups=2,method=pca", "mla:rank=64", "int8", "dca"]
# Scoring sizes. Perplexity is scored token by token through each backend's decode path on the last
# 1024 - prefix tokens of each window (where a compressed cache holds the most tokens); 6 windows x 256
# tokens keep the default run of all 16 settings within 15 minutes on a 2-core CPU.
WINDOW = 1024  # tokens per perplexity window (the reference model's context)
MAX_PROMPTS = 20  # greedy prompts start every 1000 tokens of the ~20.7k-token eval slice
DEFAULT = {"windows": 6, "prefix": 768, "prompts": 16, "new_tokens": 64, "stream_tokens": 64, "rounds": 3}
QUICK = {"windows": 2, "prefix": 768, "prompts": 4, "new_tokens": 32, "stream_tokens": 32, "rounds": 3}


NEEDLE_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # --needle-context: one probe per depth
BUDGETED = "@budget"  # a --backends entry "mla@budget": the setting the quality budget (--budget) chooses


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(REPO / "models" / "kjv-llama-mha"))
    p.add_argument("--backends", nargs="+",
                   help="backend specs, e.g. gqa:groups=2,method=pca mla:rank=64 (full, the reference, is always run)")
    p.add_argument("--quick", action="store_true",
                   help=f"{len(QUICK_SPECS)} settings, {QUICK['windows']} windows, {QUICK['prompts']} prompts x "
                        f"{QUICK['new_tokens']} tokens (1.4 minutes on an idle 2-core CPU)")
    p.add_argument("--budget", type=float, default=1.0,
                   help=f"the quality budget (percent perplexity increase on the calibration text) of the "
                        f"'NAME{BUDGETED}' entries of --backends, e.g. mla{BUDGETED} (default 1.0)")
    p.add_argument("--out", default="reports/bench")
    p.add_argument("--windows", type=int, default=None,
                   help=f"1024-token windows of the eval slice scored through the cache path (20 = all; default "
                        f"{DEFAULT['windows']}, --quick {QUICK['windows']})")
    p.add_argument("--prefix", type=int, default=None,
                   help=f"tokens prefilled per window before scoring by decode (default {DEFAULT['prefix']})")
    p.add_argument("--prompts", type=int, default=None,
                   help=f"greedy-agreement prompts (default {DEFAULT['prompts']}, --quick {QUICK['prompts']})")
    p.add_argument("--new-tokens", type=int, default=None,
                   help=f"greedy tokens per prompt (default {DEFAULT['new_tokens']}, --quick {QUICK['new_tokens']})")
    p.add_argument("--stream-tokens", type=int, default=None,
                   help=f"tokens per stream for the tokens/s columns (default {DEFAULT['stream_tokens']})")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"speed rounds over all settings; speeds are medians over rounds (default "
                        f"{DEFAULT['rounds']}, --quick {QUICK['rounds']})")
    p.add_argument("--needle-context", type=int, default=0,
                   help=f"also score key retrieval at this many prompt tokens: a needle at depths "
                        f"{', '.join(f'{d:g}' for d in NEEDLE_DEPTHS)} of long filler text (bench.needle; "
                        f"default 0: off)")
    p.add_argument("--long-context", type=int, default=0,
                   help="also price every setting on one input of this many tokens, as the quality budget's long "
                        "price does (KV_QUALITY_LONG_CONTEXT): perplexity change implied by the KL from full and "
                        "top-1 agreement on its last 256 tokens, and 4 needles at chosen depths; at least the least "
                        "KV_QUALITY_LONG_CONTEXT takes and at most the model's positions (default 0: off)")


def command_line(args: argparse.Namespace) -> str:
    """The ``kvserve bench`` command that repeats this run: the model when it is not the default, the backends,
    and every scoring and speed size that differs from the mode's default."""
    parts = ["kvserve bench"] + (["--quick"] if args.quick else [])
    if Path(args.model).resolve() != (REPO / "models" / "kjv-llama-mha").resolve():
        parts.append(f"--model {args.model}")
    if args.backends:
        parts.append("--backends " + " ".join(args.backends))
    defaults = QUICK if args.quick else DEFAULT
    parts += [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in defaults if getattr(args, k) != defaults[k]]
    if getattr(args, "budget", 1.0) != 1.0:
        parts.append(f"--budget {args.budget:g}")
    if getattr(args, "needle_context", 0):
        parts.append(f"--needle-context {args.needle_context}")
    if getattr(args, "long_context", 0):
        parts.append(f"--long-context {args.long_context}")
    return " ".join(parts)
