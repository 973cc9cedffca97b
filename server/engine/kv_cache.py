"""The KV cache manager: pages for sequences, on demand (no tensors).

It knows each served backend's page layout (:class:`cache_backends.paged.PageLayout`) and the block manager
(free list, reference counts); it plans how many pages a step's tokens need, hands them out, and takes back
those a sequence no longer uses (an int8-family window drained into quantized pages) or all of them (a
sequence that finished or was preempted). Backends without a page layout (``dca``, and ``full`` on a
native-MLA model, which keep per-sequence stores) are charged pages for their store's upper bound at
admission, so every backend draws from the one budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cache_backends.base import KVBackend
from cache_backends.paged import PageLayout, Plan, SeqBlocks
from server.engine.block_manager import BlockManager
from server.engine.sequence import Sequence

WATERMARK = 0.01  # share of the pool admission keeps free for running sequences' next blocks (vLLM's default)


def page_layouts(backends: dict[str, KVBackend], dtype: torch.dtype, block_size: int) -> tuple[int, dict]:
    """The pool's page size and each paged backend's layout.

    The page is ``k`` blocks of ``block_size`` tokens of the costliest served backend's stored form (whole
    quantization groups for int8-family backends); every other backend fills a page with as many of its tokens
    as fit. ``k`` is the smallest of 1-4 whose pages every backend fills to 90% or more (else the fullest): a
    pool serving one backend wastes nothing, and ``full`` beside ``int8`` takes 2-block pages (``int8`` fills
    only 62% of a one-block page, 94% of a two-block page, on the reference model in fp32).

    Returns:
        ``(page_bytes, {name: PageLayout})`` (backends without a layout are left out).
    """
    specs = {n: (b.paged_streams(), b.paged_quantize(), b.geometry.num_layers) for n, b in backends.items()}
    paged = {n: v for n, v in specs.items() if v[0] is not None}
    if not paged:  # per-sequence stores only: pages are an accounting unit of full K/V blocks
        g = next(iter(backends.values())).geometry
        return block_size * g.num_layers * 2 * g.num_key_value_heads * g.head_dim * g.dtype_bytes, {}

    def layouts(k: int) -> tuple[int, dict]:
        page = max(PageLayout.natural_page_bytes(st, layers, dtype, k * block_size, q)
                   for st, q, layers in paged.values())
        page = -(-page // 64) * 64
        return page, {n: PageLayout(st, layers, dtype, page, q) for n, (st, q, layers) in paged.items()}

    def filled(page: int, out: dict) -> float:
        return min(l.used_bytes() / page for l in out.values())

    options = [layouts(k) for k in (1, 2, 3, 4)]
    good = [o for o in options if filled(*o) >= 0.9]
    return good[0] if good else max(options, key=lambda o: filled(*o))


class PagedStore:
    """A paged sequence's view for the engine's measurements and metrics (the tensors are in the pool).

    Args:
        blocks: the sequence's block tables.
        layout: its backend's page layout.
    """

    def __init__(self, blocks: SeqBlocks, layout: PageLayout):
        self.blocks, self.layout = blocks, layout

    def num_tokens(self) -> int:
        return self.blocks.tokens

    def nbytes(self) -> int:
        """Bytes of the cached tokens in their stored form (what the closed formulas count)."""
        return self.layout.stored_bytes(self.blocks)

    def allocated_bytes(self) -> int:
        """Bytes of the pages the sequence holds."""
        return len(self.blocks.pages()) * self.layout.page_bytes

    def stats(self) -> dict:
        return {}

    def release(self) -> None:
        """Nothing to drop here: the manager returns the pages (:meth:`KVCacheManager.release`)."""


@dataclass
class Reservation:
    """Pages handed out to one sequence for one step."""

    plan: Plan
    pages: list[int]


class KVCacheManager:
    """Pages on demand for every sequence, from one pool.

    Args:
        backends: served backends by name.
        layouts: each paged backend's layout (from :func:`page_layouts`).
        page_bytes: bytes per page.
        num_pages: pages in the pool (the null page included).
        prefill_chunk_tokens: the engine's prefill chunk (tokens), for admission's transient pages.
    """

    def __init__(self, backends: dict[str, KVBackend], layouts: dict[str, PageLayout], page_bytes: int,
                 num_pages: int, prefill_chunk_tokens: int | None = None):
        self.backends, self.layouts, self.page_bytes = backends, layouts, page_bytes
        self.blocks = BlockManager(num_pages)
        self.chunk = prefill_chunk_tokens
        self.watermark = max(1, int(WATERMARK * self.blocks.usable_pages))

    @property
    def num_pages(self) -> int:
        return self.blocks.num_pages

    def paged(self, seq: Sequence) -> bool:
        return seq.backend_name in self.layouts

    # ---- costs ----------------------------------------------------------------------------------------
    def pages_for(self, seq: Sequence, tokens: int) -> int:
        """Pages ``seq`` holds with ``tokens`` tokens cached (prefilled in the engine's chunks); for a
        per-sequence store, its upper bound for the whole request."""
        if self.paged(seq):
            return self.layouts[seq.backend_name].pages_for(tokens, self.chunk)
        reserved = self.backends[seq.backend_name].reserved_bytes(len(seq.prompt_ids) + seq.max_new_tokens)
        return math.ceil(reserved / self.page_bytes)

    def fits_alone(self, seq: Sequence) -> bool:
        """Whether ``seq`` could hold all its tokens (prompt + max_new_tokens) with the pool to itself."""
        return self.pages_for(seq, len(seq.prompt_ids) + seq.max_new_tokens) <= self.blocks.usable_pages

    def admission_cost(self, seq: Sequence) -> int:
        """Pages ``seq`` needs to be admitted: those of the tokens it prefills (its prompt, or on readmission
        after a preemption its prompt and the tokens it had generated)."""
        return self.pages_for(seq, len(seq.context_ids))

    def pending(self, seq: Sequence) -> int:
        """Pages a running sequence still needs to finish its prefill (0 once decoding)."""
        if seq.prefilled >= len(seq.context_ids):
            return 0
        return max(0, self.admission_cost(seq) - self.held(seq))

    def held(self, seq: Sequence) -> int:
        """Pages ``seq`` holds now."""
        if seq.blocks is not None:
            return len(seq.blocks.pages())
        return len(seq.kv_pages)

    # ---- life of a sequence ---------------------------------------------------------------------------
    def start(self, seq: Sequence) -> None:
        """Give an admitted sequence its (empty) block tables, or a per-sequence store its pages."""
        if self.paged(seq):
            seq.blocks = SeqBlocks()
            seq.store = PagedStore(seq.blocks, self.layouts[seq.backend_name])
        else:
            seq.kv_pages = self.blocks.allocate(self.pages_for(seq, 0))

    def reserve(self, seq: Sequence, n: int) -> Reservation | None:
        """Pages for writing ``n`` more tokens of ``seq`` (added to its tables now), or ``None`` if too few are
        free (nothing is taken then). A per-sequence store holds its pages from admission: no new ones."""
        if not self.paged(seq):
            return Reservation(Plan(n, 0, 0, 0, 0), [])
        layout = self.layouts[seq.backend_name]
        plan = layout.plan(seq.blocks, n)
        if plan.pages_needed > self.blocks.num_free:
            return None
        exact = self.blocks.allocate(plan.new_exact_pages)
        q = self.blocks.allocate(plan.new_q_pages)
        layout.extend(seq.blocks, plan, exact, q)
        return Reservation(plan, exact + q)

    def commit(self, seq: Sequence, res: Reservation) -> None:
        """The step ran: update ``seq``'s lengths and free the exact pages it drained."""
        if self.paged(seq):
            self.blocks.free(self.layouts[seq.backend_name].commit(seq.blocks, res.plan))

    def release(self, seq: Sequence) -> None:
        """Return every page ``seq`` holds (finished, cancelled or preempted)."""
        if seq.blocks is not None:
            self.blocks.free(seq.blocks.pages())
            seq.blocks = None
        if seq.kv_pages:
            self.blocks.free(seq.kv_pages)
            seq.kv_pages = []

    # ---- figures --------------------------------------------------------------------------------------
    def usage(self) -> float:
        """Pages in use / usable pages, 0-1 (vLLM's ``kv_cache_usage_perc``)."""
        return self.blocks.usage()

    def used_bytes(self) -> int:
        """Bytes of the pages in use."""
        return self.blocks.num_used * self.page_bytes

    def info(self) -> dict:
        """The pool's shape for ``/info`` and the metrics."""
        return {"block_size_tokens": {n: l.exact_tokens if not l.quantize else l.q_tokens
                                      for n, l in self.layouts.items()},
                "page_bytes": self.page_bytes, "num_blocks": self.blocks.usable_pages,
                "pool_bytes": self.num_pages * self.page_bytes}
