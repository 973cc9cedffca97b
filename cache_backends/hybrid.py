"""Hybrid models in the paged pool: a sliding-window layer holds only its window (vLLM's hybrid KV cache manager).

A model whose layers attend through a sliding window (Gemma 3: 15 layers of window 512 beside 3 global ones) needs
from a sliding layer only the tokens a query can still see. Its layers fall in *groups* of one window each (``None``
for the global layers), and each group has its own block tables in the one pool (:class:`HybridBlocks`: one
:class:`cache_backends.page_plan.SeqBlocks` per group; a page holds one block of one group's layers, so a group of
fewer layers holds more tokens a page):

* a global group's tables grow as the backend's do without windows (:class:`cache_backends.page_layout.PageLayout`);
* a sliding group of window ``W`` writes a step's tokens, then keeps only what the next token's query can see
  besides itself (the newest ``W - 1``); its pages that hold only older tokens go back to the pool at the step's
  commit. ``SeqBlocks.first`` is the position of the oldest token the group still holds.

  - An exact layout (``full``) keeps exactly the newest ``W - 1``: its exact pages are a FIFO whose first live slot
    moves token by token. A step of ``n`` tokens holds ``W - 1 + n`` while it runs.
  - A quantized layout (``int8``, ``int4``: codes in pages of ``q_tokens`` tokens, oldest first, then the exact
    residual window) drains its groups as it does without windows (so every code is the one it would be), then frees
    its front quantized pages whose last token is older than the window of every future query (a page of tokens
    ``[a, a + q_tokens)`` goes once ``a + q_tokens - 1 < end - W + 1``, ``end`` the tokens written after the step):
    whole pages only, so ``first`` stays a multiple of ``q_tokens`` (hence of ``group_size``: a key group never
    straddles a dropped boundary, and the codes a chunking writes are those of any other). It holds the window's
    tokens plus at most ``q_tokens - 1`` older codes in its first page; its exact residual window is never
    dropped. A step holds the codes of its drained tokens before the drop.

*Sinks* (the ``window`` backend, StreamingLLM arXiv 2309.17453: :mod:`cache_backends.window`): a group whose window
the backend imposes (``sinks`` not ``None``; on a model's own sliding layers it is ``None``) also keeps the first
``sinks`` tokens. Its window drops pages as above, but a page that holds a position below ``sinks`` is moved to
``SeqBlocks.sink`` (the sink tier's: exact pages on an exact layout, quantized pages on a quantized one) instead of
being freed; every other page the window leaves goes back to the pool. The group holds ``min(sinks, first)`` tokens
besides its live ones (:meth:`HybridLayout.stored_bytes`), in at most ``ceil(sinks / tier_tokens)`` pages.

An on-demand tier (``elastic``, quantized when the pool runs short) keeps every token in every layer.

*Prefix caching* (vLLM's hybrid KV cache manager: ``HybridKVCacheCoordinator``, ``SlidingWindowManager``), every
layout with no sinks (:attr:`HybridLayout.cacheable`). A group's *block* is the page the prefix cache shares
(:attr:`cache_backends.page_plan.TierPlan.cache_block_tokens`): an exact layout's exact page, a quantized layout's
code page (its exact pages are the residual window, rewritten as it slides: never shared). Each group keys its full
blocks on its own chain of hashes (the sequence's root and the group's index, then each block's tokens: one entry
per group for the same tokens, :func:`server.engine.prefix_cache.group_root`), registered as a
step completes them (:meth:`HybridLayout.full_blocks`, before the window's commit can free them: a step that drains
and drops a code page registers it first). A sliding group's block is a whole aligned page (its exact FIFO's pages
hold positions ``[b * exact_tokens, (b + 1) * exact_tokens)``, its first live slot moving inside the first one; its
code pages ``[b * q_tokens, (b + 1) * q_tokens)``, ``first`` a page's start); a page the window leaves goes back to
the pool as any released cached page does: kept, evictable, until the pool needs it. A cached prefix of ``L``
tokens (a multiple of :attr:`HybridLayout.cache_block_tokens`, every group's block size) is a hit only if every
global group holds each of its blocks of ``[0, L)`` and every sliding group of window ``W`` the blocks that cover
``[L - W + 1, L)`` (what the next query sees); its earlier blocks are not needed (null) (:meth:`HybridLayout.
cache_hit`: the longest such ``L``). On a quantized layout a hit's ``L`` tokens are all codes, as without windows
(:meth:`cache_backends.page_plan.TierPlan.cached_prefix`): the tokens after ``L`` are prefilled, their residual window
exact, and the codes a hit supplies are those the sequence writes itself (a code page holds whole key groups, as
``q_tokens`` is a multiple of ``group_size``, and a group's codes depend on the tokens up to it alone); only the up to
``residual + group_size`` tokens before ``L`` are then read as codes by the next few queries where a miss reads them
exact, as without windows. A ``window`` group (sinks) is not cached: a hit would need its sink pages beside the
window's blocks; nor is an on-demand tier (``elastic``), which is no hybrid layout.

Plain Python but for :class:`HybridStepMeta` (torch, through :class:`cache_backends.step_meta.StepMeta`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from cache_backends import hybrid_peak
from cache_backends.page_layout import PageLayout
from cache_backends.page_plan import NULL_PAGE, GroupedBlocks, GroupedPlan, Plan, SeqBlocks
from cache_backends.step_meta import StepMeta


@dataclass
class HybridBlocks(GroupedBlocks):
    """One sequence's block tables: ``groups[g]`` those of group ``g`` (its tokens from position ``first`` on).

    Attributes:
        length: tokens of the sequence.
    """

    groups: list[SeqBlocks]
    length: int = 0

    def copy(self) -> "HybridBlocks":
        return HybridBlocks([g.copy() for g in self.groups], self.length)


@dataclass
class HybridPlan(GroupedPlan):
    """What writing ``n`` tokens does to a :class:`HybridBlocks`: one :class:`Plan` per group."""

    n: int
    groups: list[Plan]


class HybridLayout:
    """The pages of every sequence of a backend on a hybrid model: one :class:`PageLayout` per window group.

    Args:
        groups: each group's layout (pages of the pool's size; one backend's streams and tier, each group's layers).
        windows: each group's window (``None``: global).
        layers: each group's model layers, in order.
        sinks: per group, ``None`` (a model's own window, or a global group) or the attention sinks of a window the
            backend imposes (``window``: :mod:`cache_backends.window`; 0 allowed): the module.

    Raises:
        ValueError: for a group layout with an on-demand tier (``elastic``).
    """

    on_demand = False

    def __init__(self, groups: list[PageLayout], windows: list[int | None], layers: list[list[int]],
                 sinks: list[int | None] | None = None):
        if any(g.on_demand for g in groups):
            raise ValueError("a hybrid layout keeps no on-demand tier: elastic keeps every token in every layer")
        self.groups, self.windows, self.layers = groups, windows, layers
        self.sinks = list(sinks) if sinks is not None else [None] * len(groups)
        self.quantization = groups[0].quantization  # every group's: one backend's tier
        self.page_bytes = groups[0].page_bytes
        self.exact_tokens = min(g.exact_tokens for g in groups)
        # prefix caching (the module): no sinks; a hit is whole blocks (exact or code pages) of every group
        self.cacheable = all(s is None for s in self.sinks)
        self.cache_block_tokens = (math.lcm(*(g.cache_block_tokens for g in groups)) if self.cacheable
                                   else self.exact_tokens)
        where = {layer: (g, j) for g, group in enumerate(layers) for j, layer in enumerate(group)}
        self.where = [where[layer] for layer in range(len(where))]  # layer → (group, index in the group)

    @property
    def q_tier(self) -> str:
        """The quantized tier's name (:attr:`PageLayout.q_tier`)."""
        return self.groups[0].q_tier

    # ---- tables ---------------------------------------------------------------------------------------
    def cached_prefix(self, pages: list[int]) -> HybridBlocks:
        """The tables of a sequence that starts with a prefix-cache hit (:meth:`cache_hit`): ``pages`` lists each
        group's blocks of the ``L`` cached tokens in group order, ``L / cache_block_tokens`` of them a group (the
        group's :attr:`~cache_backends.page_plan.TierPlan.cache_block_tokens`), a sliding group's blocks before its
        window null. A sliding group's tables are then what a step ending at ``L`` leaves (:meth:`commit`): its
        pages from the one that holds ``L - W + 1`` on. On a quantized layout every group holds its ``L`` tokens
        as codes (``q_len``), none exact. ``[]``: empty tables.

        Raises:
            ValueError: for a layout that is not :attr:`cacheable`.
        """
        if not pages:
            return HybridBlocks([SeqBlocks() for _ in self.groups])
        if not self.cacheable:
            raise ValueError("these hybrid blocks are not prefix-cached")
        bt = self.cache_block_tokens
        length = len(pages) // sum(bt // g.cache_block_tokens for g in self.groups) * bt
        tables, i = [], 0
        for layout, window in zip(self.groups, self.windows):
            tb = layout.cache_block_tokens
            own, i = pages[i : i + length // tb], i + length // tb
            first = 0 if window is None else max(0, length - (window - 1))
            lo = first // tb
            if layout.quantization:  # whole code pages from a page's start (the drop rule's)
                tables.append(SeqBlocks(q=list(own[lo:]), q_len=length - lo * tb, first=lo * tb))
            elif window is None:
                tables.append(SeqBlocks(exact=list(own), exact_len=length))
            else:
                tables.append(SeqBlocks(exact=list(own[lo:]), start=first - lo * tb, exact_len=length - first,
                                        first=first))
        return HybridBlocks(tables, length)

    def cache_hit(self, cached, hashes: list[list[bytes]], most: int) -> list[int]:
        """The longest prefix-cache hit of at most ``most`` tokens (the module's rule), as :meth:`cached_prefix`
        reads it; ``[]`` for none.

        Args:
            cached: a block's hash -> the page that holds it, or ``None``.
            hashes: each group's chain of block hashes of the context (at least its first ``most`` tokens'), a
                block being the group's :attr:`~cache_backends.page_plan.TierPlan.cache_block_tokens` tokens.
            most: the most tokens the hit may cover.
        """
        bt = self.cache_block_tokens
        length = most // bt * bt
        for layout, window, own in zip(self.groups, self.windows, hashes):
            if window is None:  # the longest run of blocks from position 0
                tb, run = layout.cache_block_tokens, 0
                while run < length // tb and cached(own[run]) is not None:
                    run += 1
                length = min(length, run * tb // bt * bt)

        def window_held(end: int) -> bool:
            for layout, window, own in zip(self.groups, self.windows, hashes):
                tb = layout.cache_block_tokens
                if window is not None and any(cached(h) is None
                                              for h in own[max(0, end - (window - 1)) // tb : end // tb]):
                    return False
            return True

        while length > 0 and not window_held(length):
            length -= bt
        out = []
        for layout, window, own in zip(self.groups, self.windows, hashes):
            tb = layout.cache_block_tokens
            lo = 0 if window is None else max(0, length - (window - 1)) // tb
            out += [NULL_PAGE] * lo + [cached(h) for h in own[lo : length // tb]]
        return out

    def full_blocks(self, blocks: HybridBlocks, plan: HybridPlan) -> list[tuple[int, int, int]]:
        """``(group, block, page)`` of each block a step of ``plan`` completes (between the step and its
        :meth:`commit`, which may free a sliding group's: register them first). An exact layout's block ``b`` holds
        positions ``[b * exact_tokens, (b + 1) * exact_tokens)``, a sliding group's first page block
        ``(first - start) / exact_tokens``; a quantized layout's the codes of ``[b * q_tokens, (b + 1) * q_tokens)``
        (completed by the step's drained tokens), its first code page block ``first / q_tokens``."""
        end, out = blocks.length + plan.n, []
        for g, (layout, own, p) in enumerate(zip(self.groups, blocks.groups, plan.groups)):
            if layout.quantization:
                tq, done = layout.q_tokens, own.first + own.q_len
                out += [(g, b, own.q[b - own.first // tq]) for b in range(done // tq, (done + p.drained) // tq)]
                continue
            te = layout.exact_tokens
            base = (own.first - own.start) // te
            out += [(g, b, own.exact[b - base]) for b in range(blocks.length // te, end // te)]
        return out

    @staticmethod
    def release_order(blocks: HybridBlocks) -> list[int]:
        """Every page of ``blocks``, each group's deepest block first (first in line for eviction)."""
        return [p for own in blocks.groups for p in own.pages()[::-1]]

    def plan(self, blocks: HybridBlocks, n: int) -> HybridPlan:
        """Each group's pages for ``n`` more tokens; a sliding group's plan also frees, at commit, its front pages
        that hold only tokens older than its window after the step (an exact layout's exact pages, a quantized
        layout's whole quantized pages: the module)."""
        end = blocks.length + n
        plans = []
        for layout, window, own in zip(self.groups, self.windows, blocks.groups):
            if window is None:
                plans.append(layout.plan(own, n))
            elif layout.quantization:
                plan = layout.plan(own, n)
                tq, q_len = layout.q_tokens, own.q_len + plan.drained
                keep_from = end - (window - 1)  # the first position the next query sees
                drop = min(q_len // tq, max(0, keep_from - own.first) // tq)
                plans.append(dataclasses.replace(plan, free_q_front=drop))
            else:
                te = layout.exact_tokens
                keep_from = max(own.first, end - (window - 1))
                need = math.ceil((own.start + own.exact_len + n) / te) - len(own.exact)
                plans.append(Plan(n, 0, max(0, need), 0, (own.start + keep_from - own.first) // te))
        return HybridPlan(n, plans)

    @staticmethod
    def extend(blocks: HybridBlocks, plan: HybridPlan, exact_pages: list[int], q_pages: list[int]) -> None:
        """Add the pages ``plan`` asked for to each group's tables, in group order."""
        e = q = 0
        for own, p in zip(blocks.groups, plan.groups):
            own.exact.extend(exact_pages[e : e + p.new_exact_pages])
            own.q.extend(q_pages[q : q + p.new_q_pages])
            e, q = e + p.new_exact_pages, q + p.new_q_pages

    def commit(self, blocks: HybridBlocks, plan: HybridPlan, feedback=None) -> list[int]:
        """Apply ``plan`` once the step ran; return the pages no token uses any more (a quantized layout's drained
        exact pages, and a sliding group's pages of tokens older than its window)."""
        end = blocks.length + plan.n
        freed = []
        for layout, window, own, p, sinks in zip(self.groups, self.windows, blocks.groups, plan.groups, self.sinks):
            if window is None or layout.quantization:
                freed += layout.commit(own, p)
                if p.free_q_front:  # whole pages from the front: ``first`` stays at a page's (a group's) start
                    pin = self._pinned(sinks, own.first, layout.q_tokens, p.free_q_front)
                    own.sink += own.q[:pin]
                    freed += own.q[pin : p.free_q_front]
                    del own.q[: p.free_q_front]
                    own.q_len -= p.free_q_front * layout.q_tokens
                    own.first += p.free_q_front * layout.q_tokens
                continue
            drop = max(own.first, end - (window - 1)) - own.first
            pin = self._pinned(sinks, own.first - own.start, layout.exact_tokens, p.free_front)
            own.exact_len += p.n - drop
            own.first += drop
            start = own.start + drop
            own.sink += own.exact[:pin]
            freed += own.exact[pin : p.free_front]
            del own.exact[: p.free_front]
            own.start = start - p.free_front * layout.exact_tokens
        blocks.length = end
        return freed

    @staticmethod
    def _pinned(sinks: int | None, base: int, tier_tokens: int, leaving: int) -> int:
        """Of the ``leaving`` front pages of a tier whose first holds positions from ``base`` on (``tier_tokens`` a
        page), those that hold a position below ``sinks``: kept as sink pages, not freed."""
        if not sinks or base >= sinks:
            return 0
        return min(leaving, math.ceil((sinks - base) / tier_tokens))

    # ---- sizes ----------------------------------------------------------------------------------------
    def written(self, start: HybridBlocks, tokens: int) -> HybridBlocks:
        """The tables (null pages) once ``tokens`` more tokens are written after ``start`` (left as it is)."""
        blocks = start.copy()
        if tokens > 0:
            plan = self.plan(blocks, tokens)
            self.extend(blocks, plan, [NULL_PAGE] * plan.new_exact_pages, [NULL_PAGE] * plan.new_q_pages)
            self.commit(blocks, plan)
        return blocks

    def pages_for(self, tokens: int, chunk: int | None = None, start: HybridBlocks | None = None,
                  compress: bool = False) -> int:
        """The most pages a sequence holds writing ``tokens`` tokens in steps of ``chunk`` (default: at once) after
        ``start`` (a step holds its new tokens in a sliding group before the window drops the oldest)."""
        blocks = self.cached_prefix([]) if start is None else start.copy()
        most, left = len(blocks.pages()), tokens
        while left > 0:
            n = left if not chunk else min(chunk, left)
            plan = self.plan(blocks, n)
            self.extend(blocks, plan, [NULL_PAGE] * plan.new_exact_pages, [NULL_PAGE] * plan.new_q_pages)
            most = max(most, len(blocks.pages()))
            self.commit(blocks, plan)
            left -= n
        return most

    def prefill_peak(self, prompt: int, chunk: int | None = None) -> int:
        """The most pages a sequence holds writing its ``prompt`` tokens in steps of at most ``chunk`` tokens cut
        anywhere (default: in one step), the groups' pages added in the same step
        (:func:`cache_backends.hybrid_peak.prefill_peak`: which starts it walks, and why)."""
        return hybrid_peak.prefill_peak(self, prompt, chunk)

    def pages_to_generate(self, prompt: int, total: int, chunk: int | None = None) -> int:
        """At most the pages a sequence holds writing its ``prompt`` in steps of at most ``chunk`` cut anywhere
        (:meth:`prefill_peak`), then one token a step until it holds ``total``: every group's most in a decode step
        up to ``total`` (:meth:`_decode_pages`)."""
        most = self.prefill_peak(prompt, chunk)
        if total <= prompt:
            return most
        return max(most, sum(self._decode_pages(layout, window, total, sinks)
                             for layout, window, sinks in zip(self.groups, self.windows, self.sinks)))

    @staticmethod
    def _sink_pages(layout: PageLayout, sinks: int | None, total: int) -> int:
        """The pages a group of ``layout`` keeps for its ``sinks`` (the sink tier's, at most ``total`` tokens')."""
        if not sinks:
            return 0
        return math.ceil(min(sinks, total) / (layout.q_tokens if layout.quantization else layout.exact_tokens))

    @classmethod
    def _decode_pages(cls, layout: PageLayout, window: int | None, total: int, sinks: int | None = None) -> int:
        """The most pages one group holds in a decode step of a sequence of at most ``total`` tokens.

        Exact layout: every token's pages, or in a sliding group of window ``W`` at most ``W`` tokens from any slot
        of its first page on, and its sink pages. Quantized layout: the codes of every quantized token (in a sliding
        group at most ``W + q_tokens - 1 - residual`` of them, from a page's start: the first page holds a token the
        window sees, and the codes end ``residual`` tokens before the newest, and its sink pages of codes) beside its
        exact tokens, at most ``residual + group_size`` from any slot of their first page
        (:meth:`cache_backends.page_plan.TierPlan.pages_to_generate`). The sink pages are pages of the first tokens,
        so a tier never holds more than every token's pages: until the window has passed a page, its sinks lie in
        pages the window still holds (counting them apart reserved a page more than a short sequence ever holds)."""
        te, q = layout.exact_tokens, layout.quantization
        every = math.ceil(total / te)
        sink = cls._sink_pages(layout, sinks, total)
        if not q:
            return every if window is None else min(every, math.ceil((te - 1 + window) / te) + sink)
        tq = layout.q_tokens
        codes = total - q.exact_held(total)
        q_pages = math.ceil(codes / tq)
        if window is not None:
            q_pages = min(q_pages, math.ceil(max(0, window + tq - 1 - q.residual) / tq) + sink)
        return q_pages + min(every, math.ceil((te - 1 + q.residual + q.group_size) / te))

    def prefill_pages(self, start: HybridBlocks, tokens: int) -> int:
        """Pages a step writing ``tokens`` tokens after ``start`` holds while it runs."""
        return len(start.pages()) + self.plan(start, tokens).pages_needed

    def transient_pages(self, stored: HybridBlocks, chunk: int) -> int:
        """A bound on the pages a prefill step of ``chunk`` tokens holds above the stored form ``stored``.

        An exact layout's sliding groups: their new tokens, held before the window drops the oldest. A quantized
        layout's groups: the step writes its tokens into exact pages before it drains their whole groups, so a group
        holds at most ``ceil((exact_tokens - 1 + residual + group_size - 1 + chunk) / exact_tokens)`` exact pages
        (:meth:`server.engine.kv_cache.KVCacheManager.transient_pages`) beside its codes: a global group's final
        ones, a sliding group's at most ``chunk + W + q_tokens - 1`` codes (those of the pages it held before the
        step, whose first has a token the window saw, and of the tokens the step drains) before the drop (or
        ``chunk + residual + group_size - 1`` when it held none), and no more than the whole context's tokens
        (``stored.length``) and codes take."""
        extra = 0
        for layout, window, own in zip(self.groups, self.windows, stored.groups):
            te, q = layout.exact_tokens, layout.quantization
            if not q:
                if window is not None:
                    extra += max(0, math.ceil((te - 1 + own.exact_len + chunk) / te) - len(own.exact))
                continue
            pending, tq = q.residual + q.group_size - 1, layout.q_tokens
            exact = math.ceil((te - 1 + min(pending + chunk, stored.length)) / te)
            if window is None:
                codes = len(own.q)
            else:  # and no more than every code the whole context has
                codes = math.ceil(min(max(chunk + window + tq - 1, chunk + pending), own.first + own.q_len) / tq)
            extra += max(0, codes + exact - len(own.exact) - len(own.q))  # a window's sink pages stay as they are
        return extra

    def _sink_held(self, index: int, own) -> int:
        """Tokens group ``index`` holds besides its live ones: the sinks the window has passed (``min(sinks,
        first)``), in its sink pages or in the dead slots of its first page."""
        sinks = self.sinks[index]
        return min(sinks, own.first) if sinks else 0

    def stored_bytes(self, blocks: HybridBlocks) -> int:
        """Bytes of the tokens every group holds (each group's layers), a ``window`` group's sinks included (in the
        sink tier: codes on a quantized layout)."""
        total = 0
        for i, (g, b) in enumerate(zip(self.groups, blocks.groups)):
            held = self._sink_held(i, b)
            total += g.spec.stored_bytes(b.exact_len + (0 if g.quantization else held),
                                         b.q_len + (held if g.quantization else 0))
        return total

    def used_bytes(self) -> int:
        return min(g.used_bytes() for g in self.groups)

    def tier_tokens(self, blocks: HybridBlocks) -> dict[str, int]:
        """Tokens held per tier, averaged over the layers (a sliding layer's dropped tokens count out), rounded."""
        held: dict[str, int] = {}
        for i, (layout, own, layers) in enumerate(zip(self.groups, blocks.groups, self.layers)):
            sink_tier = layout.q_tier if layout.quantization else "exact"
            for tier, tokens in layout.tier_tokens(own).items():
                tokens += self._sink_held(i, own) if tier == sink_tier else 0
                held[tier] = held.get(tier, 0) + tokens * len(layers)
        total = sum(len(layers) for layers in self.layers)
        return {tier: round(tokens / total) for tier, tokens in held.items()}

    def stats(self, blocks: HybridBlocks) -> dict:
        return {}


class HybridStepMeta:
    """One step's metadata for the rows of a backend on a hybrid layout: a :class:`StepMeta` per group.

    Args:
        layout: the backend's :class:`HybridLayout`.
        rows: each sequence's :class:`HybridBlocks` (this step's pages added) and :class:`HybridPlan`.
        device: where the index tensors go.

    Attributes:
        groups: each group's :class:`StepMeta` (over its own tokens, from each row's ``first`` on).
        query_positions, n, batch: the step's (the same in every group).
    """

    def __init__(self, layout: HybridLayout, rows: list, device):
        self.layout = layout
        self.groups = [StepMeta(g, [(b.groups[i], p.groups[i]) for b, p in rows], device, sinks=layout.sinks[i],
                                sink_window=layout.windows[i] if layout.sinks[i] is not None else None)
                       for i, g in enumerate(layout.groups)]
        first = self.groups[0]
        self.query_positions, self.n, self.batch = first.query_positions, first.n, first.batch

    def for_layer(self, layer: int) -> StepMeta:
        """The metadata of the group ``layer`` belongs to."""
        return self.groups[self.layout.where[layer][0]]
