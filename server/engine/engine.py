"""The engine loop: schedule → run → sample → update → hand each new token to its request.

One background thread owns the model. Between decode steps it drops cancelled sequences (freeing
their KV at once), admits waiting ones (continuous batching), prefills prompts within a per-step token
budget (chunked prefill: a long prompt is spread over several steps), then runs one batched decode
step for every sequence whose prompt is cached. Each new token goes to its request through the
sequence's thread-safe ``emit`` callback. A failure inside one request's prefill fails that request
only; a failure in a batched decode fails the sequences of that batch, and the loop goes on.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time
from collections import deque

import torch

from cache_backends.base import KVBackend
from server.engine.detokenize import IncrementalDetokenizer
from server.engine.runner import ModelRunner
from server.engine.sampling import RowRequest, Sampled, new_generator, prompt_logprobs, sample_batch
from server.engine.scheduler import Scheduler
from server.engine.sequence import FinishReason, Sequence, TokenEvent

log = logging.getLogger("kvserve.engine")


def _malloc_trim():
    """glibc's ``malloc_trim(0)``, or ``None`` elsewhere: hands freed heap pages back to the OS."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc.malloc_trim if libc is not None and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_TRIM = _malloc_trim()


MIN_PREFILL_CHUNK = 64  # prompt tokens a step prefills at least, however many sequences decode


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
            raise ValueError(f"request needs {self.scheduler.reserved_bytes(seq):.0f} KV bytes, more than "
                             f"KV_CACHE_BUDGET_BYTES={self.scheduler.kv_budget_bytes}")
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
                if busy and _TRIM is not None:
                    # Freed KV tensors stay in glibc's arenas otherwise, and the process keeps the
                    # memory of its busiest moment; trimming once per idle spell returns it to the OS.
                    _TRIM(0)
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
        """Drop cancelled sequences, admit new ones, prefill up to the step's token budget (whole prompts
        or chunks of them), then decode every sequence whose prompt is in its cache, once, as a batch."""
        with self._lock:
            for seq in [s for s in self.waiting if s.cancelled]:
                self.waiting.remove(seq)
                self._finish(seq, FinishReason.CANCELLED)
            admitted = self.scheduler.admit(self.waiting, self.running)
        for seq in [s for s in self.running if s.cancelled]:
            self._finish(seq, FinishReason.CANCELLED)
        for seq in admitted:
            self._start(seq)
        decoding = sum(1 for s in self.running if s.prefilled == len(s.prompt_ids))
        prefilled = self._prefill_step(decoding)
        # Measured after prefill too: an int8-family store can be at its largest right after prefill,
        # and shrink in the same step's decode when its residual window drains.
        self._measure([s for s in prefilled if s.store is not None])
        batch = [s for s in self.running if s.finish_reason is None and s.prefilled == len(s.prompt_ids)]
        if batch:
            self._decode(batch)
        self._measure(self.running)
        self._report()

    @staticmethod
    def _measure(seqs: list[Sequence]) -> None:
        """Record each store's bytes now (once per sequence per step) and keep the largest seen: the bytes
        of the cached tokens (``kv_bytes``) and the bytes allocated, free capacity included (``kv_allocated``)."""
        for seq in seqs:
            seq.kv_bytes = seq.store.nbytes()
            seq.kv_allocated = seq.store.allocated_bytes()
            seq.peak_kv_bytes = max(seq.peak_kv_bytes, seq.kv_bytes)

    def _start(self, seq: Sequence) -> None:
        """Give an admitted sequence its KV store (capped at its reservation), generator and detokenizer."""
        seq.store = self.backends[seq.backend_name].new_store()
        seq.store.reserve(self.scheduler.token_budget(seq))
        seq.detok = IncrementalDetokenizer(self.tokenizer, seq.stop, self.special_ids)
        self.running.append(seq)

    def _prefill_step(self, decoding: int) -> list[Sequence]:
        """Prefill waiting prompts in arrival order within this step's token budget; return those written to.

        The budget is ``prefill_chunk_tokens`` less the ``decoding`` sequences' one token each (at least
        :data:`MIN_PREFILL_CHUNK`): a long prompt is written over several steps, each followed by a decode
        step of the running batch, so it does not stall running streams (chunked prefill, as in vLLM's
        scheduler). Prompts that want every position's log-probability, and stores that decide once per
        prompt (``dca``), are prefilled whole.
        """
        chunk = self.scheduler.prefill_chunk_tokens
        budget = None if not chunk else max(MIN_PREFILL_CHUNK, chunk - decoding)
        done: list[Sequence] = []
        for seq in [s for s in self.running if s.prefilled < len(s.prompt_ids)]:
            if budget is not None and budget <= 0:
                break
            done.append(seq)
            left = len(seq.prompt_ids) - seq.prefilled
            whole = budget is None or seq.want_prompt_logprobs or not seq.store.supports_chunked_prefill
            n = left if whole else min(left, budget)
            if budget is not None:
                budget -= n
            self._prefill(seq, n)
        return done

    def _prefill(self, seq: Sequence, n: int) -> None:
        """Write the next ``n`` prompt tokens of ``seq`` into its store; after the last, sample its first token."""
        if seq.times.prefill_start is None:
            seq.times.prefill_start = time.perf_counter()
        try:
            chunk = seq.prompt_ids[seq.prefilled : seq.prefilled + n]
            logits = self.runner.prefill(chunk, seq.store, all_logits=seq.want_prompt_logprobs)
            seq.prefilled += n
            if seq.prefilled < len(seq.prompt_ids):
                return
            if seq.want_prompt_logprobs:
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

    def _decode(self, batch: list[Sequence]) -> None:
        try:
            logits = self.runner.decode([s.output_ids[-1] for s in batch], [s.store for s in batch])
        except Exception as exc:  # noqa: BLE001
            log.exception("decode step failed")
            for seq in batch:
                self._finish(seq, FinishReason.ERROR, error=f"decode failed: {exc}")
            return
        self._accept_batch(batch, logits)

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
            seq.store.release()
            seq.store = None
            seq.kv_bytes = seq.kv_allocated = 0
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
        self.recorder.step_state(self.running, waiting)

    # ---- introspection --------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes allocated by every live sequence's KV store (capacity included: the memory held)."""
        return sum(s.store.allocated_bytes() for s in list(self.running) if s.store is not None)

    def kv_used_bytes(self) -> int:
        """Bytes of the cached tokens of every live sequence (<= :meth:`kv_bytes`)."""
        return sum(s.store.nbytes() for s in list(self.running) if s.store is not None)
