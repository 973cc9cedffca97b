"""The engine loop: schedule → run → sample → update → hand each new token to its request.

One background thread owns the model. Between steps it drops cancelled sequences (freeing their KV at
once) and admits waiting ones (continuous batching). A step then runs one forward (a mixed batch) for the
prompt chunks it prefills within its token budget (chunked prefill: a long prompt is spread over several
steps) and one decode token of every sequence whose context is cached, and samples every row with a token
to emit in one call. Each new token goes to its request through the sequence's thread-safe ``emit``
callback. A failed forward fails the sequences of its rows (a prompt prefilled in a forward of its own:
that request only), and the loop goes on.

An admitted sequence starts from the longest run of cached blocks its context begins with (the prefix cache,
:mod:`server.engine.kv_cache`). When the pool has no page for a step, ``elastic`` sequences are compressed
first (their oldest exact groups re-encoded to int8); only then is the most recently admitted sequence
preempted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import torch

from cache_backends.base import KVBackend
from server.engine import allocator
from server.engine.detokenize import IncrementalDetokenizer
from server.engine.kv_cache import MIN_PREFILL_CHUNK
from server.engine.runner import ModelRunner
from server.engine.sampling import RowRequest, Sampled, new_generator, prompt_logprobs, sample_batch
from server.engine.scheduler import Scheduler
from server.engine.sequence import FinishReason, Sequence, TokenEvent

log = logging.getLogger("kvserve.engine")


class Overloaded(Exception):
    """Raised by :meth:`Engine.submit` when ``max_concurrent_requests`` are already queued or running."""


class Engine:
    """Continuous-batching generation over pluggable KV stores.

    Args:
        runner: the model runner.
        backends: KV backends by name (a request names one in ``Sequence.backend_name``).
        tokenizer: the model's tokenizer (for incremental detokenization).
        eos_token_ids: ids that end generation with ``eos_token``.
        scheduler: admission policy.
        max_concurrent_requests: queue + batch capacity; more is refused with :class:`Overloaded`.
        recorder: receives plain stats (``server.metrics.Recorder``), or ``None``.
    """

    def __init__(self, runner: ModelRunner, backends: dict[str, KVBackend], tokenizer, eos_token_ids: set[int],
                 scheduler: Scheduler, max_concurrent_requests: int, recorder=None):
        self.runner = runner
        self.backends = backends
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.special_ids = set(tokenizer.all_special_ids) | eos_token_ids
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.max_concurrent_requests = max_concurrent_requests
        self.recorder = recorder
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- requests -------------------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        """Queue ``seq``.

        Raises:
            Overloaded: when ``max_concurrent_requests`` sequences are already queued or running.
            ValueError: when the sequence could never fit the KV budget.
        """
        if not self.scheduler.fits_alone(seq):
            need = self.kv.pages_to_finish(seq)
            raise ValueError(f"request needs {need} KV blocks ({need * self.kv.page_bytes} bytes) for "
                             f"{len(seq.prompt_ids) + seq.max_new_tokens} tokens; the KV pool has "
                             f"{self.kv.blocks.usable_pages} (KV_CACHE_BUDGET_BYTES, less the null page)")
        with self._lock:
            if len(self.waiting) + len(self.running) >= self.max_concurrent_requests:
                raise Overloaded(f"{self.max_concurrent_requests} requests are already queued or running")
            self.waiting.append(seq)
        self._wake.set()

    def wake(self) -> None:
        """Make the loop look at its queues now (e.g. after a cancellation)."""
        self._wake.set()

    # ---- thread ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        busy = False
        while not self._stop.is_set():
            if not self.running and not self.waiting:
                if busy:
                    allocator.trim()
                busy = False
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            busy = True
            try:
                self.step()
            except Exception:  # noqa: BLE001 - the loop must survive anything one step does
                log.exception("engine step failed")

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> None:
        """Drop cancelled sequences, admit new ones, reserve a decode token's pages for every sequence whose
        context is cached, then prefill chunks up to the step's token budget in the pages left, and run both in
        one forward (a mixed batch)."""
        with self._lock:
            for seq in [s for s in self.waiting if s.cancelled]:
                self.waiting.remove(seq)
                self._finish(seq, FinishReason.CANCELLED)
        for _ in range(len(self.running)):  # fair share: one preemption at a time, until the waiting request fits
            with self._lock:
                unfair = self.scheduler.unfair(self.waiting, self.running)
            if unfair is None:
                break
            self._preempt(unfair, at_head=False)
        with self._lock:
            admitted = self.scheduler.admit(self.waiting, self.running)
        for seq in [s for s in self.running if s.cancelled]:
            self._finish(seq, FinishReason.CANCELLED)
        for seq in admitted:
            self._start(seq)
        if self.waiting and len(self.running) < self.scheduler.max_batch_size:
            # requests wait for pages: elastic sequences compress what they may, so that the next ones fit
            self._compress(self.kv.num_pages, avoided=False)
        decoding = [s for s in self.running if s.finish_reason is None and s.decoding]
        # the running streams first (as vLLM's scheduler): a chunk is then sized to the pages they leave
        reserved = self._reserve_decode(decoding)
        chunks = self._prefill_step(len(decoding))
        decoding = [s for s in decoding if s in self.running]  # a chunk's reservation may preempt one
        chunks = [c for c in chunks if c[0] in self.running]
        if chunks or decoding:
            self._run_step(chunks, decoding, reserved)
        self._measure(self.running)
        self._report()

    def _measure(self, seqs: list[Sequence]) -> None:
        """Record each store's bytes now (once per sequence per step) and keep the largest seen: the bytes
        of the cached tokens (``kv_bytes``) and the bytes of the pages it holds (``kv_allocated``; a per-sequence
        store: the pages charged for its reservation)."""
        for seq in seqs:
            seq.kv_bytes = seq.store.nbytes()
            seq.kv_allocated = self.kv.held_bytes(seq)
            seq.kv_tiers = self.kv.tier_tokens(seq)
            seq.peak_kv_bytes = max(seq.peak_kv_bytes, seq.kv_bytes)

    def _start(self, seq: Sequence) -> None:
        """Give an admitted sequence its pages (the prefix cache's hit first; per-sequence stores: a store capped at
        its reservation), and on its first admission its detokenizer; count its prefix-cache lookup."""
        queried = len(seq.context_ids) if self.kv.cacheable(seq) else 0
        hit = self.kv.start(seq)
        if seq.preemptions == 0:
            seq.cached_tokens = min(hit, len(seq.prompt_ids))
        if queried and self.recorder:
            self.recorder.prefix_cache(seq, queried, hit)
        if not self.kv.paged(seq):
            seq.store = self.backends[seq.backend_name].new_store()
            seq.store.reserve(len(seq.prompt_ids) + seq.max_new_tokens)
        if seq.detok is None:
            seq.detok = IncrementalDetokenizer(self.tokenizer, seq.stop, self.special_ids)
        self.running.append(seq)

    def _preempt(self, seq: Sequence, at_head: bool = True) -> None:
        """Free every page of ``seq`` and put it back in the queue (at its head, or for the fair share at its
        tail); it recomputes its context (prompt and generated tokens) when readmitted, and its client sees one
        uninterrupted stream."""
        self.running.remove(seq)
        self._drop_kv(seq)
        seq.prefilled = 0
        seq.preemptions += 1
        with self._lock:
            if at_head:
                self.waiting.appendleft(seq)
            else:
                self.waiting.append(seq)
        if self.recorder:
            self.recorder.preempted(seq)
        log.info("preempted %s (%d tokens) to free KV pages", seq.request_id, seq.total_tokens)

    def _reserve(self, seq: Sequence, n: int):
        """Pages for ``n`` more tokens of ``seq``, preempting the most recently admitted sequences while none are
        free; ``None`` when ``seq`` itself had to be preempted."""
        while True:
            res = self.kv.reserve(seq, n)
            if res is not None:
                return res
            if self._compress(self.kv.pages_needed(seq, n)):
                continue
            if self.running == [seq]:  # alone and still too big (a whole-prompt prefill's exact pages)
                self._finish(seq, FinishReason.ERROR, error=f"{n} tokens at once need more KV blocks than the pool "
                                                            f"has ({self.kv.blocks.usable_pages}; KV_CACHE_BUDGET_BYTES)")
                return None
            victim = self.scheduler.victim(self.running)
            self._preempt(victim)
            if victim is seq:
                return None

    def _compress(self, need: int, avoided: bool = True) -> bool:
        """Quantize running ``elastic`` sequences' oldest exact groups until ``need`` pages are free (or nothing
        is left to compress); whether any page was freed. ``avoided``: instead of preempting (else: to admit)."""
        plans = self.kv.plan_compression(self.running, need)
        if not plans:
            return False
        groups: dict[str, list] = {}
        for seq, res in plans:
            groups.setdefault(seq.backend_name, []).append((seq.blocks, res.plan))
        self.runner.compress([(self.backends[name], rows) for name, rows in groups.items()],
                             [p for _, res in plans for p in res.pages])
        if self.recorder and avoided:
            self.recorder.preemption_avoided(plans[0][0])
        for seq, res in plans:
            self.kv.commit_compression(seq, res)
            if self.recorder:
                self.recorder.compressed(seq, res.plan.free_front - res.plan.new_q_pages)
        return True

    def _prefill_step(self, decoding: int) -> list[tuple[Sequence, int, object]]:
        """Choose this step's prefill chunks, in admission order within its token budget, and reserve their pages;
        return ``(sequence, tokens, reservation)`` of the chunks that run in the step's forward, beside the decode
        rows. Prompts that want every position's log-probability, and per-sequence stores, are prefilled here in a
        forward of their own: whole, or for a per-sequence store that takes chunks (``full`` on a native-MLA
        model) one chunk; ``dca``, which decides once per prompt, whole.

        The budget is ``prefill_chunk_tokens`` less the ``decoding`` sequences' one token each (at least
        :data:`MIN_PREFILL_CHUNK`): a long prompt is written over several steps, each carrying the running batch's
        decode tokens in the same forward (chunked prefill in a mixed batch, as vLLM v1's scheduler), so it does
        not stall running streams. A paged prompt's step is shortened, down to :data:`MIN_PREFILL_CHUNK` tokens,
        when the pages of a whole one (a quantized prompt's: its exact pages) are not free (:meth:`KVCacheManager.
        step_tokens`). The first chunk of a step may preempt (:meth:`_reserve`); a later one whose pages are not
        free waits for the next step (admission keeps one chunk's transient pages free, not two).
        """
        chunk = self.scheduler.prefill_chunk_tokens
        budget = None if not chunk else max(MIN_PREFILL_CHUNK, chunk - decoding)
        chunks: list[tuple[Sequence, int, object]] = []
        for seq in [s for s in self.running if s.prefilled < len(s.context_ids)]:
            if budget is not None and budget <= 0:
                break
            if seq not in self.running:  # preempted by an earlier prefill of this step
                continue
            left = len(seq.context_ids) - seq.prefilled
            logprobs = seq.want_prompt_logprobs and not seq.output_ids
            paged = self.kv.paged(seq)
            whole = budget is None or logprobs or not (paged or seq.store.supports_chunked_prefill)
            n = left if whole else self.kv.step_tokens(seq, min(left, budget), self.running)
            alone = logprobs or not paged
            if chunks and not alone:
                res = self.kv.reserve(seq, n)
                if res is None:
                    break
            else:
                res = self._reserve(seq, n)
                if res is None:
                    continue
            if budget is not None:
                budget -= n
            if seq.times.prefill_start is None:
                seq.times.prefill_start = time.perf_counter()
            if alone:
                self._prefill(seq, n, res, logprobs)
            else:
                chunks.append((seq, n, res))
        return chunks

    def _prefill(self, seq: Sequence, n: int, res, logprobs: bool) -> None:
        """Write the next ``n`` context tokens of ``seq`` in a forward of their own (a prompt that wants every
        position's log-probability, or a per-sequence store's prompt or chunk); after the last, sample its first
        token."""
        try:
            chunk = seq.context_ids[seq.prefilled : seq.prefilled + n]
            if self.kv.paged(seq):
                logits = self.runner.run_paged([chunk], [(self.backends[seq.backend_name], [0], [(seq.blocks, res.plan)])],
                                               [], res.pages, all_logits=logprobs)
                logits = logits[0] if logprobs else logits  # (n, vocab_size) or (1, vocab_size)
                self.kv.commit(seq, res)
            else:
                logits = self.runner.prefill(chunk, seq.store, all_logits=logprobs)
            seq.prefilled += n
            if seq.prefilled < len(seq.context_ids) or seq.output_ids:
                return
            if logprobs:
                seq.prompt_logprobs, seq.prompt_top_logprobs = prompt_logprobs(logits, seq.prompt_ids,
                                                                               seq.params.top_n)
            logits = logits[-1:]
        except Exception as exc:  # noqa: BLE001
            log.exception("prefill failed for %s", seq.request_id)
            self._finish(seq, FinishReason.ERROR, error=f"prefill failed: {exc}")
            return
        if self.recorder:
            self.recorder.prefill_done(seq)
        self._accept_batch([seq], logits)

    def _reserve_decode(self, batch: list[Sequence]) -> dict:
        """A page for each decoding sequence whose block fills (preempting the newest sequences while none is
        free): ``id(seq)`` → its reservation."""
        reserved = {}
        for seq in batch:
            if seq not in self.running:
                continue
            res = self._reserve(seq, 1)
            if res is not None:
                reserved[id(seq)] = res
        return reserved

    def _run_step(self, chunks: list[tuple[Sequence, int, object]], decoding: list[Sequence], reserved: dict) -> None:
        """One forward for the step's prefill chunks and decode tokens; commit each row's pages, then sample every
        row that has a token to emit (a decode row, or a prompt's last chunk) in one sampler call. A failed
        forward ends the sequences of its rows with ``error``."""
        try:
            logits = self._run_rows(chunks, decoding, reserved)
        except Exception as exc:  # noqa: BLE001
            log.exception("step failed")
            for seq, _, _ in chunks:
                self._finish(seq, FinishReason.ERROR, error=f"prefill failed: {exc}")
            for seq in decoding:
                self._finish(seq, FinishReason.ERROR, error=f"decode failed: {exc}")
            return
        ready, rows = [], []
        for row, (seq, n, res) in enumerate(chunks):
            self.kv.commit(seq, res)
            seq.prefilled += n
            if seq.prefilled == len(seq.context_ids) and not seq.output_ids:
                if self.recorder:
                    self.recorder.prefill_done(seq)
                ready.append(seq)
                rows.append(row)
        for row, seq in enumerate(decoding, start=len(chunks)):
            self.kv.commit(seq, reserved[id(seq)])
            seq.prefilled += 1
            ready.append(seq)
            rows.append(row)
        if ready:
            self._accept_batch(ready, logits if len(rows) == logits.shape[0] else logits[rows])

    def _run_rows(self, chunks: list[tuple[Sequence, int, object]], decoding: list[Sequence],
                  reserved: dict) -> torch.Tensor:
        """(len(chunks) + len(decoding), vocab_size) logits of each row's last token: the prefill chunks (paged) and
        the decode rows that are paged or in-place per-sequence stores in one forward; decode rows of stores that
        return rebuilt K/V (``full`` on a native-MLA model) in a second, padded one."""
        groups: dict[str, tuple[list[int], list]] = {}
        ids, legacy, padded, pages = [], [], [], []
        for row, (seq, n, res) in enumerate(chunks):
            rows, blocks = groups.setdefault(seq.backend_name, ([], []))
            rows.append(row)
            blocks.append((seq.blocks, res.plan))
            pages += res.pages
            ids.append(seq.context_ids[seq.prefilled : seq.prefilled + n])
        for seq in decoding:
            row = len(ids)
            ids.append([seq.output_ids[-1]])
            if self.kv.paged(seq):
                rows, blocks = groups.setdefault(seq.backend_name, ([], []))
                rows.append(row)
                blocks.append((seq.blocks, reserved[id(seq)].plan))
                pages += reserved[id(seq)].pages
            elif seq.store.in_place:
                legacy.append((row, seq.store))
            else:
                padded.append(row)
        apart = set(padded)
        shared = [r for r in range(len(ids)) if r not in apart]
        logits = None
        if groups or legacy:
            if padded:  # renumber the shared forward's rows
                where = {r: i for i, r in enumerate(shared)}
                groups = {name: ([where[r] for r in rows], blocks) for name, (rows, blocks) in groups.items()}
                legacy = [(where[r], store) for r, store in legacy]
            out = self.runner.run_paged(
                [ids[r] for r in shared],
                [(self.backends[name], rows, blocks) for name, (rows, blocks) in groups.items()], legacy, pages)
            if not padded:
                return out
            logits = out.new_empty(len(ids), out.shape[-1])
            logits[shared] = out
        if padded:
            out = self.runner.decode([ids[r][0] for r in padded], [decoding[r - len(chunks)].store for r in padded])
            if logits is None:
                return out
            logits[padded] = out
        return logits

    def _accept_batch(self, batch: list[Sequence], logits: torch.Tensor) -> None:
        """Sample one token for every sequence of ``batch`` from ``logits`` (batch, vocab_size) in one
        batched sampler call, emit each, and finish the sequences that are done.

        A cancelled sequence is finished without a token; a row whose sampling fails finishes with
        ``error`` and the other rows get their token as usual.
        """
        live = []
        for row, seq in enumerate(batch):
            if seq.cancelled:
                self._finish(seq, FinishReason.CANCELLED)
            else:
                live.append(row)
        if not live:
            return
        if len(live) < len(batch):
            logits = logits[live]
        seqs = [batch[row] for row in live]
        for seq in seqs:
            if seq.generator is None and not seq.params.greedy:
                seq.generator = new_generator(seq.params.seed, logits.device)
        rows = [RowRequest(s.params, s.prompt_ids, s.output_ids, s.generator) for s in seqs]
        for seq, result in zip(seqs, sample_batch(logits, rows, self.eos_token_ids)):
            if isinstance(result, Exception):
                log.error("sampling failed for %s: %r", seq.request_id, result)
                self._finish(seq, FinishReason.ERROR, error=f"sampling failed: {result}")
                continue
            try:
                self._accept(seq, result)
            except Exception as exc:  # noqa: BLE001 - e.g. detokenization: this request only
                log.exception("accepting a token failed for %s", seq.request_id)
                self._finish(seq, FinishReason.ERROR, error=f"token handling failed: {exc}")

    def _accept(self, seq: Sequence, sampled: Sampled) -> None:
        """Append ``sampled``'s token to ``seq``, emit it, and finish ``seq`` if it is done."""
        token = sampled.token
        now = time.perf_counter()
        seq.output_ids.append(token)
        seq.times.token_times.append(now)
        seq.times.first_token = seq.times.first_token or now
        seq.times.last_token = now
        text = seq.detok.add(token)
        reason = None
        if token in self.eos_token_ids:
            reason = FinishReason.EOS
        elif seq.detok.stopped:
            reason = FinishReason.STOP
        elif len(seq.output_ids) >= seq.max_new_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            text += seq.detok.flush()
        event = TokenEvent(index=len(seq.output_ids) - 1, token_id=token, text=text, logprob=sampled.logprob,
                           special=token in self.special_ids, top=sampled.top)
        if reason is not None:
            self._finish(seq, reason, last=event)
        else:
            seq.emit(event)

    def _finish(self, seq: Sequence, reason: FinishReason, last: TokenEvent | None = None,
                error: str | None = None) -> None:
        """End ``seq``: free its KV now, record its stats, send the closing event."""
        seq.finish_reason = reason
        was_running = seq in self.running
        if was_running:
            self.running.remove(seq)
        if seq.store is not None:
            seq.peak_kv_bytes = max(seq.peak_kv_bytes, seq.store.nbytes())
            seq.kv_stats = seq.store.stats()
            layout = self.kv.layouts.get(seq.backend_name)
            if layout is not None and layout.on_demand:
                tiers = self.kv.tier_tokens(seq)
                seq.kv_stats["compressed_fraction"] = tiers[layout.q_tier] / max(1, sum(tiers.values()))
        self._drop_kv(seq)
        if self.recorder:
            self.recorder.request_done(seq)
        if was_running:
            # The gauges drop this sequence before its last event goes out, so a client that reads
            # /metrics right after its response no longer sees its KV. (A sequence cancelled while
            # queued is finished under self._lock and held no KV: the step's report covers it.)
            # The others are measured again so that bytes and tokens describe the same moment.
            self._measure(self.running)
            self._report(queue=False)
        if last is None:
            last = TokenEvent(index=len(seq.output_ids), token_id=-1, text="", logprob=0.0, special=True)
        last.finish_reason = reason
        last.error = error
        last.generated_text = seq.detok.generated_text() if seq.detok else ""
        seq.emit(last)

    def _drop_kv(self, seq: Sequence) -> None:
        """Free ``seq``'s pages and store now."""
        if seq.store is not None:
            seq.store.release()
            seq.store = None
        self.kv.release(seq)
        seq.kv_bytes = seq.kv_allocated = 0

    def _report(self, queue: bool = True) -> None:
        """Refresh the live gauges from the running batch and, with ``queue``, the queue lengths
        (which takes ``self._lock``: the caller must not hold it then)."""
        if not self.recorder:
            return
        waiting: dict[str, int] | None = None
        if queue:
            waiting = {}
            with self._lock:
                for seq in self.waiting:
                    waiting[seq.backend_name] = waiting.get(seq.backend_name, 0) + 1
        self.recorder.step_state(self.running, waiting, self.kv.usage(), self.kv.blocks.num_evictable)

    # ---- introspection --------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes of the pool's pages in use (the KV memory held, per-sequence stores' reservations included)."""
        return self.kv.used_bytes()

    def kv_used_bytes(self) -> int:
        """Bytes of the cached tokens of every live sequence (<= :meth:`kv_bytes`)."""
        return sum(s.store.nbytes() for s in list(self.running) if s.store is not None)
