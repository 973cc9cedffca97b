"""The engine step: schedule → run → update → hand each new token to its request.

Its caller steps it on one thread (the engine core's loop, :mod:`server.engine.core`; tests and benchmarks step
it directly), which owns the model. Each step the scheduler (:class:`~server.engine.scheduler.Scheduler`)
decides everything — it drops cancelled sequences (freeing their KV at once), admits waiting ones (continuous
batching), preempts and compresses, and chooses the prompt chunks it prefills within its token budget
(chunked prefill: a long prompt is spread over several steps) beside one decode token of every sequence whose
context is cached — and returns plain rows (:class:`~server.engine.step_plan.SchedulerOutput`). The runner runs
them in one forward (a mixed batch) and samples every row with a token to emit in one call
(:class:`~server.engine.step_plan.RunnerOutput`); the scheduler commits the rows that ran. The step returns its
events as data: each new token and each closing event, with its sequence (:data:`TokenEvents`), in the order they
happened; its caller delivers them (the engine core turns them into the step's output). A
failed forward fails the sequences of its rows (a prompt prefilled in a forward of its own: that request only), a
failed compression the sequences it compressed (their block tables already name its codes), anything else the
runner raises every sequence of the step; each ends with ``error`` and its KV freed, and the engine goes on.

An admitted sequence starts from the longest run of cached blocks its context begins with (the prefix cache,
:mod:`server.engine.kv_cache`). When the pool has no page for a step, the sequences whose layout keeps an
on-demand tier (``on_demand``: exact tokens re-encoded only when the pool runs short) are compressed first, their
oldest exact groups re-encoded; only then is the most recently admitted sequence preempted.

A step that completes the prefill of a prompt of at least
:data:`~server.engine.malloc_tuning.HAND_BACK_PROMPT_TOKENS` tokens hands the memory its chunks left behind back to
the OS (:func:`~server.engine.malloc_tuning.hand_back`): the decode that follows needs little of it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from cache_backends.base import KVBackend
from server.engine import malloc_tuning
from server.engine import output_processor as output
from server.engine.detokenize import IncrementalDetokenizer
from server.engine.grammar import GRAMMAR_FAILED, GrammarError, Grammars
from server.engine.runner import ModelRunner
from server.engine.sampling import RowRequest, Sampled, new_generator
from server.engine.scheduler import Scheduler
from server.engine.sequence import FinishReason, Sequence, TokenEvent
from server.engine.step_plan import RunnerOutput

log = logging.getLogger("kvserve.engine")


TokenEvents = list[tuple[Sequence, TokenEvent]]
"""What one step hands its requests: ``(sequence, event)`` pairs, each token's and each closing one, in order."""


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
        config = getattr(getattr(runner, "model", None), "config", None)
        self.grammars = Grammars(tokenizer, getattr(config, "vocab_size", None) or len(tokenizer), eos_token_ids)
        self.compiling: list[tuple[Sequence, Future]] = []  # sequences whose grammar compiles, not yet queued
        self._events: TokenEvents = []  # the step's events so far (take_events)
        self._compiler: ThreadPoolExecutor | None = None

    @property
    def waiting(self) -> deque[Sequence]:
        """The queue (the scheduler's)."""
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        """The running batch (the scheduler's)."""
        return self.scheduler.running

    # ---- requests -------------------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        """Queue ``seq``.

        Raises:
            Overloaded: when ``max_concurrent_requests`` sequences are already queued or running.
            ValueError: when the sequence could never fit the KV budget.

        A sequence with a grammar is queued once its grammar is compiled, in a thread beside the steps (a large
        schema takes seconds, which would stall every stream); one whose grammar does not compile ends with
        ``error`` at the next step.
        """
        if not self.scheduler.fits_alone(seq):
            need = self.kv.pages_to_finish(seq)
            raise ValueError(f"request needs {need} KV blocks ({need * self.kv.page_bytes} bytes) for "
                             f"{len(seq.prompt_ids) + seq.max_new_tokens} tokens; the KV pool has "
                             f"{self.kv.blocks.usable_pages} (KV_CACHE_BUDGET_BYTES, less the null page)")
        if len(self.waiting) + len(self.running) + len(self.compiling) >= self.max_concurrent_requests:
            raise Overloaded(f"{self.max_concurrent_requests} requests are already queued or running")
        if seq.params.grammar_kind and seq.grammar is None:
            if self._compiler is None:
                self._compiler = ThreadPoolExecutor(1, thread_name_prefix="kvserve-grammar")
            kind, grammar = seq.params.grammar_kind, seq.params.grammar
            self.compiling.append((seq, self._compiler.submit(self.grammars.state, kind, grammar)))
            return
        self.waiting.append(seq)

    def _queue_compiled(self) -> None:
        """Queue the sequences whose grammar is compiled (ending those whose grammar failed); with nothing else to
        do, wait for the first compile a moment rather than spin."""
        if not self.compiling:
            return
        if not self.waiting and not self.running:
            wait([f for _, f in self.compiling], timeout=0.05, return_when=FIRST_COMPLETED)
        still = []
        for seq, future in self.compiling:
            if not future.done():
                still.append((seq, future))
                continue
            try:
                seq.grammar = future.result()
            except Exception as exc:  # noqa: BLE001 - GrammarError, or anything the compiler raised: this request
                reason = exc if isinstance(exc, GrammarError) else repr(exc)
                self._closed(seq, FinishReason.ERROR, False, error=f"the grammar does not compile: {reason}")
                continue
            self.waiting.append(seq)
        self.compiling = still

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> TokenEvents:
        """One step: the scheduler decides it (:meth:`Scheduler.schedule`), the runner runs it
        (:meth:`ModelRunner.execute`: one forward for the prefill chunks and decode tokens, a mixed batch), the
        scheduler commits the rows that ran, and each sampled token becomes its request's event.

        Returns:
            the step's events, in order (for its caller to deliver).

        Raises:
            whatever escapes the step (a bug: a failed forward or compression ends its sequences instead); the events
            it made before are kept for :meth:`take_events`.
        """
        self._queue_compiled()
        out, ev = self.scheduler.schedule()
        try:
            self._report_events(ev)
        finally:  # the step's compressions are committed already: their groups must be re-encoded whatever happens
            if out.rows or out.compress:
                self._execute(out)
        self._measure(self.running)
        self._report()
        return self.take_events()

    def take_events(self) -> TokenEvents:
        """The events made since the last call (those of a step that raised, once it has)."""
        events, self._events = self._events, []
        return events

    def _report_events(self, ev) -> None:
        """What scheduling did, told to the requests and the recorder: first admissions get their detokenizer (first: every running sequence is measurable before a closing event
        measures them); prefix-cache lookups, closing events of the sequences it ended, preemptions,
        compressions."""
        for seq, queried, hit in ev.started:
            if seq.detok is None:
                seq.detok = IncrementalDetokenizer(self.tokenizer, seq.stop, self.special_ids)
            if queried and self.recorder:
                self.recorder.prefix_cache(seq, queried, hit)
        for seq, reason, error, was_running in ev.finished:
            self._closed(seq, reason, was_running, error=error)
        if self.recorder:
            for seq in ev.preempted:
                self.recorder.preempted(seq)
            for seq in ev.avoided:
                self.recorder.count(seq, "preemptions_avoided")
            for seq, freed in ev.compressed:
                self.recorder.count(seq, "compressed_blocks", freed)

    def _execute(self, out) -> None:
        """Run ``out`` (:meth:`ModelRunner.execute`), commit each row that ran, and accept every sampled token; a
        sequence whose forward or compression failed ends with ``error`` (its KV freed), and so does every
        sequence of the step when the runner itself raises."""
        seqs = {s.seq_id: s for s in self.running}
        rows = [(r, seqs[r.seq_id]) for r in out.rows]
        sampling = {}
        for row, seq in rows:
            if row.sample:
                if seq.generator is None and not seq.params.greedy:
                    seq.generator = new_generator(seq.params.seed, self.runner.device)
                allowed = seq.grammar.words if seq.grammar is not None else None
                sampling[seq.seq_id] = RowRequest(seq.params, seq.prompt_ids, seq.output_ids, seq.generator, allowed)
        started = time.perf_counter()
        try:
            result = self.runner.execute(out, self.backends, sampling, self.eos_token_ids)
        except Exception as exc:  # noqa: BLE001 - the step's sequences only; the engine goes on
            log.exception("step failed")
            result = RunnerOutput(failed=dict.fromkeys(out.seq_ids, f"step failed: {exc}"))
        seconds = time.perf_counter() - started
        if out.rows:  # what the step cost, for the prefill budget (PREFILL_ITL_RATIO)
            prefill = sum(len(r.token_ids) for r in out.rows if not r.decode)
            self.scheduler.itl.observe(prefill, len(out.rows) - sum(not r.decode for r in out.rows), seconds)
        self._fail(result.failed)
        ready, long_prompt_done = [], False
        for row, seq in rows:
            if seq.seq_id in result.failed:
                continue
            if self.scheduler.commit(seq, row, result.feedback.get(seq.seq_id)):
                long_prompt_done |= len(seq.prompt_ids) >= malloc_tuning.HAND_BACK_PROMPT_TOKENS
                if self.recorder:
                    self.recorder.prefill_done(seq)
            if seq.seq_id in result.prompt_logprobs:
                seq.prompt_logprobs, seq.prompt_top_logprobs = result.prompt_logprobs[seq.seq_id]
            if row.sample:
                ready.append(seq)
        for seq in ready:
            sampled = result.sampled[seq.seq_id]
            if seq.cancelled:
                self._finish(seq, FinishReason.CANCELLED)
            elif isinstance(sampled, Exception):
                log.error("sampling failed for %s: %r", seq.request_id, sampled)
                self._finish(seq, FinishReason.ERROR, error=f"sampling failed: {sampled}")
            else:
                try:
                    self._accept(seq, sampled)
                except Exception as exc:  # noqa: BLE001 - e.g. detokenization: this request only
                    log.exception("accepting a token failed for %s", seq.request_id)
                    self._finish(seq, FinishReason.ERROR, error=f"token handling failed: {exc}")
        if long_prompt_done:  # its chunks' freed heap and MKL's GEMM buffers, not needed to decode (malloc_tuning);
            malloc_tuning.hand_back()  # after the tokens are out, so that it costs no request its first token's time

    def _fail(self, failed: dict[int, str]) -> None:
        """End each running sequence of ``failed`` (``seq_id`` → why) with ``error``, freeing its KV: its block
        tables may name KV its step never wrote."""
        for seq in [s for s in self.running if s.seq_id in failed]:
            log.error("step failed for %s: %s", seq.request_id, failed[seq.seq_id])
            self._finish(seq, FinishReason.ERROR, error=failed[seq.seq_id])

    def _measure(self, seqs: list[Sequence]) -> None:
        """Record each store's bytes now (once per sequence per step) and keep the largest seen: the bytes
        of the cached tokens (``kv_stored_bytes``) and the bytes of the pages it holds (``kv_held_bytes``)."""
        for seq in seqs:
            seq.kv_stored_bytes = self.kv.store(seq).nbytes()
            seq.kv_held_bytes = self.kv.held_bytes(seq)
            seq.kv_tiers = self.kv.tier_tokens(seq)
            seq.peak_kv_stored_bytes = max(seq.peak_kv_stored_bytes, seq.kv_stored_bytes)

    def _accept(self, seq: Sequence, sampled: Sampled) -> None:
        """Append ``sampled``'s token to ``seq``, make its event, and finish ``seq`` if it is done (the grammar's
        rules and end-of-text here; the rest is :mod:`server.engine.output_processor`'s)."""
        token = sampled.token
        text = output.add_token(seq, seq.detok, token)
        if seq.grammar is not None and not seq.grammar.accept(token):
            raise ValueError(f"{GRAMMAR_FAILED}: {seq.grammar.error or f'token {token} is outside it'}")
        ending = None
        if token in self.eos_token_ids or (seq.grammar is not None and seq.grammar.done):
            ending = FinishReason.EOS  # a grammar that can only end ends the text as end-of-text would
        elif len(seq.output_ids) >= seq.max_new_tokens:
            ending = FinishReason.LENGTH
        event, reason = output.token_event(seq, seq.detok, token, text, sampled.logprob, sampled.top,
                                           self.special_ids, ending)
        if reason is not None:
            self._finish(seq, reason, last=event)
        else:
            self._events.append((seq, event))

    def _finish(self, seq: Sequence, reason: FinishReason, last: TokenEvent | None = None,
                error: str | None = None) -> None:
        """End ``seq``: free its KV now (:meth:`Scheduler.finish`), record its stats, make its closing event."""
        self._closed(seq, reason, self.scheduler.finish(seq, reason), last, error)

    def _closed(self, seq: Sequence, reason: FinishReason, was_running: bool, last: TokenEvent | None = None,
                error: str | None = None) -> None:
        """Record ended ``seq``'s stats and make its closing event (its KV is freed already)."""
        if self.recorder:
            self.recorder.request_done(seq)
        if was_running:
            # The gauges drop this sequence before its last event goes out, so a client that reads
            # /metrics right after its response no longer sees its KV. (A sequence cancelled while
            # queued held no KV: the step's report covers it.)
            # The others are measured again so that bytes and tokens describe the same moment.
            self._measure(self.running)
            self._report(queue=False)
        last = last if last is not None else output.end_event(seq)
        last.error = error
        self._events.append((seq, output.close_event(last, reason, seq.detok)))

    def _report(self, queue: bool = True) -> None:
        """Refresh the live gauges from the running batch and, with ``queue``, the queue lengths."""
        if not self.recorder:
            return
        waiting: dict[str, int] | None = None
        if queue:
            waiting = {}
            for seq in [*self.waiting, *(s for s, _ in self.compiling)]:  # a grammar's compile is waiting too
                waiting[seq.backend_name] = waiting.get(seq.backend_name, 0) + 1
        self.recorder.step_state(self.running, waiting, self.kv.usage(), self.kv.blocks.num_evictable,
                                 store=self.kv.store)

    # ---- introspection --------------------------------------------------------------------------
    def kv_held_bytes(self) -> int:
        """Bytes of the pool's pages in use (the KV memory held)."""
        return self.kv.used_bytes()

    def kv_stored_bytes(self) -> int:
        """Bytes of the cached tokens of every live sequence (<= :meth:`kv_held_bytes`)."""
        stores = [self.kv.store(s) for s in list(self.running)]
        return sum(store.nbytes() for store in stores if store is not None)
