"""One step's metadata for the rows of one backend, built once before the forward and read by every layer: block
tables as tensors, write slots, the slots of the groups the step quantizes (:class:`Drain`), every gathered
token's position and the attention mask (:class:`StepMeta`), and the same for a sliding-window layer
(:meth:`StepMeta.windowed`)."""

from __future__ import annotations

import copy
import functools

import torch

from cache_backends.page_layout import PageLayout
from cache_backends.page_plan import NULL_PAGE, Plan, SeqBlocks

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
        g = layout.quantization.group_size if layout.quantization else 0
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
        ranges: (B, n, 3) int32, the mask as intervals of each row's tiers (what the attention kernel reads,
            :mod:`cache_backends.kernels`): a new token sees the quantized tokens ``[0, q)`` and the exact slots
            ``[lo, hi)`` of its row's exact pages; (B, n, 4) on a :meth:`windowed` copy with a quantized tier, the
            fourth column the first code seen (codes ``[q0, q)``); (B, n, 6) with attention sinks (``sinks`` given):
            ``q, lo, hi, q0`` and the sinks' slots ``[s0, s1)`` of the sink tier (the quantized tier's codes on a
            quantized layout, else the exact tier's slots), disjoint from ``[q0, q)`` and ``[lo, hi)``.

    Sinks (``sinks`` not ``None``: a ``window`` group, :mod:`cache_backends.window`, StreamingLLM arXiv 2309.17453):
    every query at position ``p`` sees the positions ``[0, sinks) ∪ [p - sink_window + 1, p]`` (causal); each row's
    sink pages (``SeqBlocks.sink``) are put before its pages of the sink tier in the block table (padded with the null
    page to the batch's most), their slot ``u`` of page ``k`` at position ``k * tier_tokens + u``.

    Quantized layouts: the new token at position ``p`` reads the tokens before ``quantized_before(p)`` as codes
    and the later ones exact, as it would decoding alone (the drained tokens' exact slots are still in their
    pages during the step). So every token's K/V, and hence every group's codes, are a function of the tokens
    before it only, however the prompt was chunked. (After a prefix-cache hit the hit's tokens exist only as
    codes, and are read so.)
    """

    def __init__(self, layout: PageLayout, rows: list[tuple[SeqBlocks, Plan]], device,
                 exact_rows: list[bool] | None = None, sinks: int | None = None, sink_window: int | None = None):
        te, tq = layout.exact_tokens, layout.q_tokens
        n = rows[0][1].n
        wp, ws = [], []
        qpos, q_lens, starts, e_lens = [], [], [], []
        g = layout.quantization.group_size if layout.quantization else 0
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
        q_tables = _pad_table([b.q for b, _ in rows]) if layout.quantization else [[] for _ in rows]
        self.q_table = as_long(q_tables)
        t_q, t_e = self.q_table.shape[1] * tq, self.exact_table.shape[1] * te
        q_len, start, e_len = as_long(q_lens), as_long(starts), as_long(e_lens)
        iq, ie = torch.arange(t_q, device=device), torch.arange(t_e, device=device)
        pos_q = iq.expand(len(rows), t_q)
        pos_e = q_len[:, None] + ie[None] - start[:, None]
        self.positions = torch.cat([pos_q, pos_e], dim=1)  # (B, Tq + Te)
        self.query_positions = as_long(qpos)  # (B, n), from each row's first token until the end
        causal = self.positions[:, None, :] <= self.query_positions[:, :, None]  # (B, n, T)
        if layout.quantization and not (exact_rows and all(exact_rows)):
            old_start = as_long([b.start for b, _ in rows])
            # tokens held only as codes are read as codes (after a prefix-cache hit: the hit's whole pages; an
            # on-demand tier: every quantized token)
            split = as_long([b.q_len for b, _ in rows])[:, None].expand_as(self.query_positions)
            if not layout.on_demand:
                rule = quantized_before(self.query_positions, g, layout.quantization.residual)
                if exact_rows and any(exact_rows):  # rows read exact (dca: a candidate's prefill, a reuse window)
                    rule = rule.masked_fill(as_long(exact_rows).bool()[:, None], 0)
                split = torch.maximum(rule, split)
            split = split[:, :, None]  # (B, n, 1)
            quantized = iq[None, None] < split
            exact = (ie[None] >= old_start[:, None])[:, None] & (pos_e[:, None] >= split)
            self.mask = torch.cat([quantized, exact], dim=2) & causal
            # the same mask as intervals: codes [0, q), exact slots [lo, hi) (pos_e = q_len + ie - start)
            split, shift = split[..., 0], (start - q_len)[:, None]
            self.ranges = (torch.minimum(split, self.query_positions + 1).clamp(0, t_q),
                           torch.maximum(old_start[:, None], split + shift).clamp(0, t_e),
                           (self.query_positions + 1 + shift).clamp(0, t_e))
        else:
            live = (ie[None] >= start[:, None]) & (pos_e < (q_len + e_len)[:, None])
            self.mask = live[:, None, :] & causal
            shift = (start - q_len)[:, None]
            self.ranges = (torch.zeros_like(self.query_positions), start[:, None].expand_as(self.query_positions),
                           torch.minimum(self.query_positions + 1 + shift, (start + e_len)[:, None]).clamp(0, t_e))
            if n == 1 and all(s == 0 for s in starts) and len(set(e_lens)) == 1:
                # one new token each, every row as long: the first e_lens[0] gathered tokens, all visible
                self._unmasked, self.unmasked_len = self.mask, e_lens[0]
        firsts = [b.first for b, _ in rows]
        if any(firsts):  # positions above were counted from each row's first token (a dca layer's own tokens)
            first = as_long(firsts)[:, None]
            self.positions, self.query_positions = self.positions + first, self.query_positions + first
        self.ranges = torch.stack(self.ranges, dim=-1).to(torch.int32)  # (B, n, 3)
        self.q_width = t_q
        self.gather_index: dict = {}  # the page gathers' row indices, built by the first layer that reads them
        self._grouped: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # what windowed() needs: each row's first position, and slot = position + slot_shift in its exact pages
        self._first = as_long(firsts)[:, None]  # (B, 1)
        self._slot_shift = (start - q_len)[:, None] - self._first  # (B, 1)
        self._windows: dict[int, "StepMeta"] = {}
        self.sink_window = None
        if sinks is not None:
            self._add_sinks(layout, rows, sinks, sink_window, device)

    def _add_sinks(self, layout: PageLayout, rows: list[tuple[SeqBlocks, Plan]], sinks: int, window: int,
                   device) -> None:
        """Narrow this metadata to the sinks and the window (the class): the sink pages put before the sink tier's
        pages in its table, their positions and mask columns before that tier's; :attr:`ranges` (B, n, 6).

        Sinks not yet passed by the window lie in the first page of the sink tier where its first slot holds
        position 0 (exact layout: live, or dead slots of ``exact[0]`` not yet freed; quantized: ``q[0]``, with
        ``first == 0``). On a quantized layout the sinks still exact are newer than the split of codes and exact
        tokens, so inside the window (:class:`cache_backends.window.WindowBackend` requires ``window >= residual +
        group_size``)."""
        quant = layout.quantization is not None
        per = layout.q_tokens if quant else layout.exact_tokens
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        have = [len(b.sink) for b, _ in rows]
        width = max(have) * per
        qp = self.query_positions  # (B, n), absolute
        lower = qp + 1 - window
        has = as_long(have)[:, None] > 0  # (B, 1)
        slot = torch.arange(width, device=device)
        never = torch.iinfo(torch.long).max // 2  # a padding slot's position: no query sees it
        pin_pos = torch.where(slot[None] < as_long(have)[:, None] * per, slot[None], never)  # (B, width)
        pin_mask = (pin_pos[:, None, :] < sinks) & (pin_pos[:, None, :] <= qp[:, :, None])  # (B, n, width)
        pos = self.positions[:, None, :]  # (B, 1, T)
        in_window = pos >= lower[:, :, None]
        early = (pos < sinks) & (pos <= qp[:, :, None])  # the sinks before they are pinned
        if quant:  # codes before the split, exact after it: the mask's own rule (sinks still exact are in the window)
            keep = self.mask & (in_window | early)
        else:  # the sinks in the dead slots of a first page not yet freed are read too
            keep = (self.mask & in_window) | early
        self.mask = torch.cat([pin_mask, keep], dim=2)
        self.positions = torch.cat([pin_pos, self.positions], dim=1)
        pin_table = as_long(_pad_table([b.sink for b, _ in rows]) if width else [[] for _ in rows])
        q, lo, hi = (self.ranges[..., i].long() for i in range(3))
        first = self._first
        if quant:
            self.q_table = torch.cat([pin_table, self.q_table], dim=1)
            self.q_width += width
            codes = q  # codes seen (from position first on)
            q = q + width
            q0 = (lower - first).clamp(min=0) + width
            lo = torch.maximum(lo, (lower + self._slot_shift).clamp(min=0))
            s0 = torch.where(has, 0, width)
            s1 = s0 + torch.where(has, min(sinks, width), torch.clamp(codes, max=sinks))
            s1 = torch.minimum(s1, torch.maximum(s0, torch.minimum(q0, q)))
        else:
            self.exact_table = torch.cat([pin_table, self.exact_table], dim=1)
            self._slot_shift = self._slot_shift + width
            lo = torch.maximum(lo + width, (lower + self._slot_shift).clamp(min=0))
            hi = hi + width
            q0 = torch.zeros_like(q)
            s0 = torch.where(has, 0, width)
            s1 = s0 + torch.clamp(qp + 1, max=sinks)
            s1 = torch.minimum(s1, torch.maximum(s0, lo))
        self.ranges = torch.stack([q, lo, hi, q0, s0.expand_as(q), s1], dim=-1).to(torch.int32)
        self._unmasked, self.unmasked_len = None, None
        self.gather_index, self._grouped = {}, {}
        self.sink_window = window

    def windowed(self, window: int) -> "StepMeta":
        """This step's metadata for a sliding-window layer: a query at position ``p`` sees only the tokens at
        ``p - window < t <= p`` (transformers' ``sliding_window_overlay``). Built once per step and window; the
        block tables, write slots and gathers are this one's (shared), the :attr:`mask` and :attr:`ranges` narrowed.

        The window raises each query's first exact slot in :attr:`ranges`, and on a layout with a quantized tier
        adds a fourth column, each query's first code seen (:attr:`ranges` is then (B, n, 4)); the attention kernel
        reads both and skips the blocks before them. A window that covers every query's tokens returns this
        metadata itself.

        Args:
            window: tokens each query sees, itself included (``sliding_window``), > 0.
        """
        if self.sink_window is not None:  # a window group with sinks: the model's own window is never narrower
            if window >= self.sink_window:
                return self
            raise ValueError(f"a window group of {self.sink_window} tokens with sinks cannot be narrowed to {window}")
        if window in self._windows:
            return self._windows[window]
        lower = self.query_positions + 1 - window  # (B, n): each query's first visible position
        if not bool((lower > self._first).any()):
            self._windows[window] = self
            return self
        meta = copy.copy(self)
        meta._windows, meta._grouped, meta._unmasked, meta.unmasked_len = {}, {}, None, None
        meta.mask = self.mask & (self.positions[:, None, :] >= lower[:, :, None])
        meta.ranges = self._narrow(lower)
        self._windows[window] = meta
        return meta

    def _narrow(self, lower: torch.Tensor) -> torch.Tensor:
        """:attr:`ranges` under a window whose first visible position is ``lower`` (B, n): each query's first exact
        slot raised to it; with a quantized tier, a fourth column: the first code it sees (codes ``[q0, q)``)."""
        ranges = self.ranges.clone()
        lo = (lower + self._slot_shift).clamp(min=0).to(torch.int32)
        ranges[..., 1] = torch.maximum(ranges[..., 1], lo)
        if not self.q_width:
            return ranges
        first_code = (lower - self._first).clamp(min=0).to(torch.int32)  # codes are held from position first on
        return torch.cat([ranges, first_code[..., None]], dim=-1)

    @functools.cached_property
    def row_offsets(self) -> list[tuple[int, int]]:
        """Per row, ``(slot shift, first)`` in plain ints, worked out once per step: position ``p`` is exact slot
        ``p + shift`` of the row's exact pages and code ``p - first`` of its quantized tier (what
        :meth:`ranges_from` and :meth:`ranges_before` cut with)."""
        return list(zip(self._slot_shift[:, 0].tolist(), self._first[:, 0].tolist()))

    @functools.cached_property
    def query_stop(self) -> int:
        """Above every position the step reads (its newest query's, plus one): worked out once per step."""
        return int(self.query_positions.max()) + 1 if self.query_positions.numel() else 1

    def ranges_from(self, lower: torch.Tensor) -> torch.Tensor:
        """:attr:`ranges` with each query's first visible position raised to ``lower`` (B, n) (a tensor of its own).

        Raises:
            ValueError: on ranges with attention sinks (a ``window`` group's), which no cut here describes.
        """
        if self.ranges.shape[-1] == 3:
            return self._narrow(lower)
        if self.ranges.shape[-1] != 4:
            raise ValueError("ranges with attention sinks cannot be cut at a position")
        ranges = self.ranges.clone()  # a window's: its first exact slot and first code raised further
        ranges[..., 1] = torch.maximum(ranges[..., 1], (lower + self._slot_shift).clamp(min=0).to(torch.int32))
        ranges[..., 3] = torch.maximum(ranges[..., 3], (lower - self._first).clamp(min=0).to(torch.int32))
        return ranges

    def ranges_before(self, upper: torch.Tensor) -> torch.Tensor:
        """:attr:`ranges` with each query seeing only the positions below ``upper`` (B, n): its last exact slot and,
        with a quantized tier, its last code lowered (a tensor of its own).

        Raises:
            ValueError: on ranges with attention sinks.
        """
        if self.ranges.shape[-1] > 4:
            raise ValueError("ranges with attention sinks cannot be cut at a position")
        ranges = self.ranges.clone()
        hi = (upper + self._slot_shift).clamp(min=0).to(torch.int32)
        ranges[..., 2] = torch.minimum(ranges[..., 2], hi)
        if self.q_width:
            ranges[..., 0] = torch.minimum(ranges[..., 0], (upper - self._first).clamp(min=0).to(torch.int32))
        return ranges

    _unmasked: torch.Tensor | None = None  # the mask, when it lets every new token see the first unmasked_len tokens
    unmasked_len: int | None = None

    def grouped_mask(self, rep: int) -> torch.Tensor | None:
        """:attr:`mask` for rows grouped as :func:`cache_backends.paged_attention.grouped_rows` orders them, (B, 1,
        rep * n, T), built once per step and ``rep``; ``None`` when the rows' first :attr:`unmasked_len` gathered
        tokens are all they see, every one of them (one new token per row, every row as long: attention over those
        needs no mask). A mask replaced in the step (``dca``) is grouped anew."""
        if self._unmasked is not None and self._unmasked is self.mask:
            return None
        cached = self._grouped.get(rep)
        if cached is None or cached[0] is not self.mask:
            b, r, t = self.mask.shape
            cached = self._grouped[rep] = (self.mask, self.mask[:, None].expand(b, rep, r, t).reshape(b, 1, rep * r, t))
        return cached[1]
