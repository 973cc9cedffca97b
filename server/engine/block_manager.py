"""The KV block manager: which pages of the pool are free, and which sequence holds which (no tensors).

The pool (:class:`cache_backends.pool.KVPool`, owned by the runner) is ``num_pages`` fixed-size pages of
bytes; page 0 is the null page (zeros, never handed out) that pads block tables. This module keeps the
bookkeeping only, as vLLM v1's KV cache manager and nano-vllm's ``BlockManager`` do: a free list,
reference counts, and one :class:`cache_backends.paged.SeqBlocks` (block tables and lengths) per sequence.
"""

from __future__ import annotations

from collections import deque

from cache_backends.paged import NULL_PAGE


class OutOfPages(Exception):
    """Raised by :meth:`BlockManager.allocate` when fewer pages are free than asked for."""


class BlockManager:
    """Free list and reference counts of the pool's pages.

    Args:
        num_pages: pages in the pool, the null page included.

    Attributes:
        num_pages: as given.
        ref: reference count per page (0: free).
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a KV pool needs at least 2 pages (one is the null page); got {num_pages}")
        self.num_pages = num_pages
        self.ref = [0] * num_pages
        self.ref[NULL_PAGE] = 1  # never free
        self._free: deque[int] = deque(p for p in range(num_pages) if p != NULL_PAGE)

    @property
    def usable_pages(self) -> int:
        """Pages a sequence can ever hold (all but the null page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.usable_pages - len(self._free)

    def usage(self) -> float:
        """Pages in use / usable pages, 0-1 (vLLM's ``kv_cache_usage_perc``)."""
        return self.num_used / self.usable_pages

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages (reference count 1 each).

        Raises:
            OutOfPages: fewer than ``n`` pages are free (nothing is taken then).
        """
        if n > len(self._free):
            raise OutOfPages(f"{n} pages wanted, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self.ref[p] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; a page whose count reaches 0 returns to the free list."""
        for p in pages:
            if p == NULL_PAGE or self.ref[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self.ref[p] -= 1
            if self.ref[p] == 0:
                self._free.append(p)
