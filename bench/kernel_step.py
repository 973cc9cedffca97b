"""The attention kernel alone: one step's attention (``torch.ops.kvserve.paged_attention`` over every layer) of
rows at a long context, a decode or a prefill chunk, per stored form, the forms timed in turn so that a drifting machine moves them alike.

    python -m bench.kernel_step --context 8000 --tiers exact int8 int4 --threads 1
    python -m bench.kernel_step --context 2000 8000 --tiers exact int4 int4-rotated --exact-sums

Shapes are SmolLM2-135M's by default (30 layers, 3 KV heads, 9 query heads, head_dim 64, pages of 16 tokens); the
K/V are random (the kernel's speed does not depend on the values). Prints per form the median time of a step's
layers, its ratio to ``exact``, and the ratio of the bytes it reads (the byte bound).

``--form latent`` times a native-MLA model's absorbed attention instead (its latent and rope key in exact pages, or
with ``--tiers int8 int4`` quantized per channel as ``mla+int8`` / ``mla+int4`` store them), the kernel reading the
pages in place against the torch path (the pages gathered, then torch ops), interleaved; DeepSeek-V2-Lite's widths
by default (kv_lora_rank 512, rope key 64, 16 query heads of 128 + 64, values of 128):

    python -m bench.kernel_step --form latent --context 2000 8000 --layers 4 --dtype bfloat16
    python -m bench.kernel_step --form latent --tiers int8 int4 --context 2000 8000 --layers 4

``--form posthoc`` times ``mla``'s post-hoc latent on an MHA/GQA model (SmolLM2-135M's shapes, a random orthonormal
basis of ``--rank``, exact pages or ``--tiers int8 int4``): the op rebuilding each KV head's keys block by block
inside it against the torch path (the latent gathered, keys rebuilt as one matmul, RoPE, then torch attention),
interleaved, the value side (absorbed) in both:

    python -m bench.kernel_step --form posthoc --rank 48 336 --context 2000 8000 --layers 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cache_backends import kernels
from cache_backends.absorbed_mla import absorbed_attention
from cache_backends.kv_spec import KVSpec, Quantization, StreamSpec, kv_streams
from cache_backends.page_layout import PageLayout
from cache_backends.page_plan import SeqBlocks
from cache_backends.paged import in_place_layer, read_layer, write_layer
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
            write_layer(self.views, layer, meta, self.new_tokens(len(rows), n))
        return meta

    def new_tokens(self, batch: int, n: int) -> list[torch.Tensor]:
        """One layer's random new K and V, (batch, heads, n, width) each."""
        return [torch.randn(batch, self.heads, n, self.width, generator=self.gen).to(self.dtype) for _ in range(2)]

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


class LatentRow(Row):
    """``batch`` sequences of a native-MLA model's entries (latent ``rank`` wide, rope key ``rope`` wide, one head
    each, exact pages or ``tier``'s codes), ``context`` tokens each, and a random ``kv_b_proj`` of ``q_heads`` heads."""

    def __init__(self, layers: int, rank: int, rope: int, q_heads: int, nope: int, v: int, context: int,
                 tokens_per_page: int, batch: int = 1, chunk: int = 1, dtype: torch.dtype = torch.float32,
                 seed: int = 0, tier: str = "exact"):
        from types import SimpleNamespace

        spec = KVSpec((StreamSpec(1, rank), StreamSpec(1, rope)), layers, dtype.itemsize, TIERS[tier])
        self.widths, self.gen = (rank, rope), torch.Generator().manual_seed(seed)
        weight = (torch.randn(q_heads * (nope + v), rank, generator=self.gen) * rank ** -0.5).to(dtype)
        self.module = SimpleNamespace(qk_nope_head_dim=nope, v_head_dim=v, kv_b_proj=SimpleNamespace(weight=weight))
        self.q_shape = (batch, q_heads, chunk, nope + rope)
        self._fill(spec, dtype, tokens_per_page, batch, context, chunk)

    def _fill(self, spec: KVSpec, dtype: torch.dtype, tokens_per_page: int, batch: int, context: int,
              chunk: int) -> None:
        """A pool of ``spec``'s pages (a quantized tier's: whole groups, as served) holding ``batch`` rows of
        ``context`` random tokens, and the metadata of their next step of ``chunk`` tokens each."""
        self.layout = PageLayout(spec, dtype, -(-spec.block_bytes(tokens_per_page) // 64) * 64)
        per_page = min(t for t in (self.layout.exact_tokens, self.layout.q_tokens) if t)
        pages = batch * ((context + chunk) // per_page + 8) + 8
        self.pool = KVPool(pages, self.layout.page_bytes, {"b": self.layout}, "cpu")
        self.views = self.pool.views["b"]
        self.layers, self.dtype, self.batch, self.chunk = spec.num_layers, dtype, batch, chunk
        self.free = list(range(1, pages))
        rows = [SeqBlocks() for _ in range(batch)]
        for blocks in rows:
            for n in [min(512, context - t) for t in range(0, context, 512)]:
                self._write([blocks], n)
                self._commit()
        self.meta = self._write(rows, chunk)
        self.bytes = sum(self.layout.stored_bytes(b) for b in rows)

    def path_step(self, mode: str, attend) -> float:
        """Seconds of one step's ``attend(layer, reads)`` over every layer: ``kernel`` reads the pages in place,
        ``torch`` gathers them (as the torch path's step does)."""
        with kernels.using(mode):
            t = time.perf_counter()
            for layer in range(self.layers):
                reads = in_place_layer(self.views, layer) if mode == "kernel" else \
                    read_layer(self.views, layer, self.meta)
                attend(layer, reads)
            return time.perf_counter() - t

    def new_tokens(self, batch: int, n: int) -> list[torch.Tensor]:
        """One layer's random new latent and rope key, (batch, 1, n, width) each."""
        return [torch.randn(batch, 1, n, w, generator=self.gen).to(self.dtype) for w in self.widths]

    def latent_step(self, mode: str) -> float:
        """Seconds of one step's absorbed attention over every layer (:meth:`path_step`)."""
        query = torch.randn(*self.q_shape).to(self.dtype)
        scaling = self.q_shape[-1] ** -0.5
        return self.path_step(mode, lambda layer, reads: absorbed_attention(query, reads[0], reads[1], self.meta,
                                                                            scaling, self.module))


class PosthocRow(LatentRow):
    """``batch`` sequences of ``mla``'s post-hoc latent (one head, ``rank`` wide, exact pages or ``tier``'s codes),
    ``context`` tokens each, served by an :class:`cache_backends.mla.MLABackend` of random orthonormal bases."""

    def __init__(self, layers: int, heads: int, rep: int, head_dim: int, rank: int, context: int,
                 tokens_per_page: int, batch: int = 1, chunk: int = 1, dtype: torch.dtype = torch.float32,
                 seed: int = 0, tier: str = "exact"):
        from cache_backends.geometry import ModelGeometry
        from cache_backends.mla.backend import LatentBasis, MLABackend
        from cache_backends.rope import RopeTable

        self.gen = torch.Generator().manual_seed(seed)
        geometry = ModelGeometry(layers, heads * rep, heads, head_dim, dtype.itemsize)
        self.backend = MLABackend(geometry, rank=rank, quantization=TIERS[tier])
        width = 2 * heads * head_dim
        self.backend.bases = [LatentBasis(torch.linalg.qr(torch.randn(width, rank, generator=self.gen))[0],
                                          0.3 * torch.randn(width, generator=self.gen)) for _ in range(layers)]
        self.backend.rope = RopeTable.llama(head_dim, context + chunk + 64, dtype=dtype)
        self.rank, self.q_shape = rank, (batch, heads * rep, chunk, head_dim)
        self._fill(self.backend.kv_spec(), dtype, tokens_per_page, batch, context, chunk)

    def new_tokens(self, batch: int, n: int) -> list[torch.Tensor]:
        """One layer's random new latents, (batch, 1, n, rank)."""
        return [(3 * torch.randn(batch, 1, n, self.rank, generator=self.gen)).to(self.dtype)]

    def posthoc_step(self, mode: str) -> float:
        """Seconds of one step's attention over every layer (:meth:`MLABackend.attend_paged`, :meth:`path_step`)."""
        query = torch.randn(*self.q_shape).to(self.dtype)
        scaling = self.q_shape[-1] ** -0.5
        return self.path_step(mode, lambda layer, reads: self.backend.attend_paged(layer, query, reads, self.meta,
                                                                                   scaling))


def kernel_vs_torch(step, rounds: int) -> tuple[float, float]:
    """Median seconds of ``step(mode)`` with the kernel and with the torch path, taking turns ``rounds`` times."""
    times = {"kernel": [], "torch": []}
    for _ in range(rounds):
        for mode in times:
            times[mode].append(step(mode))
    return statistics.median(times["kernel"]), statistics.median(times["torch"])


def posthoc_main(args) -> int:
    """``--form posthoc``: the kernel against the torch path, per tier, rank and context, interleaved."""
    dtype = getattr(torch, args.dtype)
    print(f"post-hoc mla latent: {args.batch} row(s) + {args.chunk} new, {args.layers} layers, {args.heads}x{args.rep} "
          f"heads of {args.head_dim}, {args.dtype}, {args.threads} thread(s), median of {args.rounds}")
    print(f"{'form':<10}{'rank':>6}{'context':>8}{'kernel ms':>11}{'torch ms':>10}{'torch/kernel':>14}")
    for tier in args.tiers or ["exact"]:
        for rank in args.rank:
            for context in args.context:
                row = PosthocRow(args.layers, args.heads, args.rep, args.head_dim, rank, context, args.page_tokens,
                                 args.batch, args.chunk, dtype, tier=tier)
                k, t = kernel_vs_torch(row.posthoc_step, args.rounds)
                print(f"{tier:<10}{rank:>6}{context:>8}{k * 1e3:>11.2f}{t * 1e3:>10.2f}{t / k:>14.2f}")
    return 0


def latent_main(args) -> int:
    """``--form latent``: the kernel against the torch path, per context, interleaved."""
    dtype = getattr(torch, args.dtype)
    print(f"native-MLA latent: {args.batch} row(s) + {args.chunk} new, {args.layers} layers, r {args.rank}, rope "
          f"{args.rope}, {args.q_heads} query heads (nope {args.nope}, v {args.v_dim}), {args.dtype}, "
          f"{args.threads} thread(s), median of {args.rounds}")
    print(f"{'form':<14}{'context':>8}{'kernel ms':>11}{'torch ms':>10}{'torch/kernel':>14}")
    for tier in args.tiers or ["exact"]:
        for context in args.context:
            row = LatentRow(args.layers, args.rank, args.rope, args.q_heads, args.nope, args.v_dim, context,
                            args.page_tokens, args.batch, args.chunk, dtype, tier=tier)
            k, t = kernel_vs_torch(row.latent_step, args.rounds)
            print(f"{tier:<14}{context:>8}{k * 1e3:>11.2f}{t * 1e3:>10.2f}{t / k:>14.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kernel_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--form", choices=["kv", "latent", "posthoc"], default="kv",
                   help="kv: K/V pairs per --tiers; latent: a native-MLA model's latent, the kernel vs torch; "
                        "posthoc: mla's post-hoc latent, the kernel vs torch")
    p.add_argument("--context", type=int, nargs="+", default=[8000])
    p.add_argument("--tiers", nargs="+", choices=list(TIERS),
                   help="stored forms (default: exact int8 int4; latent: exact)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=3, help="KV heads")
    p.add_argument("--rep", type=int, default=3, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=1, help="rows decoded in the step, each --context tokens long")
    p.add_argument("--chunk", type=int, default=1, help="new tokens a row (1: a decode step; more: a prefill chunk)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--rank", type=int, nargs="+", default=None,
                   help="latent: kv_lora_rank (default 512); posthoc: the latent's ranks (default 48)")
    p.add_argument("--rope", type=int, default=64, help="latent: qk_rope_head_dim")
    p.add_argument("--q-heads", type=int, default=16, help="latent: query heads")
    p.add_argument("--nope", type=int, default=128, help="latent: qk_nope_head_dim")
    p.add_argument("--v-dim", type=int, default=128, help="latent: v_head_dim")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="latent, posthoc: pages")
    p.add_argument("--exact-sums", action="store_true",
                   help="kv: time each tier with 4-bit keys also with fp32 sums (KVSERVE_KERNEL_EXACT_SUMS=1)")
    args = p.parse_args(argv)
    if not kernels.load():
        raise SystemExit(f"the attention kernel is not available: {kernels.status()['reason']}")
    torch.set_num_threads(args.threads)
    if args.form == "latent":
        args.rank = (args.rank or [512])[0]
        return latent_main(args)
    if args.form == "posthoc":
        args.rank = args.rank or [48]
        return posthoc_main(args)
    args.tiers = args.tiers or ["exact", "int8", "int4"]
    for context in args.context:
        kv_main(args, context)
    return 0


def kv_main(args, context: int) -> None:
    """``--form kv`` at one context: each tier's step (and with ``--exact-sums`` each 4-bit-key tier's again with
    fp32 sums, ``KVSERVE_KERNEL_EXACT_SUMS=1``), timed in turn."""
    runs = [(t, False) for t in args.tiers]
    if args.exact_sums:
        runs += [(t, True) for t in args.tiers if TIERS[t] is not None and TIERS[t].key_bits == 4]
    rows = {t: Row(t, args.layers, args.heads, args.head_dim, context, args.page_tokens, args.batch, args.chunk)
            for t in args.tiers}
    times: dict[tuple[str, bool], list[float]] = {r: [] for r in runs}
    with kernels.using("kernel"):
        for _ in range(args.rounds):
            for t, exact in runs:
                with kernels.exact_sums(exact):
                    times[(t, exact)].append(rows[t].step(args.rep))
    base = statistics.median(times[runs[0]])
    print(f"{args.batch} row(s) of {context} tokens + {args.chunk} new, {args.layers} layers, "
          f"{args.heads}x{args.rep} heads, head_dim {args.head_dim}, {args.threads} thread(s), median of {args.rounds}")
    print(f"{'form':<24}{'ms/step':>10}{'vs ' + args.tiers[0]:>12}{'bytes vs':>10}")
    for t, exact in runs:
        med = statistics.median(times[(t, exact)])
        label = f"{t} (fp32 sums)" if exact else t
        print(f"{label:<24}{med * 1e3:>10.2f}{med / base:>12.2f}{rows[t].bytes / rows[args.tiers[0]].bytes:>10.2f}")

if __name__ == "__main__":
    raise SystemExit(main())
