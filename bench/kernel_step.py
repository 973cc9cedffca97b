"""The attention kernel alone: one step's attention (``torch.ops.kvserve.paged_attention`` over every layer) of
rows at a long context, a decode or a prefill chunk, per stored form, the forms timed in turn so that a drifting machine moves them alike.

    python -m bench.kernel_step --context 8000 --tiers exact int8 int4 --threads 1

Shapes are SmolLM2-135M's by default (30 layers, 3 KV heads, 9 query heads, head_dim 64, pages of 16 tokens); the
K/V are random (the kernel's speed does not depend on the values). Prints per form the median time of a step's
layers, its ratio to ``exact``, and the ratio of the bytes it reads (the byte bound).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cache_backends import kernels
from cache_backends.kv_spec import KVSpec, Quantization, kv_streams
from cache_backends.page_layout import PageLayout
from cache_backends.page_plan import SeqBlocks
from cache_backends.paged import in_place_layer, write_layer
from cache_backends.paged_attention import attend_pair
from cache_backends.pool import KVPool
from cache_backends.step_meta import StepMeta

TIERS = {
    "exact": None,
    "int8": Quantization(32, 32),
    "int4": Quantization(32, 32, 4, 4),
    "int4-rotated": Quantization(32, 32, 4, 4, rotate=True),
    "k8v4": Quantization(32, 32, 8, 4),
}


class Row:
    """``batch`` sequences of ``context`` random tokens each, written through the serving path's planning into a pool
    of ``layers`` layers of one stored form, and the metadata of their next decode step."""

    def __init__(self, tier: str, layers: int, heads: int, width: int, context: int, tokens_per_page: int,
                 batch: int = 1, chunk: int = 1, dtype: torch.dtype = torch.float32, seed: int = 0):
        spec = KVSpec(tuple(kv_streams(heads, width)), layers, dtype.itemsize, TIERS[tier])
        page = -(-spec.exact_bytes(tokens_per_page, aligned=True) // 64) * 64
        self.layout = PageLayout(spec, dtype, page)
        pages = batch * 2 * (context // tokens_per_page + 8) + 8
        self.pool = KVPool(pages, self.layout.page_bytes, {"b": self.layout}, "cpu")
        self.views = self.pool.views["b"]
        self.layers, self.heads, self.width, self.dtype, self.batch = layers, heads, width, dtype, batch
        self.gen = torch.Generator().manual_seed(seed)
        self.free = list(range(1, pages))
        rows = [SeqBlocks() for _ in range(batch)]
        for blocks in rows:
            for n in [min(512, context - t) for t in range(0, context, 512)]:
                self._write([blocks], n)
                self._commit()
        self.meta = self._write(rows, chunk)  # the step, written, not committed: attended as the engine would
        self.chunk = chunk
        self.bytes = sum(self.layout.stored_bytes(b) for b in rows)

    def _write(self, rows: list[SeqBlocks], n: int) -> StepMeta:
        """Plan, extend and write ``n`` random tokens into each of ``rows`` (one step); :meth:`_commit` applies it."""
        self.pending = []
        for blocks in rows:
            plan = self.layout.plan(blocks, n)
            got = [self.free.pop() for _ in range(plan.pages_needed)]
            self.layout.extend(blocks, plan, got[: plan.new_exact_pages], got[plan.new_exact_pages:])
            self.pending.append((blocks, plan))
        meta = StepMeta(self.layout, self.pending, "cpu")
        for layer in range(self.layers):
            write_layer(self.views, layer, meta, [torch.randn(len(rows), self.heads, n, self.width,
                                                              generator=self.gen).to(self.dtype) for _ in range(2)])
        return meta

    def _commit(self) -> None:
        for blocks, plan in self.pending:
            self.free.extend(self.layout.commit(blocks, plan))

    def step(self, rep: int) -> float:
        """Seconds of one step's attention over every layer (a decode, or a prefill chunk of ``chunk`` tokens)."""
        query = torch.randn(self.batch, self.heads * rep, self.chunk, self.width).to(self.dtype)
        reads = [in_place_layer(self.views, layer) for layer in range(self.layers)]
        t = time.perf_counter()
        for layer in range(self.layers):
            attend_pair(query, *reads[layer], self.meta, self.width ** -0.5)
        return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--tiers", nargs="+", default=["exact", "int8", "int4"], choices=list(TIERS))
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=3, help="KV heads")
    p.add_argument("--rep", type=int, default=3, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=1, help="rows decoded in the step, each --context tokens long")
    p.add_argument("--chunk", type=int, default=1, help="new tokens a row (1: a decode step; more: a prefill chunk)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    if not kernels.load():
        raise SystemExit(f"the attention kernel is not available: {kernels.status()['reason']}")
    torch.set_num_threads(args.threads)
    rows = {t: Row(t, args.layers, args.heads, args.head_dim, args.context, args.page_tokens, args.batch,
                   args.chunk)
            for t in args.tiers}
    times: dict[str, list[float]] = {t: [] for t in args.tiers}
    with kernels.using("kernel"):
        for _ in range(args.rounds):
            for t, row in rows.items():
                times[t].append(row.step(args.rep))
    base = statistics.median(times[args.tiers[0]])
    print(f"{args.batch} row(s) of {args.context} tokens + {args.chunk} new, {args.layers} layers, "
          f"{args.heads}x{args.rep} heads, head_dim {args.head_dim}, {args.threads} thread(s), median of {args.rounds}")
    print(f"{'form':<14}{'ms/step':>10}{'vs ' + args.tiers[0]:>12}{'bytes vs':>10}")
    for t, row in rows.items():
        med = statistics.median(times[t])
        print(f"{t:<14}{med * 1e3:>10.2f}{med / base:>12.2f}{row.bytes / rows[args.tiers[0]].bytes:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
