"""Admission and preemption: which sequences run, against the batch size and the pool's free pages (no tensors).

A waiting sequence is admitted when the batch has room (``max_batch_size``) and the pages it will hold once
the tokens it must prefill are written — its prompt, or after a preemption its prompt and what it had
generated, in their stored form (:meth:`KVCacheManager.stored_pages`: an int8-family backend's quantized pages
and residual window, not the exact pages a chunk passes through) — fit in the free pages, less a small
watermark (1% of the pool), less what the sequences still prefilling will hold, and less one transient: the
most pages any one prefill step of :data:`server.engine.step_plan.MIN_PREFILL_CHUNK` tokens of the sequences
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
the most recently admitted sequence. A step's prefill tokens are shared the same way: the sequences still
prefilling split the step's budget (:mod:`server.engine.prefill_share`), so a long prompt cannot hold a short one
admitted after it for more than a step, and the step that writes the short prompt's last tokens gives the long one
no more than a step with decode tokens would (:meth:`ChunkBudget.tokens`), so that step costs about what a decode
step beside a chunk costs, not a whole long chunk.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from server.engine.itl_budget import ChunkBudget
from server.engine.prefill_share import prefill_shares
from server.engine.sequence import FinishReason
from server.engine.step_plan import MIN_PREFILL_CHUNK, CompressPlan, RowPlan, SchedulerOutput, snapshot

if TYPE_CHECKING:  # annotations only: the scheduler is plain Python (tests/test_import_graph.py keeps it torch-free)
    from server.engine.kv_cache import KVCacheManager, Reservation
    from server.engine.sequence import Sequence

log = logging.getLogger("kvserve.scheduler")


@dataclass
class StepEvents:
    """What a step's scheduling did that the engine reports (same thread; the runner never sees it).

    Attributes:
        started: ``(sequence, context tokens looked up in the prefix cache, tokens it hit)`` of each admitted one.
        finished: ``(sequence, reason, error, was running)`` of each sequence the scheduler ended (cancelled, or
            too big for the pool alone); its KV is freed already.
        preempted: sequences put back in the queue, their KV freed.
        compressed: ``(sequence, pages freed)`` of each ``elastic`` compression planned.
        avoided: sequences whose compression avoided a preemption (the first of each compression).
    """

    started: list = field(default_factory=list)
    finished: list = field(default_factory=list)
    preempted: list = field(default_factory=list)
    compressed: list = field(default_factory=list)
    avoided: list = field(default_factory=list)


class Scheduler:
    """The step's decisions: FIFO admission against batch size and the pool's free pages, fair share, preemption,
    ``elastic`` compression, the prefill token budget and each chunk's length (:meth:`schedule`); the queues.

    Args:
        max_batch_size: most sequences running at once.
        kv: the KV cache manager (pages).
        prefill_chunk_tokens: most tokens prefilled per engine step (chunked prefill, as vLLM's scheduler
            budgets tokens per step); ``None`` prefills each prompt whole.
        itl: bounds the prefill tokens of a step that carries decode tokens by what steps cost
            (:class:`~server.engine.itl_budget.ChunkBudget`, fed by the engine); ``None``: no bound.
    """

    def __init__(self, max_batch_size: int, kv: KVCacheManager, prefill_chunk_tokens: int | None = 256,
                 itl: ChunkBudget | None = None):
        self.max_batch_size = max_batch_size
        self.kv = kv
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.itl = itl if itl is not None else ChunkBudget(None)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

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

    # ---- one step ---------------------------------------------------------------------------------
    def schedule(self) -> tuple[SchedulerOutput, StepEvents]:
        """Decide one step: drop cancelled sequences (their KV freed at once), preempt for fair share, admit,
        compress ``elastic`` sequences for the queue, reserve a decode token's pages for every sequence whose
        context is cached, then size and reserve the prefill chunks in the pages left (:meth:`_prefill_rows`).

        Returns:
            the rows for the runner (:class:`~server.engine.step_plan.SchedulerOutput`: pages already added to
            each sequence's tables) and what the engine reports (:class:`StepEvents`).
        """
        out, ev = SchedulerOutput(), StepEvents()
        for seq in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(seq)
            self._end(ev, seq, FinishReason.CANCELLED)
        for _ in range(len(self.running)):  # fair share: one preemption at a time, until the waiting request fits
            unfair = self.unfair(self.waiting, self.running)
            if unfair is None:
                break
            self._preempt(ev, unfair, at_head=False)
        admitted = self.admit(self.waiting, self.running)
        if not admitted and not self.running and self.waiting:
            self._end_unadmittable(ev)
        for seq in [s for s in self.running if s.cancelled]:
            self._end(ev, seq, FinishReason.CANCELLED)
        for seq in admitted:
            self._start(ev, seq)
        if self.waiting and len(self.running) < self.max_batch_size:
            # requests wait for pages: elastic sequences compress what they may, so that the next ones fit
            self._compress(out, ev, self.kv.num_pages, avoided=False)
        decoding = [s for s in self.running if s.finish_reason is None and s.decoding]
        # the running streams first (as vLLM's scheduler): a chunk is then sized to the pages they leave
        reserved = []
        for seq in decoding:
            if seq in self.running:  # an earlier one's page may have preempted it
                res = self._reserve(out, ev, seq, 1)
                if res is not None:
                    reserved.append((seq, res))
        chunks = self._prefill_rows(out, ev, len(decoding))
        for seq, n, res, alone, logprobs in chunks:  # a later reservation may have preempted an earlier row
            if seq in self.running:
                out.rows.append(self._row(seq, seq.context_ids[seq.prefilled : seq.prefilled + n], res, False,
                                          seq.prefilled + n == len(seq.context_ids) and not seq.output_ids, alone,
                                          logprobs))
        for seq, res in reserved:
            if seq in self.running:
                out.rows.append(self._row(seq, [seq.output_ids[-1]], res, True, True))
        return out, ev

    def _end_unadmittable(self, ev: StepEvents) -> None:
        """With nothing running, nothing admitted and the pool free, end the first waiting sequence if its admission
        alone needs more pages than the pool has: it could never start, and every sequence behind it would wait for
        it for ever. A request is refused at submission when it could never finish (:meth:`fits_alone`); this is
        the sequence whose recompute after a preemption outgrew the pool (its prompt and generated tokens written
        in one prefill step, as ``snapkv``'s and ``dca``'s are)."""
        seq = self._order(self.waiting, self.running)[0]
        need = self.cost(seq, 0)[0]
        usable = self.kv.blocks.usable_pages
        if need <= usable:
            return
        self.waiting.remove(seq)
        what = (f"recomputing its {len(seq.context_ids)} tokens after a preemption" if seq.output_ids else
                f"its {len(seq.context_ids)} prompt tokens")
        self._end(ev, seq, FinishReason.ERROR, f"{what} needs {need} KV blocks at once; the KV pool has {usable} "
                                               "(KV_CACHE_BUDGET_BYTES)")

    def _row(self, seq: Sequence, tokens: list[int], res: Reservation, decode: bool, sample: bool,
             alone: bool = False, all_logits: bool = False) -> RowPlan:
        """The runner's row for ``seq``'s reservation (the manager's tables as they stand once the step is planned:
        nothing changes them until the row is committed, so they are not copied)."""
        return RowPlan(seq.seq_id, seq.backend_name, tuple(tokens), self.kv.table(seq), res.plan, decode, sample,
                       alone, all_logits)

    def _prefill_rows(self, out: SchedulerOutput, ev: StepEvents, decoding: int) -> list[tuple]:
        """Choose this step's prefill chunks within its token budget, and reserve their pages, in admission order:
        ``(sequence, tokens, reservation, alone, all_logits)``. Prompts that want every position's log-probability
        run whole in a forward of their own (``alone``); ``dca`` prompts, whose layers decide once per prompt, are
        written whole, in the mixed forward.

        The budget is ``prefill_chunk_tokens`` less the ``decoding`` sequences' one token each (at least
        :data:`MIN_PREFILL_CHUNK`), and while sequences decode at most what keeps the step within ``itl``'s ratio of
        a decode step's cost (:meth:`ChunkBudget.tokens`): a long prompt is written over several steps, each
        carrying the running batch's decode tokens in the same forward (chunked prefill in a mixed batch, as vLLM
        v1's scheduler), so it does not stall running streams. The budget is shared between the sequences still
        prefilling (:func:`~server.engine.prefill_share.prefill_shares`: equal shares, a prompt that needs less
        taking only what it needs), so a short prompt admitted behind a long one is written in its first step, not
        after every chunk of the long one; and when the step finishes a prompt beside one it does not, the
        unfinished ones together get at most what a step with decode tokens may prefill (``ChunkBudget.tokens``
        with the finishing prompts as its decode rows), so the short prompt's first token is not held by a whole
        long chunk either (a short request that finishes in a few steps left most steps without a decode row, and
        its first step carried the long prompt's rest of the budget). A prompt written whole takes all its tokens
        when it is served. A paged prompt's step is shortened, down to :data:`MIN_PREFILL_CHUNK` tokens, when the
        pages of a whole one (a quantized prompt's: its exact pages) are not free (:meth:`KVCacheManager.step_tokens`).
        The first chunk of the mixed batch may preempt (:meth:`_reserve`), and so may a prompt that runs alone; a
        later chunk of the mixed batch whose pages are not free waits for the next step, and so does a second prompt
        that runs alone (admission keeps one chunk's transient pages free, not two; a row's drained pages go back
        only when the step is committed).
        """
        chunk = self.prefill_chunk_tokens
        configured = None if not chunk else max(MIN_PREFILL_CHUNK, chunk - decoding)
        budget = self.itl.tokens(decoding, configured)
        bound = self.itl.tokens(max(decoding, 1), configured)  # a prompt finished this step decodes from the next
        prefilling = [s for s in self.running if s.prefilled < len(s.context_ids)]
        shares = prefill_shares([len(s.context_ids) - s.prefilled for s in prefilling], budget, bound) \
            if budget is not None else [None] * len(prefilling)
        chunks: list[tuple] = []
        for seq, share in zip(prefilling, shares):
            if budget is not None and budget <= 0:
                break
            if seq not in self.running or share == 0:  # preempted by an earlier prefill of this step; not served
                continue
            left = len(seq.context_ids) - seq.prefilled
            logprobs = seq.want_prompt_logprobs and not seq.output_ids
            whole = budget is None or logprobs or not self.kv.chunked_prefill(seq)
            n = left if whole else self.kv.step_tokens(seq, min(left, budget, share), self.running)
            alone = logprobs
            if alone and any(c[3] for c in chunks):
                break  # one prompt alone a step: its transient pages go back only once it is committed
            if not alone and any(not c[3] for c in chunks):  # a later chunk of the mixed batch
                res = self.kv.reserve(seq, n)
                if res is None:
                    break
                out.new_pages += res.pages
            else:
                res = self._reserve(out, ev, seq, n)
                if res is None:
                    continue
            if budget is not None:
                budget -= n
            if seq.times.prefill_start is None:
                seq.times.prefill_start = time.perf_counter()
            chunks.append((seq, n, res, alone, logprobs))
        return chunks

    def _reserve(self, out: SchedulerOutput, ev: StepEvents, seq: Sequence, n: int) -> Reservation | None:
        """Pages for ``n`` more tokens of ``seq`` (listed in ``out.new_pages``), compressing ``elastic`` sequences
        and then preempting the most recently admitted sequences while none are free; ``None`` when ``seq`` itself
        had to be preempted or ended (it needs more pages than the pool has)."""
        while True:
            res = self.kv.reserve(seq, n)
            if res is not None:
                out.new_pages += res.pages
                return res
            if self._compress(out, ev, self.kv.pages_needed(seq, n)):
                continue
            if self.running == [seq]:  # alone and still too big (a whole-prompt prefill's exact pages)
                self._end(ev, seq, FinishReason.ERROR, f"{n} tokens at once need more KV blocks than the pool has "
                                                       f"({self.kv.blocks.usable_pages}; KV_CACHE_BUDGET_BYTES)")
                return None
            victim = self.victim(self.running)
            self._preempt(ev, victim)
            if victim is seq:
                return None

    def _compress(self, out: SchedulerOutput, ev: StepEvents, need: int, avoided: bool = True) -> bool:
        """Plan quantizing running ``elastic`` sequences' oldest exact groups until ``need`` pages are free (or
        nothing is left to compress) and commit the plans now (the pages they free are free for this step's
        reservations; the runner re-encodes the groups before anything is written: ``out.compress``); whether
        any page was freed. ``avoided``: instead of preempting (else: to admit)."""
        plans = self.kv.plan_compression(self.running, need)
        if not plans:
            return False
        groups: dict[str, tuple[list, list, list]] = {}
        for seq, res in plans:
            rows, pages, ids = groups.setdefault(seq.backend_name, ([], [], []))
            rows.append((snapshot(self.kv.table(seq)), res.plan))
            pages += res.pages
            ids.append(seq.seq_id)
        out.compress += [CompressPlan(name, tuple(rows), tuple(pages), tuple(ids))
                         for name, (rows, pages, ids) in groups.items()]
        if avoided:
            ev.avoided.append(plans[0][0])
        for seq, res in plans:
            self.kv.commit_compression(seq, res)
            ev.compressed.append((seq, res.plan.free_front - res.plan.new_q_pages))
        return True

    def _start(self, ev: StepEvents, seq: Sequence) -> None:
        """Give an admitted sequence its pages (the prefix cache's hit first) and a place in the batch."""
        queried = len(seq.context_ids) if self.kv.cacheable(seq) else 0
        hit = self.kv.start(seq)
        if seq.preemptions == 0:
            seq.cached_tokens = min(hit, len(seq.prompt_ids))
        self.running.append(seq)
        ev.started.append((seq, queried, hit))

    def _preempt(self, ev: StepEvents, seq: Sequence, at_head: bool = True) -> None:
        """Free every page of ``seq`` and put it back in the queue (at its head, or for the fair share at its
        tail); it recomputes its context (prompt and generated tokens) when readmitted, and its client sees one
        uninterrupted stream."""
        self.running.remove(seq)
        self.drop_kv(seq)
        seq.prefilled = 0
        seq.preemptions += 1
        if at_head:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)
        ev.preempted.append(seq)
        log.info("preempted %s (%d tokens) to free KV pages", seq.request_id, seq.total_tokens)

    def _end(self, ev: StepEvents, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        ev.finished.append((seq, reason, error, self.finish(seq, reason)))

    def finish(self, seq: Sequence, reason: FinishReason) -> bool:
        """End ``seq``: keep its store's last figures (peak bytes, stats, an on-demand tier's compressed share),
        take it out of the batch and free its KV now. Whether it was running."""
        seq.finish_reason = reason
        was_running = seq in self.running
        if was_running:
            self.running.remove(seq)
        store = self.kv.store(seq)
        if store is not None:
            seq.peak_kv_stored_bytes = max(seq.peak_kv_stored_bytes, store.nbytes())
            seq.kv_stats = store.stats()
            layout = self.kv.layouts.get(seq.backend_name)
            if layout is not None and layout.on_demand:
                tiers = self.kv.tier_tokens(seq)
                seq.kv_stats["compressed_fraction"] = tiers[layout.q_tier] / max(1, sum(tiers.values()))
        self.drop_kv(seq, ended=True)
        return was_running

    def drop_kv(self, seq: Sequence, ended: bool = False) -> None:
        """Free ``seq``'s pages now (:meth:`KVCacheManager.release`); ``ended``: the manager forgets it too
        (:meth:`KVCacheManager.forget`), else (a preemption) it keeps its prefix-cache keys for its readmission."""
        if ended:
            self.kv.forget(seq)
        else:
            self.kv.release(seq)
        seq.kv_stored_bytes = seq.kv_held_bytes = 0

    def commit(self, seq: Sequence, row: RowPlan, feedback=None) -> bool:
        """``row`` ran: apply its plan to ``seq``'s tables (freeing the exact pages it drained; registering its full
        blocks in the prefix cache) and count its tokens as cached. Whether it completed ``seq``'s prompt (a
        prefill row that wrote its last token). ``feedback``: what the runner measured for the row
        (:attr:`RunnerOutput.feedback`)."""
        self.kv.commit(seq, row.plan, feedback)
        seq.prefilled += len(row.token_ids)
        return not row.decode and row.sample
