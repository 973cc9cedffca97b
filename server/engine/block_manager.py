"""The KV block manager: which pages of the pool are free, and which sequence holds which (no tensors).

The pool (:class:`cache_backends.pool.KVPool`, owned by the runner) is ``num_pages`` fixed-size pages of
bytes; page 0 is the null page (zeros, never handed out) that pads block tables. This module keeps the
bookkeeping only, as vLLM v1's KV cache manager and nano-vllm's ``BlockManager`` do: a free list,
reference counts, and one :class:`cache_backends.page_plan.SeqBlocks` (block tables and lengths) per sequence.

Prefix cache (vLLM's automatic prefix caching): a full block can be registered under a hash of its content
(:mod:`server.engine.prefix_cache` makes the hashes). When no sequence holds it any more it is not freed but
kept, evictable, least recently released first; a later sequence whose prompt starts with the same blocks
takes them again instead of recomputing them, and :meth:`allocate` evicts the oldest only when no page is
free otherwise.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from cache_backends.page_plan import NULL_PAGE


class OutOfPages(Exception):
    """Raised by :meth:`BlockManager.allocate` when fewer pages are free than asked for."""


class BlockManager:
    """Free list, reference counts and the prefix cache's hash table of the pool's pages.

    Args:
        num_pages: pages in the pool, the null page included.

    Attributes:
        num_pages: as given.
        ref: reference count per page (0: free, or cached and evictable).
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a KV pool needs at least 2 pages (one is the null page); got {num_pages}")
        self.num_pages = num_pages
        self.ref = [0] * num_pages
        self.ref[NULL_PAGE] = 1  # never free
        self._free: deque[int] = deque(p for p in range(num_pages) if p != NULL_PAGE)
        self._page_of: dict[bytes, int] = {}  # block hash -> the page holding that block
        self._hash_of: dict[int, bytes] = {}  # page -> its block hash (registered pages only)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, oldest release first

    @property
    def usable_pages(self) -> int:
        """Pages a sequence can ever hold (all but the null page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages :meth:`allocate` can hand out: free ones and cached ones no sequence holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Pages some sequence holds."""
        return self.usable_pages - self.num_free

    @property
    def num_evictable(self) -> int:
        """Cached pages no sequence holds (reused on a hit, else evicted when pages run out)."""
        return len(self._evictable)

    def usage(self) -> float:
        """Pages held by sequences / usable pages, 0-1 (vLLM's ``kv_cache_usage_perc``: evictable cached pages
        count as free, since :meth:`allocate` takes them back when it needs them)."""
        return self.num_used / self.usable_pages

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages (reference count 1 each): free ones first, then the least recently released cached
        ones (their blocks leave the prefix cache).

        Raises:
            OutOfPages: fewer than ``n`` pages can be had (nothing is taken then).
        """
        if n > self.num_free:
            raise OutOfPages(f"{n} pages wanted, {self.num_free} free")
        pages = []
        for _ in range(n):
            if self._free:
                p = self._free.popleft()
            else:
                p, _ = self._evictable.popitem(last=False)
                del self._page_of[self._hash_of.pop(p)]
            self.ref[p] = 1
            pages.append(p)
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; a page whose count reaches 0 returns to the free list, or, if it holds
        a registered block, stays cached as the most recently released evictable page."""
        for p in pages:
            if p == NULL_PAGE or self.ref[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self.ref[p] -= 1
            if self.ref[p] == 0:
                if p in self._hash_of:
                    self._evictable[p] = None
                else:
                    self._free.append(p)

    # ---- prefix cache ---------------------------------------------------------------------------------
    def register(self, page: int, block_hash: bytes) -> None:
        """Record that held page ``page`` now holds the full block ``block_hash`` (a page already registered,
        or a block another page holds already, is left as it is)."""
        if page in self._hash_of or block_hash in self._page_of:
            return
        self._hash_of[page] = block_hash
        self._page_of[block_hash] = page

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The pages of the longest run of ``hashes`` (a chain, first block first) that the cache holds."""
        pages = []
        for h in hashes:
            p = self._page_of.get(h)
            if p is None:
                break
            pages.append(p)
        return pages

    def cached_page(self, block_hash: bytes) -> int | None:
        """The page that holds block ``block_hash``, or ``None``."""
        return self._page_of.get(block_hash)

    def evictable_among(self, pages: list[int]) -> int:
        """How many of ``pages`` no sequence holds now (taking them lowers :attr:`num_free`)."""
        return sum(1 for p in pages if self.ref[p] == 0)

    def acquire(self, pages: list[int]) -> None:
        """Take one more reference to each cached page of a hit (an evictable one leaves the eviction order)."""
        for p in pages:
            if p not in self._hash_of:
                raise ValueError(f"page {p} holds no cached block")
            if self.ref[p] == 0:
                del self._evictable[p]
            self.ref[p] += 1
