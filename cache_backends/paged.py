"""Paged KV storage shared by every paged backend: what a page holds, one step's metadata, and the batched reads
of the stored form (a sequence's block tables and the planning of its pages, with no tensors, are
:mod:`cache_backends.page_plan`'s).

The pool (:class:`cache_backends.pool.KVPool`) is ``num_pages`` pages of ``page_bytes`` bytes. A backend
describes the per-token *streams* it keeps per layer (:class:`StreamSpec`: K and V for ``full``, the shared
heads for ``gqa``, a latent for ``mla``, the model's latent and rope key on native MLA) and whether they are
quantized (``int8`` options). :class:`PageLayout` carves a page into every layer's slab of every stream, in
one of two *tiers*:

* ``exact`` — ``exact_tokens`` tokens of every stream in the model dtype;
* ``q`` (quantized backends only) — ``q_tokens`` tokens as codes with their scales and zero points
  (keys per channel over groups of ``group_size`` tokens, values per token: KIVI, arXiv 2402.02750): int8
  codes, or two 4-bit codes a byte (``key_bits``/``value_bits`` = 4), Hadamard-rotated when ``rotate``
  (:mod:`cache_backends.int8`).

A sequence's tokens are its quantized tokens (``q`` pages, oldest first) followed by its exact tokens
(``exact`` pages, a FIFO): for a quantized backend the exact tokens are its full-precision residual window;
once ``residual + group_size`` tokens are exact, the oldest ``group_size`` are quantized into the ``q``
pages (the rule of :class:`cache_backends.int8.Int8Storage`, so the same tokens form the same groups
however the prompt was chunked) and exact pages that hold no live token go back to the pool after the
step. Pages are taken on demand (:meth:`PageLayout.plan`), so a sequence holds only the pages its tokens
need (PagedAttention, Kwon et al., arXiv 2309.06180).

One step (a prefill chunk of one sequence, or one decode token of many) is described once by a
:class:`StepMeta` (block tables, lengths, write and quantization slots, the attention mask, every cached
token's position), built from the tables before the forward; each layer then writes its new tokens with one
indexed copy per stream, quantizes the drained groups in one batched call, gathers the batch's pages into a
padded batch (:class:`StreamRead`) and attends in the stored form. No layer loops over sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cache_backends.estimate import scale_bytes
from cache_backends.page_plan import NULL_PAGE, Plan, SeqBlocks, TierPlan
from cache_backends.quant import (codes_dot, codes_weighted_sum, dequantize_codes, pack, quantize, rotate, scale_dtype,
                                  stream_bits)

ALIGN = 64  # bytes: every slab of a page starts at a multiple of this


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class StreamSpec:
    """One per-token stream a backend stores in every layer: ``(heads, width)`` per token.

    Attributes:
        heads: heads of the stream (num_key_value_heads for K/V, G for gqa, 1 for a latent).
        width: channels per head (head_dim, the latent rank, the rope key width).
        axis: how int8 groups its scales: ``"channel"`` (per channel over token groups: keys, latents) or
            ``"token"`` (per token and head: values).
    """

    heads: int
    width: int
    axis: str = "channel"


@dataclass
class Slab:
    """Where one tensor of one layer's stream sits in a page: ``offset`` bytes, laid out ``(heads, units, width)``
    (head-major, so that gathering a batch's pages gives ``(heads, batch, tokens, width)`` with no copy)."""

    offset: int
    units: int
    heads: int
    width: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.units * self.heads * self.width * self.dtype.itemsize


class PageLayout(TierPlan):
    """How one backend's streams fill a page of ``page_bytes`` bytes; its planning (:meth:`plan`, :meth:`pages_for`,
    ...) is :class:`cache_backends.page_plan.TierPlan`'s, on the tokens a page of each tier holds.

    Args:
        streams: the per-token streams of one layer.
        num_layers: decoder layers (every page holds its tokens for all of them).
        dtype: the model dtype (exact tokens, scales and zero points).
        page_bytes: bytes per page.
        quantize: ``None``, ``{"group_size": g, "residual": r}`` (a quantized tier with a residual window, with
            optional ``key_bits`` / ``value_bits`` (8 or 4: :func:`cache_backends.quant.stream_bits`) and
            ``rotate``), or ``{"group_size": g, "residual": None, "window": w}``: an int8 tier filled only on
            demand (:meth:`plan_compress`, ``elastic``), never by writes, the newest ``w`` tokens always exact.

    Raises:
        ValueError: if a page cannot hold one exact token, or one quantization group.
    """

    def __init__(self, streams: list[StreamSpec], num_layers: int, dtype: torch.dtype, page_bytes: int,
                 quantize: dict | None = None):
        self.streams, self.num_layers, self.dtype, self.page_bytes = streams, num_layers, dtype, page_bytes
        exact_tokens = self._fit(lambda t: self.exact_bytes(streams, num_layers, dtype, t), 1)
        q_tokens = 0
        if quantize:
            g = quantize["group_size"]
            q_tokens = self._fit(lambda t: self.q_bytes(streams, num_layers, dtype, quantize, t), g)
        super().__init__(exact_tokens, q_tokens, quantize)
        self.exact_slabs = self._slabs_exact(self.exact_tokens)
        if quantize:
            self.q_slabs = self._slabs_q(self.q_tokens)

    # ---- sizes ----------------------------------------------------------------------------------------
    @staticmethod
    def exact_bytes(streams, num_layers: int, dtype: torch.dtype, tokens: int) -> int:
        """Bytes of a page of ``tokens`` exact tokens (slabs aligned)."""
        e = dtype.itemsize
        return num_layers * sum(_align(tokens * s.heads * s.width * e) for s in streams)

    @staticmethod
    def q_bytes(streams, num_layers: int, dtype: torch.dtype, quantize: dict, tokens: int) -> int:
        """Bytes of a page of ``tokens`` quantized tokens (a multiple of ``group_size``) with scales and zeros
        (each stream's codes at its bits: :func:`cache_backends.quant.stream_bits`)."""
        e = dtype.itemsize
        group_size, total = quantize["group_size"], 0
        for s in streams:
            bits = stream_bits(quantize, s.axis)
            scales = (tokens // group_size) * s.heads * s.width if s.axis == "channel" else tokens * s.heads
            total += _align(tokens * s.heads * s.width * bits // 8) + 2 * _align(scales * scale_bytes(bits, e))
        return num_layers * total

    @classmethod
    def natural_page_bytes(cls, streams, num_layers: int, dtype: torch.dtype, block_size: int,
                           quantize: dict | None) -> int:
        """Bytes of one block of ``block_size`` tokens in this backend's stored form (rounded up to whole
        quantization groups; an on-demand tier: the exact block every token starts in): the page size a pool
        serving only this backend uses."""
        if quantize and quantize["residual"] is not None:
            g = quantize["group_size"]
            return cls.q_bytes(streams, num_layers, dtype, quantize, g * -(-block_size // g))
        return cls.exact_bytes(streams, num_layers, dtype, block_size)

    def _fit(self, size, step: int) -> int:
        """The most tokens (a multiple of ``step``) whose page fits ``page_bytes``."""
        if size(step) > self.page_bytes:
            raise ValueError(f"a KV page of {self.page_bytes} bytes cannot hold {step} token(s) of this backend")
        lo, hi = 1, max(1, self.page_bytes // step)  # in units of step; size() is monotone
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if size(mid * step) <= self.page_bytes else (lo, mid - 1)
        return lo * step

    def _slabs_exact(self, tokens: int) -> list[list[Slab]]:
        off, out = 0, []
        for _ in range(self.num_layers):
            row = []
            for s in self.streams:
                slab = Slab(off, tokens, s.heads, s.width, self.dtype)
                row.append(slab)
                off += _align(slab.nbytes)
            out.append(row)
        return out

    def _slabs_q(self, tokens: int) -> list[list[tuple[Slab, Slab, Slab]]]:
        g = self.quantize["group_size"]
        off, out = 0, []
        for _ in range(self.num_layers):
            row = []
            for s in self.streams:
                bits = stream_bits(self.quantize, s.axis)  # 4 bits: (width / 2) bytes, two codes each
                codes = Slab(off, tokens, s.heads, s.width * bits // 8, torch.int8 if bits == 8 else torch.uint8)
                off += _align(codes.nbytes)
                units, width = (tokens // g, s.width) if s.axis == "channel" else (tokens, 1)
                scale = Slab(off, units, s.heads, width, scale_dtype(bits, self.dtype))
                off += _align(scale.nbytes)
                zero = Slab(off, units, s.heads, width, scale_dtype(bits, self.dtype))
                off += _align(zero.nbytes)
                row.append((codes, scale, zero))
            out.append(row)
        return out

    @property
    def q_tier(self) -> str:
        """The quantized tier's name: ``int8``, ``int4``, or ``k8v4`` for 8-bit keys and 4-bit values."""
        kb, vb = stream_bits(self.quantize, "channel"), stream_bits(self.quantize, "token")
        return f"int{kb}" if kb == vb else f"k{kb}v{vb}"

    def used_bytes(self) -> int:
        """Bytes of a page this backend fills (its tokens' slabs; the rest of the page is unused); with an
        on-demand tier, the emptier of its two tiers."""
        if self.on_demand:
            return min(self.exact_bytes(self.streams, self.num_layers, self.dtype, self.exact_tokens),
                       self.q_bytes(self.streams, self.num_layers, self.dtype, self.quantize, self.q_tokens))
        if self.quantize:
            return self.q_bytes(self.streams, self.num_layers, self.dtype, self.quantize, self.q_tokens)
        return self.exact_bytes(self.streams, self.num_layers, self.dtype, self.exact_tokens)

    def tier_tokens(self, blocks: SeqBlocks) -> dict[str, int]:
        """Tokens ``blocks`` holds per tier (``exact``, and for a quantized layout ``int8``, ``int4`` or ``k8v4``)."""
        if self.quantize:
            return {"exact": blocks.exact_len, self.q_tier: blocks.q_len}
        return {"exact": blocks.exact_len}

    def stats(self, blocks: SeqBlocks) -> dict:
        """Backend figures of one sequence for ``/info`` and the metrics (none here)."""
        return {}

    def stored_bytes(self, blocks: SeqBlocks) -> int:
        """Bytes of the tokens ``blocks`` holds in their stored form (what the closed formulas count; the
        pages it holds are :meth:`SeqBlocks.pages` x ``page_bytes``)."""
        e = self.dtype.itemsize
        per_exact = sum(s.heads * s.width for s in self.streams) * e
        total = blocks.exact_len * per_exact
        if self.quantize and blocks.q_len:
            g, q = self.quantize["group_size"], blocks.q_len
            for s in self.streams:
                bits = stream_bits(self.quantize, s.axis)
                scales = (q // g) * s.heads * s.width if s.axis == "channel" else q * s.heads
                total += q * s.heads * s.width * bits // 8 + 2 * scales * scale_bytes(bits, e)
        return total * self.num_layers

class PoolViews:
    """Typed views of one backend's slabs into the pool's byte arena (no copies).

    Attributes:
        exact: ``exact[layer][stream]`` (heads, num_pages, exact_tokens, width), model dtype.
        q: ``q[layer][stream]`` = (codes, scale, zero) views, (heads, num_pages, units, width) each.
    """

    def __init__(self, arena: torch.Tensor, layout: PageLayout):
        def view(slab: Slab) -> torch.Tensor:
            typed = arena.view(slab.dtype)  # (num_pages, page_bytes / element_size)
            e = arena.shape[1] // typed.shape[1]
            n = slab.units * slab.heads * slab.width
            pages = typed[:, slab.offset // e : slab.offset // e + n].view(-1, slab.heads, slab.units * slab.width)
            view = pages.view(-1, slab.heads, slab.units, slab.width).transpose(0, 1)  # (heads, num_pages, units, w)
            view.runs = _RunRows(typed, slab.offset // e, slab.units * slab.width, slab.heads)
            return view

        self.layout = layout
        self.exact = [[view(s) for s in row] for row in layout.exact_slabs]
        self.q = [[tuple(view(s) for s in parts) for parts in row] for row in layout.q_slabs] if layout.quantize \
            else None


def quantized_before(positions: torch.Tensor, group_size: int, residual: int) -> torch.Tensor:
    """Tokens held as codes once the token at each of ``positions`` is cached: the whole groups of
    ``group_size`` that leave at least ``residual`` newer tokens exact (KIVI's residual window), same shape."""
    return ((positions + 1 - residual).clamp(min=0) // group_size) * group_size


def _pad_table(tables: list[list[int]]) -> list[list[int]]:
    width = max((len(t) for t in tables), default=0)
    return [t + [NULL_PAGE] * (width - len(t)) for t in tables]


class Drain:
    """Where the tokens one step (or one compression, :meth:`PageLayout.plan_compress`) quantizes come from and go.

    Args:
        layout: the backend's page layout.
        rows: each sequence's blocks (pages for the step already added) and its plan.
        device: where the index tensors go.

    Attributes:
        tokens: tokens quantized, over all rows (0: nothing to do).
        src, dst: ``(pages, slots)`` (N,) each: the exact slot each quantized token is read from, and its slot in
            the quantized tier.
        grp: ``(pages, group slots)`` (N / group_size,) of each new group's scales.
    """

    def __init__(self, layout: PageLayout, rows: list[tuple[SeqBlocks, Plan]], device):
        te, tq = layout.exact_tokens, layout.q_tokens
        g = layout.quantize["group_size"] if layout.quantize else 0
        sp, ss, dp, ds, gp, gs = ([] for _ in range(6))
        for blocks, plan in rows:
            for j in range(plan.drained):
                sp.append(blocks.exact[(blocks.start + j) // te])
                ss.append((blocks.start + j) % te)
                t = blocks.q_len + j
                dp.append(blocks.q[t // tq])
                ds.append(t % tq)
                if j % g == 0:
                    gp.append(blocks.q[t // tq])
                    gs.append((t % tq) // g)
        self.tokens = len(sp)
        if self.tokens:
            as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
            self.src, self.dst, self.grp = (as_long(sp), as_long(ss)), (as_long(dp), as_long(ds)), (as_long(gp),
                                                                                                     as_long(gs))


class StepMeta:
    """One step's metadata for the sequences of one backend, built once and read by every layer.

    Args:
        layout: the backend's page layout.
        rows: each sequence's blocks (pages for this step already added) and its plan, in batch order.
        device: where the index tensors go.

    Attributes (tensors, B = sequences, n = new tokens per sequence):
        write_pages, write_slots: (B * n,) exact page and slot of each new token, row-major.
        drain: the tokens quantized this step (:class:`Drain`).
        exact_table (B, Pe) and q_table (B, Pq): page tables, padded with the null page.
        positions: (B, Tq + Te) position of every gathered token (q pages first, then exact pages).
        gather_index: the row indices of the page gathers (:class:`_RunRows`), filled by the first layer.
        query_positions: (B, n) positions of the new tokens.
        mask: (B, n, Tq + Te) bool, True where a new token attends to a cached token (causal, live only).

    Quantized layouts: the new token at position ``p`` reads the tokens before ``quantized_before(p)`` as codes
    and the later ones exact, as it would decoding alone (the drained tokens' exact slots are still in their
    pages during the step). So every token's K/V, and hence every group's codes, are a function of the tokens
    before it only, however the prompt was chunked. (After a prefix-cache hit the hit's tokens exist only as
    codes, and are read so.)
    """

    def __init__(self, layout: PageLayout, rows: list[tuple[SeqBlocks, Plan]], device,
                 exact_rows: list[bool] | None = None):
        te, tq = layout.exact_tokens, layout.q_tokens
        n = rows[0][1].n
        wp, ws = [], []
        qpos, q_lens, starts, e_lens = [], [], [], []
        g = layout.quantize["group_size"] if layout.quantize else 0
        for blocks, plan in rows:
            if plan.n != n:
                raise ValueError("every sequence of a step writes the same number of tokens")
            base = blocks.start + blocks.exact_len
            for j in range(n):
                wp.append(blocks.exact[(base + j) // te])
                ws.append((base + j) % te)
            qpos.append([blocks.tokens + j for j in range(n)])
            q_lens.append(blocks.q_len + plan.drained)
            starts.append(blocks.start + plan.drained)
            e_lens.append(blocks.exact_len + n - plan.drained)
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        self.n, self.batch = n, len(rows)
        self.write_pages, self.write_slots = as_long(wp), as_long(ws)
        self.drain = Drain(layout, rows, device)
        self.exact_table = as_long(_pad_table([b.exact for b, _ in rows]))
        q_tables = _pad_table([b.q for b, _ in rows]) if layout.quantize else [[] for _ in rows]
        self.q_table = as_long(q_tables)
        t_q, t_e = self.q_table.shape[1] * tq, self.exact_table.shape[1] * te
        q_len, start, e_len = as_long(q_lens), as_long(starts), as_long(e_lens)
        iq, ie = torch.arange(t_q, device=device), torch.arange(t_e, device=device)
        pos_q = iq.expand(len(rows), t_q)
        pos_e = q_len[:, None] + ie[None] - start[:, None]
        self.positions = torch.cat([pos_q, pos_e], dim=1)  # (B, Tq + Te)
        self.query_positions = as_long(qpos)  # (B, n), from each row's first token until the end
        causal = self.positions[:, None, :] <= self.query_positions[:, :, None]  # (B, n, T)
        if layout.quantize and not (exact_rows and all(exact_rows)):
            old_start = as_long([b.start for b, _ in rows])
            # tokens held only as codes are read as codes (after a prefix-cache hit: the hit's whole pages; an
            # on-demand tier: every quantized token)
            split = as_long([b.q_len for b, _ in rows])[:, None].expand_as(self.query_positions)
            if not layout.on_demand:
                rule = quantized_before(self.query_positions, g, layout.quantize["residual"])
                if exact_rows and any(exact_rows):  # rows read exact (dca: a candidate's prefill, a reuse window)
                    rule = rule.masked_fill(as_long(exact_rows).bool()[:, None], 0)
                split = torch.maximum(rule, split)
            split = split[:, :, None]  # (B, n, 1)
            quantized = iq[None, None] < split
            exact = (ie[None] >= old_start[:, None])[:, None] & (pos_e[:, None] >= split)
            self.mask = torch.cat([quantized, exact], dim=2) & causal
        else:
            live = (ie[None] >= start[:, None]) & (pos_e < (q_len + e_len)[:, None])
            self.mask = live[:, None, :] & causal
        firsts = [b.first for b, _ in rows]
        if any(firsts):  # positions above were counted from each row's first token (a dca layer's own tokens)
            first = as_long(firsts)[:, None]
            self.positions, self.query_positions = self.positions + first, self.query_positions + first
        self.q_width = t_q
        self.gather_index: dict = {}  # the page gathers' row indices, built by the first layer that reads them


class StreamRead:
    """One layer's stream for a step's batch, gathered from the pool into a padded batch (stored form), heads
    first: every method takes and returns ``(heads, B, ...)`` tensors.

    Attributes:
        exact: (heads, B, Te, width) in the model dtype.
        codes, scale, zero: the quantized tier (heads, B, Tq, width) int8, or (heads, B, Tq, width / 2) uint8 at
            4 bits, and its scales; or ``None``.
        bits, rotate: the codes' width, and whether they hold Hadamard-rotated tokens (the query is rotated
            once to score them, their weighted sum un-rotated once).
    """

    def __init__(self, exact: torch.Tensor, q: tuple | None, axis: str, group_size: int, bits: int = 8,
                 rotate: bool = False):
        self.exact = exact
        self.codes, self.scale, self.zero = q if q is not None else (None, None, None)
        self.axis, self.group_size, self.bits, self.rotate = axis, group_size, bits, rotate

    def dot(self, query: torch.Tensor) -> torch.Tensor:
        """Scores of every gathered token against ``query`` (heads, B, R, width) → (heads, B, R, Tq + Te)."""
        exact = query @ self.exact.transpose(-1, -2)
        if self.codes is None or self.codes.shape[-2] == 0:
            return exact
        quant = codes_dot(rotate(query) if self.rotate else query, self.codes, self.scale, self.zero, self.axis,
                          self.group_size, self.bits)
        return torch.cat([quant, exact], dim=-1)

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        """``weights`` (heads, B, R, Tq + Te) times every gathered token → (heads, B, R, width)."""
        if self.codes is None or self.codes.shape[-2] == 0:
            return weights @ self.exact
        tq = self.codes.shape[-2]
        quant = codes_weighted_sum(weights[..., :tq], self.codes, self.scale, self.zero, self.axis, self.group_size,
                                   self.bits)
        return (rotate(quant) if self.rotate else quant) + weights[..., tq:] @ self.exact

    def read(self) -> torch.Tensor:
        """Every gathered token dequantized (and un-rotated), (heads, B, Tq + Te, width) (transient)."""
        if self.codes is None or self.codes.shape[-2] == 0:
            return self.exact
        old = dequantize_codes(self.codes, self.scale, self.zero, self.axis, self.group_size, self.bits,
                               self.exact.dtype)
        return torch.cat([rotate(old) if self.rotate else old, self.exact], dim=-2)


class _RunRows:
    """One slab's runs as rows of a single 2-D view of the arena, so that one ``index_select`` gathers every head
    of every page a step reads.

    A head's ``units x width`` block of a page (its run) is contiguous. Every run starts at ``offset + page *
    page_elems + head * run`` elements of the typed arena, a multiple of ``stride = gcd(page_elems, run)`` past
    ``offset``; so the arena seen as overlapping rows of ``run`` elements, ``stride`` apart, holds each run as
    one row: run (head, page) is row ``head * head_rows + page * page_rows``.

    Args:
        typed: (num_pages, page_elems) the arena in the slab's dtype.
        offset: the slab's first element in a page.
        run: elements of one head's block in a page (units x width).
        heads: the slab's heads.
    """

    def __init__(self, typed: torch.Tensor, offset: int, run: int, heads: int):
        page_elems = typed.shape[1]
        self.heads = heads
        stride = math.gcd(page_elems, run)
        flat = typed.view(-1)
        self.rows = flat.as_strided(((flat.numel() - offset - run) // stride + 1, run), (stride, 1), offset)
        self.head_rows, self.page_rows = run // stride, page_elems // stride

    def index(self, table: torch.Tensor, cache: dict) -> torch.Tensor:
        """Rows of ``table`` (B, P)'s pages, heads first: (heads * B * P,); computed once per table and shape of
        slab (``cache``: the step's)."""
        key = (id(table), self.heads, self.head_rows, self.page_rows)
        if key not in cache:
            head = torch.arange(self.heads, device=table.device)[:, None] * self.head_rows
            cache[key] = (head + table.reshape(1, -1) * self.page_rows).reshape(-1)
        return cache[key]


def _gather(view: torch.Tensor, table: torch.Tensor, cache: dict) -> torch.Tensor:
    """(heads, num_pages, units, width) pages at ``table`` (B, P) → (heads, B, P * units, width), contiguous.

    One ``index_select`` of whole runs (a head's ``units x width`` block of a page, :class:`_RunRows`) for every
    head and page: the context is copied once, straight into the heads-first layout the matmuls read, in one op
    whatever the heads and the batch (one op per head, as before, cost 8x the ops on the reference model for
    the same bytes; indexing the head-first view at once is 4x slower on the CPU, a page gather followed by a
    transpose 3x). ``cache``: the step's gather indices (:attr:`StepMeta.gather_index`)."""
    b, p = table.shape
    h, _, units, w = view.shape
    rows = view.runs
    return torch.index_select(rows.rows, 0, rows.index(table, cache)).view(h, b, p * units, w)


def write_layer(views: PoolViews, layer: int, meta: StepMeta, new: list[torch.Tensor]) -> None:
    """Write one layer's new tokens of every stream, then quantize the groups this step drains.

    Args:
        new: per stream, (B, heads, n, width) in batch order.
    """
    for s, x in enumerate(new):
        pool = views.exact[layer][s]
        h, w = x.shape[1], x.shape[-1]
        pool[:, meta.write_pages, meta.write_slots] = x.transpose(0, 1).reshape(h, -1, w).to(pool.dtype)  # (h, B*n, w)
    drain_layer(views, layer, meta.drain)


def drain_sources(views: PoolViews, layer: int, drain: Drain) -> list[torch.Tensor]:
    """The exact tokens ``drain`` quantizes in ``layer``, one (heads, N, width) copy per stream (none if none)."""
    if not drain.tokens:
        return []
    return [views.exact[layer][s][:, drain.src[0], drain.src[1]] for s in range(len(views.layout.streams))]


def drain_layer(views: PoolViews, layer: int, drain: Drain, sources: list[torch.Tensor] | None = None) -> None:
    """Quantize the exact tokens ``drain`` names into their quantized slots, in one batched call per stream (their
    exact slots are left as they are: the caller frees the pages no live token uses any more). ``sources``: those
    tokens already read (:func:`drain_sources`), when a destination page may be one they are read from."""
    if not drain.tokens:
        return
    layout = views.layout
    g, rotated = layout.quantize["group_size"], layout.quantize.get("rotate")
    sources = sources if sources is not None else drain_sources(views, layer, drain)
    for s, spec in enumerate(layout.streams):
        src = sources[s]  # (heads, N, width), N = groups * g
        src = rotate(src) if rotated else src
        bits = stream_bits(layout.quantize, spec.axis)
        codes_v, scale_v, zero_v = views.q[layer][s]
        dst, grp = (slice(None), *drain.dst), (slice(None), *drain.grp)
        if spec.axis == "channel":
            q, scale, zero = quantize(src.reshape(spec.heads, -1, g, spec.width), 2, bits)  # per head, group, channel
            codes_v[dst] = pack(q.reshape(src.shape), bits)  # (heads, N, width) int8 or (heads, N, width / 2) uint8
            scale_v[grp] = scale[:, :, 0]
            zero_v[grp] = zero[:, :, 0]
        else:
            q, scale, zero = quantize(src, -1, bits)  # per head and token
            codes_v[dst] = pack(q, bits)
            scale_v[dst] = scale
            zero_v[dst] = zero


def read_layer(views: PoolViews, layer: int, meta: StepMeta) -> list[StreamRead]:
    """Every stream of ``layer`` for the step's batch, gathered in its stored form."""
    layout = views.layout
    g = layout.quantize["group_size"] if layout.quantize else 0
    out = []
    for s, spec in enumerate(layout.streams):
        exact = _gather(views.exact[layer][s], meta.exact_table, meta.gather_index)
        q = None
        if layout.quantize and meta.q_width:
            q = tuple(_gather(v, meta.q_table, meta.gather_index) for v in views.q[layer][s])
        bits = stream_bits(layout.quantize, spec.axis) if layout.quantize else 8
        out.append(StreamRead(exact, q, spec.axis, g, bits, bool(layout.quantize and layout.quantize.get("rotate"))))
    return out


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """Softmax of ``scores * scaling`` over the last axis where ``mask`` is True (0 elsewhere)."""
    return torch.softmax((scores * scaling).masked_fill(~mask, float("-inf")), dim=-1)


def grouped_rows(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, Hq, R, d) queries → (B, kv_heads, rep * R, d): each K/V head's query heads together."""
    b, hq, r, d = query.shape
    return query.reshape(b, kv_heads, (hq // kv_heads) * r, d)


def ungroup_rows(out: torch.Tensor, hq: int) -> torch.Tensor:
    """Inverse of :func:`grouped_rows`: (B, kv_heads, rep * R, d) → (B, Hq, R, d)."""
    b, h, rows, d = out.shape
    return out.reshape(b, hq, rows * h // hq, d)


def group_mask(mask: torch.Tensor, rep: int) -> torch.Tensor:
    """(B, R, T) step mask → (B, 1, rep * R, T), rows ordered as :func:`grouped_rows` orders them."""
    b, r, t = mask.shape
    return mask[:, None].expand(b, rep, r, t).reshape(b, 1, rep * r, t)


def attend_pair(query: torch.Tensor, keys: StreamRead, values: StreamRead, meta: StepMeta,
                scaling: float) -> torch.Tensor:
    """Attention of a step's queries over a key stream and a value stream in their stored form.

    Exact streams go through ``scaled_dot_product_attention`` with the step's mask; quantized tiers are scored on
    their codes (scales and rotation folded into the query and the weights; no dequantized copy of the context).

    Args:
        query: (B, Hq, R, d) after RoPE; Hq a multiple of the streams' heads H.

    Returns:
        (B, Hq, R, dv).
    """
    hq, h = query.shape[1], keys.exact.shape[0]
    rep = hq // h
    q = grouped_rows(query, h).transpose(0, 1)  # (H, B, rep * R, d): the gathered streams' order
    mask = group_mask(meta.mask, rep).transpose(0, 1)  # (1, B, rep * R, T)
    if keys.codes is None and values.codes is None:
        out = torch.nn.functional.scaled_dot_product_attention(q, keys.exact, values.exact, attn_mask=mask,
                                                               scale=scaling)
    else:
        probs = masked_softmax(keys.dot(q), mask, scaling)
        out = values.weighted_sum(probs)
    return ungroup_rows(out.transpose(0, 1), hq)
