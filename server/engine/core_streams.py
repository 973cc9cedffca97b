"""The HTTP side's request streams, fed from the engine core's outputs (the reader task of
:class:`server.engine.core_client.CoreClient` calls them on the server's event loop).

Each :class:`~server.engine.messages.StepOutput` is replayed into the Prometheus recorder, answers the requests the
core took or refused, and becomes the :class:`~server.engine.sequence.TokenEvent` of each request's new token
(:mod:`server.engine.output_processor`: detokenized, stop strings checked), put in its
:class:`~server.engine.request_state.RequestState`'s queue; a request's ``Finished`` brings its per-request figures.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from server.engine import messages as m
from server.engine import output_processor as output
from server.engine.detokenize import IncrementalDetokenizer
from server.engine.engine import Overloaded
from server.engine.request_state import RequestState
from server.engine.sequence import FinishReason, TokenEvent


@dataclass
class _Live:
    """A request the core has (or is being asked to take): the HTTP side's state, its detokenizer, and the event loop
    its submitter runs on (the reader's)."""

    req: RequestState
    detok: IncrementalDetokenizer
    loop: asyncio.AbstractEventLoop
    answer: asyncio.Future
    abort_sent: bool = False
    stopped: TokenEvent | None = None  # its last event, held until the core's Finished brings its stats


@dataclass(frozen=True)
class _Named:
    """What the recorder reads of a sequence for a counter: its backend."""

    backend_name: str


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    if not fut.done():
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)


class CoreStreams:
    """The requests the core has and what its outputs make of them (the base of
    :class:`~server.engine.core_client.CoreClient`, which sends the messages: :meth:`_send`).

    Attributes:
        recorder: the Prometheus recorder the core's numbers are replayed into (:class:`server.metrics.Recorder`),
            or ``None``.
        special_ids: the tokenizer's special token ids (an event's ``special``).
        last_stats: the core's numbers after its latest step.
    """

    def __init__(self):
        self.recorder = None
        self.special_ids: set[int] = set()
        self.last_stats: m.CoreStats | None = None
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()  # _live, and the send socket (stop() and a drain's wake() may come from threads)

    def _send(self, msg: m.CoreInput) -> None:
        """Send ``msg`` to the core (the caller holds ``self._lock``)."""
        raise NotImplementedError

    def live_requests(self) -> list[RequestState]:
        """The requests submitted and not yet ended (thread-safe: a shutdown's drain reads them)."""
        with self._lock:
            return [e.req for e in self._live.values()]

    def wake(self) -> None:
        """Send an ``Abort`` for every request cancelled since the last call (the core frees their KV at its next
        step; their closing ``cancelled`` events follow). Thread-safe."""
        with self._lock:
            ids = [rid for rid, e in self._live.items() if e.req.cancelled and not e.abort_sent]
            for rid in ids:
                self._live[rid].abort_sent = True
            if ids:
                self._send(m.Abort(ids))

    def _end_all(self, reason: str, exc: BaseException) -> None:
        """The core is gone: every live request's submitter gets ``exc`` and its stream ends, with an ``error`` event
        saying ``reason`` (a stream a stop string ended closes as ``stop_sequence``: its text is whole)."""
        with self._lock:
            live, self._live = list(self._live.values()), {}
        for e in live:
            _resolve(e.answer, exc)
            if e.stopped is not None:  # a stop string ended it: its text is whole, only the core's stats are missing
                self._close(e, e.stopped, FinishReason.STOP)
            else:
                self._close(e, output.end_event(e.req, error=reason), FinishReason.ERROR)

    def _dispatch(self, out: m.StepOutput) -> None:
        """One StepOutput: the metrics first (so that a finished request's KV is off the gauges before its last
        event goes out), answer the adds, then each request's token, then the finished requests."""
        with self._lock:
            live = dict(self._live)
        if out.stats is not None:
            self.last_stats = out.stats
        if self.recorder is not None:
            self._record(out, live)
        for rid in out.accepted:
            if (e := live.get(rid)) is not None:
                _resolve(e.answer, None)
        for r in out.rejected:
            if (e := live.get(r.request_id)) is not None:
                with self._lock:
                    self._live.pop(r.request_id, None)
                exc = Overloaded(r.message) if r.kind == "overloaded" else ValueError(r.message)
                _resolve(e.answer, exc)
        done = {f.request_id: f for f in out.finished}
        for t in out.new:
            e = live.get(t.request_id)
            if e is not None and e.stopped is None:
                self._token(e, t, done.get(t.request_id))
        for f in out.finished:
            e = live.get(f.request_id)
            if e is None:
                continue
            if e.stopped is not None:  # a stop string ended it here; the core's Finished brings its stats
                self._fill(e.req, f)
                self._close(e, e.stopped, FinishReason.STOP)
            elif e.req.finish_reason is None:  # ended without a token this step (cancelled, error)
                self._fill(e.req, f)
                self._close(e, output.end_event(e.req, error=f.error), FinishReason(f.reason))

    def _record(self, out: m.StepOutput, live: dict[str, _Live]) -> None:
        """Replay the core's plain numbers into the Prometheus recorder (:class:`server.metrics.Recorder`)."""
        r = self.recorder
        for c in out.counters:
            seq = _Named(c.backend)
            if c.kind == "prefix_cache":
                r.prefix_cache(seq, c.value, c.hit)
            elif c.kind == "preempted":
                r.preempted(seq)
            else:  # a backend's own count (its declaration's counters read it)
                r.count(seq, c.kind, c.value)
        for rid, start in out.prefilled:
            if (e := live.get(rid)) is not None:
                e.req.times.prefill_start = start
                r.prefill_done(e.req)
        st = out.stats
        if st is not None:
            r.publish(st.rows, {(b, t): n for b, t, n in st.tiers}, st.generated, st.own, st.waiting_by_backend,
                      st.kv_usage, st.evictable_blocks)

    def _token(self, e: _Live, t: m.NewToken, fin: m.Finished | None) -> None:
        """Append, detokenize and emit one token (:mod:`server.engine.output_processor`); end the stream on the core's
        finish (EOS before a stop string, a stop string before ``length``) or on a stop string (then abort in the
        core)."""
        req = e.req
        text = output.add_token(req, e.detok, t.token_id)
        ending = FinishReason(fin.reason) if fin is not None else None
        event, reason = output.token_event(req, e.detok, t.token_id, text, t.logprob, [tuple(p) for p in t.top],
                                           self.special_ids, ending)
        if reason is None:
            req.emit(event)
        elif fin is not None:
            self._fill(req, fin)
            event.error = fin.error
            self._close(e, event, reason)
        else:  # a stop string: hold the last event until the core has freed its KV and sent its stats
            req.finish_reason = reason
            e.stopped = event
            with self._lock:
                e.abort_sent = True
                self._send(m.Abort([req.request_id]))

    @staticmethod
    def _fill(req: RequestState, f: m.Finished) -> None:
        """Copy the core's per-request stats onto the HTTP side's state."""
        req.cached_tokens, req.kv_stored_bytes, req.peak_kv_stored_bytes = f.cached_tokens, f.kv_stored_bytes, f.peak_kv_stored_bytes
        req.kv_stats = dict(f.kv_stats)
        req.prompt_logprobs = f.prompt_logprobs
        req.prompt_top_logprobs = ([None if top is None else [tuple(p) for p in top] for top in f.prompt_top_logprobs]
                                   if f.prompt_top_logprobs is not None else None)
        req.preemptions = f.preemptions
        req.times.prefill_start = f.timings.prefill_start

    def _close(self, e: _Live, last: TokenEvent, reason: FinishReason) -> None:
        """Send ``e``'s closing event and forget it."""
        with self._lock:
            self._live.pop(e.req.request_id, None)
        e.req.finish_reason = reason
        if self.recorder is not None:
            self.recorder.request_done(e.req)
        e.req.emit(output.close_event(last, reason, e.detok))
