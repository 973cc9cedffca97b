"""Admission and preemption: which sequences run, against the batch size and the pool's free pages (no tensors).

A waiting sequence is admitted when the batch has room (``max_batch_size``) and the pages it will hold once
the tokens it must prefill are written — its prompt, or after a preemption its prompt and what it had
generated, in their stored form (:meth:`KVCacheManager.stored_pages`: an int8-family backend's quantized pages
and residual window, not the exact pages a chunk passes through) — fit in the free pages, less a small
watermark (1% of the pool), less what the sequences still prefilling will hold, and less one transient: the
most pages any one prefill step of :data:`server.engine.kv_cache.MIN_PREFILL_CHUNK` tokens of the sequences
still prefilling (the new one included) holds above its stored form (:meth:`KVCacheManager.transient_pages`,
the step's exact pages until it drains them; the engine shortens a step to that when a longer one's pages are
not free). One suffices, as the engine prefills one sequence at a time and commits its step (freeing its
drained pages) before the next.
Nothing is reserved for tokens not yet generated: decode takes a page when a block fills, and when none is
free the engine preempts a sequence (vLLM's recompute preemption; which one: below): its pages are freed and
it goes back to the front of the queue. Admission is first come, first served; a sequence that
does not fit the free pages waits, and those behind it wait too (nothing overtakes it, so nothing starves).

An ``elastic`` backend compresses instead of making sequences wait: admission also counts the pages that
quantizing the running elastic sequences' compressible groups would free (the engine compresses when a block
is then needed).

Fair share: one HTTP request's generations (``n``, ``best_of``, a prompt list) may hold at most half the
batch's slots while another request waits, and a request that waits with none running takes a slot from the
request holding the most (its newest generation is preempted, and recomputed later), so one wide request
cannot make every later one wait for its whole length. The pool is shared the same way: a request with nothing
running is admitted before the waiting generations of requests that run (a preempted generation of a wide
request does not block it from the head of the queue), and when its pages are not free, a request running two
or more generations on more than its share of the pool (the usable pages split evenly between the requests
running or waiting) gives up its newest one (down to one generation: a single
sequence is never preempted for another, so two long requests cannot evict each other in turn). When pages run
out during a step, the victim is the newest generation of the wide request holding the most pages, or else
the most recently admitted sequence.
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

    def transient(self, running: list[Sequence]) -> int:
        """Pages kept free for the running prefills' steps: the largest :meth:`KVCacheManager.transient_pages`
        among them (one step runs at a time), 0 when none is prefilling."""
        return max((self.kv.transient_pages(s) for s in running), default=0)

    def free_pages(self, running: list[Sequence]) -> int:
        """Pages a newly admitted sequence may hold in stored form: the free ones less what running prefills still
        need (:meth:`KVCacheManager.pending`) and the largest of their transients (:meth:`transient`), less the
        watermark, plus what compressing running ``elastic`` sequences would free. A sequence whose own
        transient exceeds the running ones' takes the difference too (:meth:`cost`)."""
        free = self.kv.blocks.num_free - sum(self.kv.pending(s) for s in running) - self.transient(running)
        if running:
            free -= self.kv.watermark
            free += self.kv.compressible_pages(running)
        return free

    def cost(self, seq: Sequence, transient: int) -> tuple[int, int]:
        """What admitting waiting ``seq`` takes from :meth:`free_pages` while ``transient`` pages are kept for one
        prefill step: its :meth:`KVCacheManager.admission_cost` plus what its own transient adds to ``transient``;
        and the transient kept once it is admitted."""
        need = self.kv.admission_cost(seq)  # first: it looks up seq's prefix-cache hit, which the transient reads
        own = self.kv.transient_pages(seq)
        return need + max(0, own - transient), max(own, transient)

    @staticmethod
    def _order(waiting: deque[Sequence], running: list[Sequence]) -> list[Sequence]:
        """``waiting`` in admission order: the sequences of requests with nothing running first, each part in
        arrival order."""
        held = {s.request_group for s in running}
        return sorted(waiting, key=lambda s: s.request_group in held)  # stable: arrival order within each part

    def admit(self, waiting: deque[Sequence], running: list[Sequence]) -> list[Sequence]:
        """Remove and return the waiting sequences that may start now (requests with nothing running first, then
        arrival order; a sequence whose request holds its fair share already is passed over, and keeps its
        place)."""
        admitted: list[Sequence] = []
        free, transient = self.free_pages(running), self.transient(running)
        share, held = self.share(waiting, running), Counter(s.request_group for s in running)
        for seq in self._order(waiting, running):
            if len(running) + len(admitted) >= self.max_batch_size:
                break
            if held[seq.request_group] >= share:
                continue
            need, after = self.cost(seq, transient)
            if need > free:
                break
            free, transient = free - need, after
            held[seq.request_group] += 1
            waiting.remove(seq)
            admitted.append(seq)
        return admitted

    def unfair(self, waiting: deque[Sequence], running: list[Sequence]) -> Sequence | None:
        """A sequence to preempt so that a waiting request with nothing running can start, or ``None``.

        Slots: when the batch is full and another request holds more than its share of them, that request's
        newest sequence. Pages: when the waiting request's first sequence does not fit the free pages, and a
        request runs two or more sequences on more than its share of the pool (:meth:`page_share`), the newest
        sequence of the one holding the most. The engine preempts one at a time and asks again.
        """
        held = Counter(s.request_group for s in running)
        starved = next((s for s in waiting if held[s.request_group] == 0), None)
        if starved is None or not running:
            return None
        if len(running) >= self.max_batch_size:
            share = self.share(waiting, running)
            over = [s for s in running if held[s.request_group] > share]
            return over[-1] if over else None
        if self.cost(starved, self.transient(running))[0] <= self.free_pages(running):
            return None
        wide = self._widest(running)
        if wide is None or wide[0] <= self.page_share(waiting, running):
            return None
        return wide[1]

    def page_share(self, waiting: deque[Sequence], running: list[Sequence]) -> int:
        """Pages one request may hold while others wait for pages: the pool's usable pages split evenly between
        the requests running or waiting."""
        groups = {s.request_group for s in waiting} | {s.request_group for s in running}
        return self.kv.blocks.usable_pages // max(1, len(groups))

    def _widest(self, running: list[Sequence]) -> tuple[int, Sequence] | None:
        """Among the requests running two or more sequences, the pages held by the one holding the most, and its
        newest sequence; ``None`` when every request runs one sequence."""
        pages: Counter = Counter()
        newest: dict[str, Sequence] = {}
        count: Counter = Counter()
        for s in running:
            pages[s.request_group] += self.kv.held(s)
            count[s.request_group] += 1
            newest[s.request_group] = s
        wide = [(pages[g], g) for g in pages if count[g] > 1]
        if not wide:
            return None
        most, group = max(wide)
        return most, newest[group]

    def victim(self, running: list[Sequence]) -> Sequence:
        """The sequence to preempt when pages run out: the newest sequence of the request running two or more
        that holds the most pages, else the most recently admitted."""
        wide = self._widest(running)
        return wide[1] if wide is not None else running[-1]
