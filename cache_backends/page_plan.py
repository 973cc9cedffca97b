"""Tier planning: a sequence's block tables and what a step does to them, with no tensors (no torch import).

A sequence's tokens are its quantized tokens (``q`` pages, oldest first) followed by its exact tokens (``exact``
pages, a FIFO); :class:`TierPlan` says, from how many tokens a page of each tier holds, which pages a step needs,
which tokens it quantizes and which pages it frees (:class:`cache_backends.page_layout.PageLayout` is a
:class:`TierPlan` whose page sizes come from the backend's streams). The block manager
(:mod:`server.engine.block_manager`) owns the pages these tables name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cache_backends.kv_spec import Quantization

MOST_PEAKS = 4096
"""The most ``(prompt, chunk)`` peaks a layout keeps (:func:`cached_peak`): past it the cache starts over."""


def cached_peak(layout, prompt: int, chunk: int, walk) -> int:
    """``walk()``, the most pages a sequence of ``layout`` holds prefilling ``prompt`` tokens in steps of at most
    ``chunk`` (``TierPlan.prefill_peak``, ``HybridLayout.prefill_peak``), kept on ``layout`` per ``(prompt, chunk)``:
    admission asks it for every request, and a layout's sequences share a few prompt lengths."""
    peaks = layout.__dict__.setdefault("_peaks", {})
    if (prompt, chunk) not in peaks:
        if len(peaks) >= MOST_PEAKS:
            peaks.clear()
        peaks[prompt, chunk] = walk()
    return peaks[prompt, chunk]

NULL_PAGE = 0  # zeros, never allocated: pads block tables


@dataclass
class SeqBlocks:
    """One sequence's block tables and lengths (plain Python; the block manager owns the pages).

    Attributes:
        exact: pages of the exact tier, oldest first.
        start: index, in ``exact[0]``, of the first live exact token (earlier slots were quantized).
        exact_len: live exact tokens (tokens).
        q: pages of the quantized tier, oldest first.
        q_len: quantized tokens.
        first: the position of the first token they hold (0 but for a ``dca`` layer that keeps only some of a
            sequence's tokens: :mod:`cache_backends.dca.plan`).
        sink: pages kept for a ``window`` group's attention sinks (:mod:`cache_backends.hybrid`): the pages of the
            sink tier (exact, or quantized on a quantized layout) that held positions ``[0, sinks)`` when the window
            left them, position ``k * tier_tokens + u`` at slot ``u`` of ``sink[k]``; empty until then.
    """

    exact: list[int] = field(default_factory=list)
    start: int = 0
    exact_len: int = 0
    q: list[int] = field(default_factory=list)
    q_len: int = 0
    first: int = 0
    sink: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        """Tokens held (from position ``first`` on)."""
        return self.q_len + self.exact_len

    def pages(self) -> list[int]:
        return self.exact + self.q + self.sink

    def copy(self) -> "SeqBlocks":
        return SeqBlocks(list(self.exact), self.start, self.exact_len, list(self.q), self.q_len, self.first,
                         list(self.sink))


@dataclass
class Plan:
    """What writing ``n`` tokens does to a :class:`SeqBlocks` (see :meth:`TierPlan.plan`)."""

    n: int
    drained: int  # tokens quantized this step (a multiple of group_size)
    new_exact_pages: int  # pages to add to the exact tier before the step
    new_q_pages: int  # pages to add to the quantized tier before the step
    free_front: int  # exact pages that hold no live token after the step (freed after it)
    free_q_front: int = 0  # quantized pages no future query sees after the step (a sliding window's; freed after it)

    @property
    def pages_needed(self) -> int:
        return self.new_exact_pages + self.new_q_pages


class GroupedBlocks:
    """A sequence's block tables made of one :class:`SeqBlocks` per group of pages (``groups``: ``dca``'s layer
    groups, a hybrid model's window groups) and its ``length`` in tokens: the pages of every group, in order."""

    groups: list[SeqBlocks]
    length: int

    @property
    def tokens(self) -> int:
        return self.length

    def pages(self) -> list[int]:
        return [p for g in self.groups for p in g.pages()]


class GroupedPlan:
    """A plan made of one :class:`Plan` per group of pages (``groups``: ``dca``'s layer groups, a hybrid model's
    window groups): the pages of every group, added."""

    groups: list[Plan]

    @property
    def new_exact_pages(self) -> int:
        return sum(p.new_exact_pages for p in self.groups)

    @property
    def new_q_pages(self) -> int:
        return sum(p.new_q_pages for p in self.groups)

    @property
    def pages_needed(self) -> int:
        return self.new_exact_pages + self.new_q_pages


class TierPlan:
    """How a sequence's tokens fill the pages of a layout's two tiers (plain Python).

    Args:
        exact_tokens: tokens one exact page holds.
        q_tokens: tokens one quantized page holds (0: no quantized tier).
        quantization: ``None``, or the quantized tier (:class:`cache_backends.kv_spec.Quantization`): fed by a
            residual window of ``residual`` exact tokens, drained ``group_size`` at a time, or filled on demand only
            (``residual=None``, :meth:`plan_compress`, the newest ``window`` tokens always exact).
    """

    def __init__(self, exact_tokens: int, q_tokens: int, quantization: Quantization | None = None):
        self.exact_tokens, self.q_tokens, self.quantization = exact_tokens, q_tokens, quantization

    @property
    def on_demand(self) -> bool:
        """Whether the quantized tier is filled on demand only (``elastic``), not by a residual window."""
        return self.quantization is not None and self.quantization.on_demand

    def plan(self, blocks: SeqBlocks, n: int) -> Plan:
        """What writing ``n`` new tokens into ``blocks`` needs: pages to add, tokens quantized, pages freed."""
        exact_len = blocks.exact_len + n
        drained = 0
        if self.quantization and not self.on_demand:
            g, r = self.quantization.group_size, self.quantization.residual
            drained = max(0, (exact_len - r) // g) * g
        new_q = blocks.q_len + drained
        need_exact = math.ceil((blocks.start + exact_len) / self.exact_tokens) - len(blocks.exact)
        need_q = math.ceil(new_q / self.q_tokens) - len(blocks.q) if drained else 0
        return Plan(n, drained, max(0, need_exact), max(0, need_q), (blocks.start + drained) // self.exact_tokens)

    def compressible(self, blocks: SeqBlocks) -> int:
        """Tokens of an on-demand tier's exact pages that may be quantized now: whole groups, oldest first,
        outside the window of the newest tokens (0 for other layouts)."""
        if not self.on_demand:
            return 0
        g = self.quantization.group_size
        return max(0, (blocks.exact_len - self.quantization.window) // g * g)

    def plan_compress(self, blocks: SeqBlocks, tokens: int) -> Plan:
        """Quantizing the oldest ``tokens`` exact tokens of ``blocks`` (a multiple of the group size, at most
        :meth:`compressible`) without writing any: the quantized pages it needs, the exact pages it frees."""
        need_q = math.ceil((blocks.q_len + tokens) / self.q_tokens) - len(blocks.q)
        return Plan(0, tokens, 0, max(0, need_q), (blocks.start + tokens) // self.exact_tokens)

    @property
    def cacheable(self) -> bool:
        """Whether the blocks' stored form depends on their tokens alone (prefix caching): not an on-demand tier,
        quantized when the pool ran short."""
        return not self.on_demand

    @property
    def cache_block_tokens(self) -> int:
        """Tokens of one page the prefix cache can share: an exact page's, or for a quantized layout a quantized
        page's (its exact pages are the residual window, rewritten as it slides: never shared)."""
        return self.q_tokens if self.quantization else self.exact_tokens

    def cached_prefix(self, pages: list[int]) -> SeqBlocks:
        """The tables of a sequence whose first ``len(pages)`` full blocks are the cached ``pages``."""
        k = len(pages) * self.cache_block_tokens
        if self.quantization:
            return SeqBlocks(q=list(pages), q_len=k)
        return SeqBlocks(exact=list(pages), exact_len=k)

    def pages_for(self, tokens: int, chunk: int | None = None, start: SeqBlocks | None = None,
                  compress: bool = False) -> int:
        """Pages a sequence needs to write ``tokens`` tokens in chunks of ``chunk`` (default: at once) after the
        tokens of ``start`` (default: none; e.g. a prefix-cache hit, :meth:`cached_prefix`): the most it holds at
        any moment, ``start``'s pages and the transient exact pages of a chunk included (admission and fit
        checks). ``compress``: an on-demand tier quantizes what it may after each chunk (the pool short)."""
        blocks = SeqBlocks() if start is None else start.copy()
        most, left = len(blocks.pages()), tokens
        while left > 0:
            n = left if not chunk else min(chunk, left)
            p = self.plan(blocks, n)
            self.extend(blocks, p, [NULL_PAGE] * p.new_exact_pages, [NULL_PAGE] * p.new_q_pages)
            most = max(most, len(blocks.pages()))
            self.commit(blocks, p)
            left -= n
            if compress and self.on_demand:
                c = self.plan_compress(blocks, self.compressible(blocks))
                self.extend(blocks, c, [], blocks.exact[: c.new_q_pages])
                self.commit(blocks, c)
        return most

    def prefill_peak(self, prompt: int, chunk: int | None = None) -> int:
        """The most pages a sequence holds writing its ``prompt`` tokens in steps of at most ``chunk`` tokens cut
        anywhere (default: in one step; an on-demand tier compressing what it may after each step), not only in
        whole chunks from position 0 (:meth:`pages_for`): the scheduler shortens a step where the pages are short
        (``step_tokens``) and shares a step's budget with the decoding sequences and the other prefills, so a step
        of ``chunk`` tokens may start at any position ``p``. Between steps a sequence's tables are those of its
        ``p`` tokens whatever the chunking (:meth:`written`: a group drains once ``residual`` newer tokens exist, and
        exact pages are aligned to positions), and a step holds more the more tokens it writes, so the peak is the
        most over ``p`` of a step of ``min(chunk, prompt - p)`` tokens from there (:meth:`prefill_pages`).

        Only some ``p`` need a look: past the residual window, a step of ``chunk`` tokens holds the quantized pages
        of ``Q(p + chunk)`` tokens (``Q``: the tokens quantized, whole groups: growing with ``p``) and exact pages
        that depend on ``p`` modulo ``lcm(group_size, exact_tokens)`` only, so the last such period of starts
        holds the most of all the earlier ones; a last, shorter step (from ``p > prompt - chunk``) holds what
        ``Q(p)`` says, so one ``p`` per group."""
        q = self.quantization
        if not q:  # every token's exact pages, however the prompt is cut
            return self.pages_for(prompt)
        if not chunk:
            return self.pages_for(prompt, compress=self.on_demand)
        chunk = min(chunk, prompt)
        return cached_peak(self, prompt, chunk, lambda: self._peak(prompt, chunk))

    def _peak(self, prompt: int, chunk: int) -> int:
        """:meth:`prefill_peak`'s walk of the starts that can peak, for ``0 < chunk <= prompt``."""
        q = self.quantization
        r, g = (q.window if q.on_demand else q.residual), q.group_size
        last = prompt - chunk  # the last start of a whole chunk
        starts = {*range(min(last, r + g) + 1), *range(max(0, last - math.lcm(g, self.exact_tokens) + 1), last + 1),
                  *(p for p in range(last + 1, prompt) if p == last + 1 or (p >= r and (p - r) % g == 0))}
        return max(self.prefill_pages(self.written(SeqBlocks(), p), min(chunk, prompt - p)) for p in starts)

    def pages_to_generate(self, prompt: int, total: int, chunk: int | None = None) -> int:
        """At most the pages a sequence holds writing its ``prompt`` tokens in steps of at most ``chunk`` (default:
        at once), cut anywhere (:meth:`prefill_peak`), and then its generated tokens one a step until it holds
        ``total`` (an on-demand tier compressing what it may after each step: the least it can hold; fit checks).

        After the prompt, a step writes one token: its quantized pages grow to those of the ``total`` tokens at
        most, and its exact tokens during a step are at most the window (``residual``, or an on-demand tier's
        ``window``) plus one group, from a slot of the first exact page on: at most
        ``ceil((exact_tokens - 1 + window + group_size) / exact_tokens)`` pages, and no more than all ``total``
        tokens take. A bound, not a walk of every step: at most two pages above the walk where a quantized page holds
        at least an exact page's tokens (``tests/test_kv_spec.py``).
        """
        most = self.prefill_peak(prompt, chunk)
        if total <= prompt:
            return most
        final = self.written(SeqBlocks(), total)
        te = self.exact_tokens
        exact = math.ceil(total / te)
        q = self.quantization
        if q:
            window = (q.window if q.on_demand else q.residual) + q.group_size
            exact = min(exact, math.ceil((te - 1 + window) / te))
        return max(most, len(final.pages()), (math.ceil(final.q_len / self.q_tokens) if q else 0) + exact)

    def written(self, start: SeqBlocks, tokens: int) -> SeqBlocks:
        """The tables (null pages) once ``tokens`` more tokens are written after ``start`` (an on-demand tier then
        compressed down to its window: the least it can hold); ``start`` is left as it is."""
        blocks = start.copy()
        if tokens > 0:
            plan = self.plan(blocks, tokens)
            self.extend(blocks, plan, [NULL_PAGE] * plan.new_exact_pages, [NULL_PAGE] * plan.new_q_pages)
            self.commit(blocks, plan)
        if self.on_demand:
            plan = self.plan_compress(blocks, self.compressible(blocks))
            self.extend(blocks, plan, [], blocks.exact[: plan.new_q_pages])
            self.commit(blocks, plan)
        return blocks

    def prefill_pages(self, start: SeqBlocks, tokens: int) -> int:
        """Pages a step writing ``tokens`` tokens after ``start`` holds while it runs."""
        return len(start.pages()) + self.plan(start, tokens).pages_needed

    @staticmethod
    def extend(blocks: SeqBlocks, plan: Plan, exact_pages: list[int], q_pages: list[int]) -> None:
        """Add the pages ``plan`` asked for to ``blocks`` (before the step runs)."""
        blocks.exact.extend(exact_pages)
        blocks.q.extend(q_pages)

    def commit(self, blocks: SeqBlocks, plan: Plan, feedback=None) -> list[int]:
        """Apply ``plan`` to ``blocks`` once the step ran; return the exact pages no live token uses any more
        (the caller frees them). ``feedback``: what the runner measured (only ``dca`` reads it)."""
        blocks.q_len += plan.drained
        blocks.exact_len += plan.n - plan.drained
        start = blocks.start + plan.drained
        freed = blocks.exact[: plan.free_front]
        del blocks.exact[: plan.free_front]
        blocks.start = start - plan.free_front * self.exact_tokens
        return freed
