"""Admission and preemption: which sequences run, against the batch size and the pool's free pages (no tensors).

A waiting sequence is admitted when the batch has room (``max_batch_size``) and the pages of the tokens it
must prefill — its prompt, or after a preemption its prompt and what it had generated — fit in the free
pages, less a small watermark (1% of the pool) and less what the sequences still prefilling will take.
Nothing is reserved for tokens not yet generated: decode takes a page when a block fills, and when none is
free the engine preempts the most recently admitted sequence (vLLM's recompute preemption): its pages are
freed and it goes back to the front of the queue. Admission is first come, first served; a sequence that
does not fit the free pages waits, and those behind it wait too (nothing overtakes it, so nothing starves).

An ``elastic`` backend compresses instead of making sequences wait: admission also counts the pages that
quantizing the running elastic sequences' compressible groups would free (the engine compresses when a block
is then needed).

Fair share: one HTTP request's generations (``n``, ``best_of``, a prompt list) may hold at most half the
batch's slots while another request waits, and a request that waits with none running takes a slot from the
request holding the most (its newest generation is preempted, and recomputed later), so one wide request
cannot make every later one wait for its whole length.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: admission is plain Python (tests/test_import_graph.py keeps it torch-free)
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

    def share(self, waiting: deque[Sequence], running: list[Sequence]) -> int:
        """Most batch slots one request may hold now: half the batch while two or more requests compete."""
        groups = {s.request_group for s in waiting} | {s.request_group for s in running}
        return self.max_batch_size if len(groups) < 2 else max(1, self.max_batch_size // 2)

    def admit(self, waiting: deque[Sequence], running: list[Sequence]) -> list[Sequence]:
        """Remove and return the waiting sequences that may start now (in arrival order; a sequence whose request
        holds its fair share already is passed over, and keeps its place)."""
        admitted: list[Sequence] = []
        free = self.kv.blocks.num_free - sum(self.kv.pending(s) for s in running)
        if running:
            free -= self.kv.watermark
            free += self.kv.compressible_pages(running)
        share, held = self.share(waiting, running), Counter(s.request_group for s in running)
        for seq in list(waiting):
            if len(running) + len(admitted) >= self.max_batch_size:
                break
            if held[seq.request_group] >= share:
                continue
            need = self.kv.admission_cost(seq)
            if need > free:
                break
            free -= need
            held[seq.request_group] += 1
            waiting.remove(seq)
            admitted.append(seq)
        return admitted

    def unfair(self, waiting: deque[Sequence], running: list[Sequence]) -> Sequence | None:
        """A sequence to preempt so that a waiting request gets a slot: when the batch is full, a waiting request
        has nothing running, and another request holds more than its share, that request's newest sequence."""
        if len(running) < self.max_batch_size or not waiting:
            return None
        held = Counter(s.request_group for s in running)
        if not any(held[s.request_group] == 0 for s in waiting):
            return None
        share = self.share(waiting, running)
        over = [s for s in running if held[s.request_group] > share]
        return over[-1] if over else None

    @staticmethod
    def victim(running: list[Sequence]) -> Sequence:
        """The sequence to preempt when pages run out: the most recently admitted."""
        return running[-1]
