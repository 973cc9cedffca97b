"""Typed views of the pool's arena and the batched writes and reads of every paged backend: a step's new tokens
written with one indexed copy per stream, the groups it drains quantized in one batched call per stream, and the
batch's pages gathered into a padded batch in their stored form (:class:`StreamRead`, scored and summed on the
codes). What a page holds is :mod:`cache_backends.page_layout`'s, a step's metadata :mod:`cache_backends.step_meta`'s,
the attention over the reads :mod:`cache_backends.paged_attention`'s. No layer loops over sequences.
"""

from __future__ import annotations

import math

import torch

from cache_backends import kernels
from cache_backends.page_layout import PageLayout, Slab
from cache_backends.quant import codes_dot, codes_weighted_sum, dequantize_codes, pack, quantize, rotate
from cache_backends.step_meta import Drain, StepMeta

class PoolViews:
    """Typed views of one backend's slabs into the pool's byte arena (no copies).

    Attributes:
        arena: the pool's (num_pages, page_bytes) uint8 arena (what the attention kernel reads in place).
        exact: ``exact[layer][stream]`` (heads, num_pages, exact_tokens, width), model dtype.
        exact_joint: per layer, every exact stream's heads as one view (streams x heads, num_pages, exact_tokens,
            width) when the layer's slabs lie end to end with one shape (``full``'s and ``int8``'s K and V), so that
            one gather reads them all; else ``None``.
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

        self.layout, self.arena = layout, arena
        self.exact = [[view(s) for s in row] for row in layout.exact_slabs]
        self.exact_joint = [None if joint is None else view(joint) for joint in map(_joint, layout.exact_slabs)]
        self.q = [[tuple(view(s) for s in parts) for parts in row] for row in layout.q_slabs] if layout.quantization \
            else None


def _joint(slabs: list[Slab]) -> Slab | None:
    """One slab spanning a layer's ``slabs`` when there are two or more of one shape and dtype, each starting where
    the one before ends (their heads' runs then follow each other in a page), else ``None``."""
    first = slabs[0]
    if len(slabs) < 2 or any((s.units, s.heads, s.width, s.dtype) != (first.units, first.heads, first.width,
                                                                       first.dtype) for s in slabs):
        return None
    if any(b.offset != a.offset + a.nbytes for a, b in zip(slabs, slabs[1:])):
        return None
    return Slab(first.offset, first.units, first.heads * len(slabs), first.width, first.dtype)


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
    if len(new) == 2 and kernels.reads(views):
        kernels.paged_write(views, layer, meta, new[0], new[1])  # K and V in one op
    else:
        for s, x in enumerate(new):
            pool = views.exact[layer][s]
            h, w = x.shape[1], x.shape[-1]
            pool[:, meta.write_pages, meta.write_slots] = x.transpose(0, 1).reshape(h, -1, w).to(pool.dtype)
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
    q_tier = layout.quantization
    g, rotated = q_tier.group_size, q_tier.rotate
    sources = sources if sources is not None else drain_sources(views, layer, drain)
    for s, spec in enumerate(layout.streams):
        src = sources[s]  # (heads, N, width), N = groups * g
        src = rotate(src) if rotated else src
        bits = q_tier.bits(spec.axis)
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
    q_tier = layout.quantization
    g = q_tier.group_size if q_tier else 0
    out = []
    joint = views.exact_joint[layer]
    if joint is not None:  # every stream's exact tokens in one gather, split along the heads (views)
        heads = [spec.heads for spec in layout.streams]
        exacts = _gather(joint, meta.exact_table, meta.gather_index).split(heads)
    for s, spec in enumerate(layout.streams):
        exact = exacts[s] if joint is not None else _gather(views.exact[layer][s], meta.exact_table,
                                                            meta.gather_index)
        q = None
        if q_tier and meta.q_width:
            q = tuple(_gather(v, meta.q_table, meta.gather_index) for v in views.q[layer][s])
        bits = q_tier.bits(spec.axis) if q_tier else 8
        out.append(StreamRead(exact, q, spec.axis, g, bits, bool(q_tier and q_tier.rotate)))
    return out


class InPlaceRead:
    """One layer's stream of a step, not gathered: the attention kernel reads its pages in place through the step's
    block tables (:func:`cache_backends.kernels.paged_attention`). ``stream``: 0 for keys, 1 for values."""

    def __init__(self, views: PoolViews, layer: int, stream: int):
        self.views, self.layer, self.stream = views, layer, stream

    def gather(self, meta: StepMeta) -> StreamRead:
        """The same stream gathered into a padded batch (the torch path), :func:`read_layer`'s."""
        return read_layer(self.views, self.layer, meta)[self.stream]


def in_place_layer(views: PoolViews, layer: int) -> list[InPlaceRead] | None:
    """``layer``'s streams (K and V; a post-hoc latent's one) for the attention kernel to read in place, or ``None``
    when the kernel is not active for this pool (:func:`cache_backends.kernels.active`) or cannot read this layout
    (:func:`cache_backends.kernels.fits`): then the caller gathers (:func:`read_layer`)."""
    if not kernels.reads(views):
        return None
    return [InPlaceRead(views, layer, s) for s in range(len(views.layout.streams))]
