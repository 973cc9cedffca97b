"""Hybrid models in the paged pool: a sliding-window layer holds only its window (vLLM's hybrid KV cache manager).

A model whose layers attend through a sliding window (Gemma 3: 15 layers of window 512 beside 3 global ones) needs
from a sliding layer only the tokens a query can still see. Its layers fall in *groups* of one window each (``None``
for the global layers), and each group has its own block tables in the one pool (:class:`HybridBlocks`: one
:class:`cache_backends.page_plan.SeqBlocks` per group; a page holds one block of one group's layers, so a group of
fewer layers holds more tokens a page):

* a global group's tables grow as ``full``'s do;
* a sliding group of window ``W`` writes a step's tokens, then keeps only the newest ``W - 1`` (what the next
  token's query sees besides itself); its pages that hold only older tokens go back to the pool at the step's
  commit. A step of ``n`` tokens holds ``W - 1 + n`` while it runs. ``SeqBlocks.first`` is the position of the
  oldest token the group still holds.

Only exact layouts (``full``) keep windows this way; a quantized tier's pages (the oldest tokens, as codes) are not
dropped, so ``int8``/``int4`` keep every token in every layer (and attend through the window). A hybrid layout is
not prefix-cached (a hit would need the sliding groups' last window of blocks as well as every block of the global
group: vLLM's rule, not done here).

Plain Python but for :class:`HybridStepMeta` (torch, through :class:`cache_backends.step_meta.StepMeta`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
        groups: each group's layout (pages of the pool's size; exact layouts only).
        windows: each group's window (``None``: global).
        layers: each group's model layers, in order.

    Raises:
        ValueError: for a group layout with a quantized tier.
    """

    on_demand = False
    cacheable = False  # see the module
    quantization = None

    def __init__(self, groups: list[PageLayout], windows: list[int | None], layers: list[list[int]]):
        if any(g.quantization for g in groups):
            raise ValueError("a hybrid layout keeps windows of exact pages only")
        self.groups, self.windows, self.layers = groups, windows, layers
        self.page_bytes = groups[0].page_bytes
        self.exact_tokens = min(g.exact_tokens for g in groups)
        self.cache_block_tokens = self.exact_tokens
        where = {layer: (g, j) for g, group in enumerate(layers) for j, layer in enumerate(group)}
        self.where = [where[layer] for layer in range(len(where))]  # layer → (group, index in the group)

    # ---- tables ---------------------------------------------------------------------------------------
    def cached_prefix(self, pages: list[int]) -> HybridBlocks:
        """Empty tables (a hybrid layout is not prefix-cached: ``pages`` is always empty)."""
        if pages:
            raise ValueError("hybrid blocks are not prefix-cached")
        return HybridBlocks([SeqBlocks() for _ in self.groups])

    def plan(self, blocks: HybridBlocks, n: int) -> HybridPlan:
        """Each group's pages for ``n`` more tokens; a sliding group's plan also frees, at commit, its front pages
        that hold only tokens older than its window after the step."""
        end = blocks.length + n
        plans = []
        for layout, window, own in zip(self.groups, self.windows, blocks.groups):
            if window is None:
                plans.append(layout.plan(own, n))
                continue
            te = layout.exact_tokens
            keep_from = max(own.first, end - (window - 1))
            need = math.ceil((own.start + own.exact_len + n) / te) - len(own.exact)
            plans.append(Plan(n, 0, max(0, need), 0, (own.start + keep_from - own.first) // te))
        return HybridPlan(n, plans)

    @staticmethod
    def extend(blocks: HybridBlocks, plan: HybridPlan, exact_pages: list[int], q_pages: list[int]) -> None:
        """Add the pages ``plan`` asked for to each group's tables, in group order."""
        e = 0
        for own, p in zip(blocks.groups, plan.groups):
            own.exact.extend(exact_pages[e : e + p.new_exact_pages])
            e += p.new_exact_pages

    def commit(self, blocks: HybridBlocks, plan: HybridPlan, feedback=None) -> list[int]:
        """Apply ``plan`` once the step ran; return the pages no token uses any more (a sliding group's tokens
        older than its window)."""
        end = blocks.length + plan.n
        freed = []
        for layout, window, own, p in zip(self.groups, self.windows, blocks.groups, plan.groups):
            if window is None:
                freed += layout.commit(own, p)
                continue
            drop = max(own.first, end - (window - 1)) - own.first
            own.exact_len += p.n - drop
            own.first += drop
            start = own.start + drop
            freed += own.exact[: p.free_front]
            del own.exact[: p.free_front]
            own.start = start - p.free_front * layout.exact_tokens
        blocks.length = end
        return freed

    # ---- sizes ----------------------------------------------------------------------------------------
    def written(self, start: HybridBlocks, tokens: int) -> HybridBlocks:
        """The tables (null pages) once ``tokens`` more tokens are written after ``start`` (left as it is)."""
        blocks = start.copy()
        if tokens > 0:
            plan = self.plan(blocks, tokens)
            self.extend(blocks, plan, [NULL_PAGE] * plan.new_exact_pages, [])
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
            self.extend(blocks, plan, [NULL_PAGE] * plan.new_exact_pages, [])
            most = max(most, len(blocks.pages()))
            self.commit(blocks, plan)
            left -= n
        return most

    def pages_to_generate(self, prompt: int, total: int, chunk: int | None = None) -> int:
        """At most the pages a sequence holds writing its ``prompt`` in steps of ``chunk``, then one token a step
        until it holds ``total``: the prompt's walk, or every group's most at ``total`` (a sliding group of window
        ``W`` holds at most ``W`` tokens in a decode step, from any slot of its first page on)."""
        most = self.pages_for(prompt, chunk)
        if total <= prompt:
            return most
        end = 0
        for layout, window in zip(self.groups, self.windows):
            te = layout.exact_tokens
            full = math.ceil(total / te)
            end += full if window is None else min(full, math.ceil((te - 1 + window) / te))
        return max(most, end)

    def prefill_pages(self, start: HybridBlocks, tokens: int) -> int:
        """Pages a step writing ``tokens`` tokens after ``start`` holds while it runs."""
        return len(start.pages()) + self.plan(start, tokens).pages_needed

    def transient_pages(self, stored: HybridBlocks, chunk: int) -> int:
        """A bound on the pages a prefill step of ``chunk`` tokens holds above the stored form ``stored``: each
        sliding group's new tokens, held before its window drops the oldest."""
        extra = 0
        for layout, window, own in zip(self.groups, self.windows, stored.groups):
            if window is not None:
                te = layout.exact_tokens
                extra += max(0, math.ceil((te - 1 + own.exact_len + chunk) / te) - len(own.exact))
        return extra

    def stored_bytes(self, blocks: HybridBlocks) -> int:
        """Bytes of the tokens every group holds (each group's layers)."""
        return sum(g.stored_bytes(b) for g, b in zip(self.groups, blocks.groups))

    def used_bytes(self) -> int:
        return min(g.used_bytes() for g in self.groups)

    def tier_tokens(self, blocks: HybridBlocks) -> dict[str, int]:
        """Tokens held, averaged over the layers (a sliding layer's dropped tokens count out), rounded."""
        held = sum(b.exact_len * len(layers) for b, layers in zip(blocks.groups, self.layers))
        return {"exact": round(held / sum(len(layers) for layers in self.layers))}

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
        self.groups = [StepMeta(g, [(b.groups[i], p.groups[i]) for b, p in rows], device)
                       for i, g in enumerate(layout.groups)]
        first = self.groups[0]
        self.query_positions, self.n, self.batch = first.query_positions, first.n, first.batch

    def for_layer(self, layer: int) -> StepMeta:
        """The metadata of the group ``layer`` belongs to."""
        return self.groups[self.layout.where[layer][0]]
