"""The KV pool: one preallocated byte arena of fixed-size pages that every paged backend's blocks are carved from.

``num_pages`` pages of ``page_bytes`` bytes, allocated once at start-up (``torch.empty``: on the CPU the
operating system backs a page with memory only when it is first written). Each served backend reads the
arena through typed views of its own page layout (:class:`cache_backends.paged.PoolViews`), so backends of
different stored forms share one budget: a page holds one block of whichever backend's sequence owns it
(vLLM sizes its pool from ``gpu_memory_utilization``; kvserve from ``KV_CACHE_BUDGET_BYTES``). Page 0 is the
null page (zeros) that pads block tables; a page is zeroed when it is handed out, so the unwritten slots a
padded gather reads are finite.
"""

from __future__ import annotations

import torch

from cache_backends.page_plan import NULL_PAGE
from cache_backends.kv_spec import ALIGN
from cache_backends.page_layout import PageLayout
from cache_backends.paged import PoolViews


class KVPool:
    """The arena and every served backend's views of it.

    Args:
        num_pages: pages (the null page included).
        page_bytes: bytes per page (a multiple of 64).
        layouts: each paged backend's :class:`PageLayout` (or a layout of several groups of pages, ``groups``: dca's
            :class:`cache_backends.dca.plan.DCALayout`), by backend name.
        device: where the arena lives.

    Attributes:
        arena: (num_pages, page_bytes) uint8.
        views: :class:`PoolViews` by backend name (a list of them, one a group, for a layout of groups).
    """

    def __init__(self, num_pages: int, page_bytes: int, layouts: dict[str, PageLayout], device):
        if page_bytes % ALIGN:
            raise ValueError(f"page_bytes={page_bytes} must be a multiple of {ALIGN}")
        self.num_pages, self.page_bytes = num_pages, page_bytes
        self.arena = torch.empty(num_pages, page_bytes, dtype=torch.uint8, device=device)
        self.arena[NULL_PAGE].zero_()
        self.layouts = layouts
        self.views = {name: [PoolViews(self.arena, g) for g in layout.groups] if hasattr(layout, "groups")
                      else PoolViews(self.arena, layout) for name, layout in layouts.items()}

    @property
    def nbytes(self) -> int:
        """Bytes of the arena (num_pages x page_bytes)."""
        return self.num_pages * self.page_bytes

    def zero(self, pages: list[int]) -> None:
        """Zero ``pages`` (newly handed out) in one call, eight bytes at a time where the pages are whole words
        (an index fill over the arena's bytes ran 8x slower: a prefill step zeroes megabytes)."""
        if pages:
            words = self.arena.view(torch.int64) if self.page_bytes % 8 == 0 else self.arena
            words.index_fill_(0, torch.tensor(pages, device=self.arena.device), 0)
