"""Admission and preemption: which sequences run, against the batch size and the pool's free pages (no tensors).

A waiting sequence is admitted when the batch has room (``max_batch_size``) and the pages of the tokens it
must prefill — its prompt, or after a preemption its prompt and what it had generated — fit in the free
pages, less a small watermark (1% of the pool) and less what the sequences still prefilling will take.
Nothing is reserved for tokens not yet generated: decode takes a page when a block fills, and when none is
free the engine preempts the most recently admitted sequence (vLLM's recompute preemption): its pages are
freed and it goes back to the front of the queue. Admission is first come, first served; a sequence that
does not fit waits, and those behind it wait too (nothing overtakes it, so nothing starves).
"""

from __future__ import annotations

from collections import deque

from server.engine.kv_cache import KVCacheManager
from server.engine.sequence import Sequence


class Scheduler:
    """FIFO admission against batch size and the pool's free pages; the preemption victim.

    Args:
        max_batch_size: most sequences running at once.
        kv: the KV cache manager (pages).
        prefill_chunk_tokens: most tokens prefilled per engine step (chunked prefill, as vLLM's scheduler
            budgets tokens per step); ``None`` prefills each prompt whole.
    """

    def __init__(self, max_batch_size: int, kv: KVCacheManager, prefill_chunk_tokens: int | None = 256):
        self.max_batch_size = max_batch_size
        self.kv = kv
        self.prefill_chunk_tokens = prefill_chunk_tokens

    def fits_alone(self, seq: Sequence) -> bool:
        """Whether ``seq`` could ever finish (all its tokens fit the pool on their own)."""
        return self.kv.fits_alone(seq)

    def admit(self, waiting: deque[Sequence], running: list[Sequence]) -> list[Sequence]:
        """Pop and return the waiting sequences that may start now (in arrival order)."""
        admitted: list[Sequence] = []
        free = self.kv.blocks.num_free - sum(self.kv.pending(s) for s in running)
        if running:
            free -= self.kv.watermark
        while waiting and len(running) + len(admitted) < self.max_batch_size:
            need = self.kv.admission_cost(waiting[0])
            if need > free:
                break
            free -= need
            admitted.append(waiting.popleft())
        return admitted

    @staticmethod
    def victim(running: list[Sequence]) -> Sequence:
        """The sequence to preempt when pages run out: the most recently admitted."""
        return running[-1]
