"""The HTTP side of the engine core (:mod:`server.engine.core`), the one path between the routes and the engine.

:class:`CoreClient` starts the core (its own process, or a thread of this one with ``ENGINE_PROCESS=false``:
:mod:`server.engine.core_host`), sends it :class:`~server.engine.messages.AddRequest` and
:class:`~server.engine.messages.Abort`, and runs a reader thread that turns each
:class:`~server.engine.messages.StepOutput` into the :class:`~server.engine.sequence.TokenEvent` stream of each
request: it detokenizes (:class:`~server.engine.detokenize.IncrementalDetokenizer`), checks stop strings (a match
ends the stream and aborts the request in the core) and calls the request's thread-safe ``Sequence.emit``. It
offers what :class:`server.service.GenerationService` uses of the engine: ``backends``, ``special_ids``,
``submit`` (awaitable: the core answers whether it took the request), ``wake`` (sends the aborts of cancelled
sequences), ``recorder`` and ``stop``.

The HTTP side's ``Sequence`` objects are its own: the core holds others; only messages pass between them.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from server.engine import messages as m
from server.engine import output_processor as output
from server.engine.core_host import CoreProcess, CoreThread, start_core
from server.engine.core_sockets import new_socket_dir
from server.engine.detokenize import IncrementalDetokenizer
from server.engine.engine import Overloaded
from server.engine.sampling import SamplingParams
from server.engine.sequence import FinishReason, Sequence, TokenEvent

log = logging.getLogger("kvserve.core_client")

READY_TIMEOUT_S = 1800.0
"""Longest wait for the core's ``Ready`` (seconds): loading, calibrating and pricing the backends takes minutes."""
POLL_MS = 100
"""How often the reader looks whether the core is still alive while it sends nothing (milliseconds)."""
STOPPED_GRACE_S = 5.0
"""How long a busy core process may stay stopped by a signal before it counts as hung (seconds)."""
STOPPED = "the server stopped before the engine core was ready"
""":meth:`CoreClient.start`'s error when :meth:`CoreClient.stop` ended its wait."""
def sampling_fields(p: SamplingParams) -> m.Sampling:
    """The plain fields of ``p`` for an :class:`~server.engine.messages.AddRequest`."""
    fields = {name: getattr(p, name) for name in m.Sampling.__struct_fields__}
    fields["logit_bias"] = [tuple(pair) for pair in p.logit_bias]
    return m.Sampling(**fields)


class CoreDied(RuntimeError):
    """The engine core (its process or its thread) ended while the server needed it."""


class StartStopped(RuntimeError):
    """:meth:`CoreClient.start` ended because :meth:`CoreClient.stop` was called meanwhile (the server is stopping)."""


@dataclass
class _Live:
    """A request the core has (or is being asked to take): the HTTP side's sequence and its detokenizer."""

    seq: Sequence
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


class CoreClient:
    """The engine core and the per-request streams fed from it.

    Args:
        settings: the server's settings (``engine_process``: where the core runs; the core loads from them).
        on_death: called once (from the reader thread) with a one-line reason when the core ends unasked.
    """

    def __init__(self, settings, on_death: Callable[[str], None] | None = None):
        self.settings = settings
        self.on_death = on_death
        self.ready: m.Ready | None = None
        self.backends: dict[str, None] = {}
        self.tokenizer = None
        self.special_ids: set[int] = set()
        self.eos_token_ids: set[int] = set()
        self.recorder = None
        self.last_stats: m.CoreStats | None = None
        """The core's numbers after its latest step."""
        self.dead: str | None = None
        self.host: CoreProcess | CoreThread | None = None
        """Where the core runs, once started (:mod:`server.engine.core_host`)."""
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()  # _live, and the send socket (ZMQ sockets are not thread-safe)
        self._life = threading.Lock()  # _starting, _stopping, _shut: start() and stop() come from different threads
        self._starting = False  # start() is under way: it owns the sockets, and stop() leaves the shutdown to it
        self._stopping = False  # stop() was called (the core's end is then asked for, not a death)
        self._shut = False
        self._closed = False
        self._left_running = False  # stop() gave up waiting for a core thread: the reader ends without it
        self._reader: threading.Thread | None = None
        self._heard = time.monotonic()  # when the core last sent something (the reader thread's)
        self._busy_since: float | None = None  # since when requests have been live without a pause
        # a process connects over ipc:// (a socket file in a folder of its own); a thread over inproc://, in
        # this context, which both share
        self._down = threading.Event()  # set once _shut_down has run (stop() waits for start()'s own shutdown)
        if settings.engine_process:
            self._dir = new_socket_dir()
        else:
            self._dir = None
        base = f"ipc://{self._dir}" if self._dir else f"inproc://kvserve-core-{uuid.uuid4().hex}"
        self._in_addr, self._out_addr = f"{base}/in", f"{base}/out"
        self._ctx = zmq.Context()
        self._tx = self._ctx.socket(zmq.PUSH)
        self._rx = self._ctx.socket(zmq.PULL)
        for sock in (self._tx, self._rx):
            sock.setsockopt(zmq.LINGER, 0)  # never block the exit on messages a dead core will not read
        self._tx.setsockopt(zmq.SNDHWM, 0)  # no limit while the core reads: a send waits only for a missing core
        self._tx.bind(self._in_addr)
        self._rx.bind(self._out_addr)
        atexit.register(self._at_exit)

    # ---- start-up -------------------------------------------------------------------------------
    def start(self, timeout: float = READY_TIMEOUT_S, on_stage=lambda stage: None) -> m.Ready:
        """Start the core, wait for its ``Ready`` and load the tokenizer (blocking); ``on_stage(text)`` is called
        with each :class:`~server.engine.messages.Loading` stage the core reports before. A :meth:`stop` from
        another thread meanwhile ends the wait; on any failure the client is stopped.

        Raises:
            ValueError: the core refused a setting (its message); RuntimeError: it failed to load or ended, was not
                ready in ``timeout`` seconds, or the client was stopped meanwhile.
        """
        with self._life:
            if self._stopping:
                raise StartStopped(STOPPED)
            self._starting = True
        try:
            ready = self._start(timeout, on_stage)
        except BaseException:
            self._started()
            self._shut_down()
            raise
        if self._started():  # stop() came after the wait's last look
            self._shut_down()
            raise StartStopped(STOPPED)
        return ready

    def _started(self) -> bool:
        """End :meth:`start`'s hold on the sockets; whether :meth:`stop` was called meanwhile."""
        with self._life:
            self._starting = False
            return self._stopping

    def _start(self, timeout: float, on_stage) -> m.Ready:
        from transformers import AutoTokenizer

        self.host = start_core(self.settings, self._ctx, self._in_addr, self._out_addr)
        self.tokenizer = AutoTokenizer.from_pretrained(self.settings.model_id)
        deadline = time.monotonic() + timeout
        while True:
            while not self._rx.poll(POLL_MS):
                if self._stopping:
                    raise StartStopped(STOPPED)
                if (ended := self.host.ended()) is not None:
                    raise RuntimeError(f"{ended} before it was ready (its log says why)")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the engine core was not ready in {timeout:.0f} s")
            first = m.decode_output(self._rx.recv())
            if not isinstance(first, m.Loading):
                break
            on_stage(first.stage)
        if isinstance(first, m.Failed):
            self.host.wait(30)
            raise (ValueError if first.invalid_setting else RuntimeError)(first.error)
        if not isinstance(first, m.Ready):
            raise RuntimeError(f"the engine core sent {type(first).__name__} before Ready")
        self.ready = first
        self.backends = dict.fromkeys(first.backends)
        self.eos_token_ids = set(first.eos_token_ids)
        self.special_ids = set(self.tokenizer.all_special_ids) | self.eos_token_ids
        self._reader = threading.Thread(target=self._read, name="kvserve-core-reader", daemon=True)
        self._reader.start()
        return first

    # ---- requests -------------------------------------------------------------------------------
    def submit(self, seq: Sequence) -> asyncio.Future:
        """Send ``seq`` to the core; the returned future (on the running loop) resolves once the core took it.

        The future raises :class:`~server.engine.engine.Overloaded` (the core's queue is full), ``ValueError``
        (it can never fit the KV budget, or the core is draining) or :class:`CoreDied`.
        """
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if self.dead:
            fut.set_exception(CoreDied(self.dead))
            return fut
        msg = m.AddRequest(seq.request_id, seq.prompt_ids, seq.max_new_tokens, sampling_fields(seq.params),
                           seq.backend_name,
                           group=seq.group, cache_salt=seq.cache_salt, want_prompt_logprobs=seq.want_prompt_logprobs)
        entry = _Live(seq, IncrementalDetokenizer(self.tokenizer, seq.stop, self.special_ids), loop, fut)
        fut.add_done_callback(lambda f: self._gave_up(seq) if f.cancelled() else None)
        with self._lock:
            self._live[seq.request_id] = entry
            self._send(msg)
        return fut

    def _gave_up(self, seq: Sequence) -> None:
        """The submitter stopped waiting for the core's answer (its client left): abort the request."""
        seq.cancel()
        self.wake()

    def _send(self, msg: m.CoreInput) -> None:
        """Send ``msg`` to the core (the caller holds ``self._lock``); nothing once the sockets are closed, or when
        no core is connected (it died: a send would wait for ever; the reader reports its death)."""
        if not self._closed:
            try:
                self._tx.send(m.encode(msg), zmq.NOBLOCK)
            except zmq.Again:
                log.warning("the engine core is not connected: %s not sent", type(msg).__name__)

    def wake(self) -> None:
        """Send an ``Abort`` for every sequence cancelled since the last call (the core frees their KV at its next
        step; their closing ``cancelled`` events follow)."""
        with self._lock:
            ids = [rid for rid, e in self._live.items() if e.seq.cancelled and not e.abort_sent]
            for rid in ids:
                self._live[rid].abort_sent = True
            if ids:
                self._send(m.Abort(ids))

    def stop(self, timeout: float = 5.0) -> None:
        """Abort every request, tell the core to drain and wait ``timeout`` seconds for it to end (then kill a
        process; a thread is left to end with this process); close the sockets and remove their folder. Once only;
        while :meth:`start` is under way in another thread, that thread does it when its wait ends (within 0.1 s).
        For a core process this waits for it: a server stopped while its core loads (SIGTERM at start-up) ends only
        once the core has, and leaves no socket folder behind (a core thread ends with the process all the same)."""
        with self._life:
            self._stopping = True
            starting = self._starting
        if starting:
            if self._dir is not None and not self._down.wait(2 * timeout + 5.0):
                log.warning("the engine core's start-up did not end within %.0f s of the stop", 2 * timeout + 5.0)
            return
        self._shut_down(timeout)

    def _shut_down(self, timeout: float = 5.0) -> None:
        """:meth:`stop`'s work, once (the caller owns the sockets)."""
        with self._life:
            if self._shut:
                return
            self._shut = True
        try:
            self._shut_down_once(timeout)
        finally:
            atexit.unregister(self._at_exit)  # stopped: nothing left for the exit to do (and the client is not kept)
            self._down.set()

    def _shut_down_once(self, timeout: float) -> None:
        if self.ready is None and isinstance(self.host, CoreProcess) and self.host.ended() is None:
            self.host.kill(timeout)  # still loading: it reads no Drain before it is ready
        if self.host is not None and self.host.ended() is None:
            with self._lock:
                ids = list(self._live)
                if ids:
                    self._send(m.Abort(ids))
                self._send(m.Drain())
            if not self.host.wait(timeout):
                self.host.kill(timeout)
                self._left_running = self.host.ended() is None
        if self._reader is not None:
            self._reader.join(timeout)
        with self._lock:
            self._closed = True
            self._tx.close()
        self._rx.close()
        if not self._left_running:  # a core thread left running still holds its sockets in this context
            self._ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _at_exit(self) -> None:
        """At this process's exit without :meth:`stop` having ended (a port already taken, an error before the server
        ran, a stop whose wait ran out): end a core process still running (it would end with this process within
        seconds all the same) and remove the sockets' folder."""
        if isinstance(self.host, CoreProcess) and self.host.ended() is None:
            self.host.kill(5.0)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    # ---- the reader thread ----------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            if self._rx.poll(POLL_MS):
                self._heard = time.monotonic()
                try:
                    out = m.decode_output(self._rx.recv())
                except Exception:  # noqa: BLE001 - a bad message is the core's bug; the stream goes on
                    log.exception("engine core sent a bad message")
                    continue
                if isinstance(out, m.StepOutput):
                    self._dispatch(out)
                continue
            ended = self.host.ended()
            if ended is not None and not self._stopping:
                self._died(ended)
            if ended is not None or self._left_running:
                return
            hung = None if self._stopping else self._hung()
            if hung is not None:
                log.error("%s: ending it", hung)
                if isinstance(self.host, CoreProcess):
                    self.host.kill(5.0)  # SIGKILL ends a stopped process too
                self._died(hung)
                return

    def _hung(self) -> str | None:
        """Why the core counts as hung, or ``None``: requests are live and it has sent nothing for
        ``ENGINE_STEP_TIMEOUT_S`` seconds, or for :data:`STOPPED_GRACE_S` while its process is stopped."""
        now = time.monotonic()
        with self._lock:
            busy = bool(self._live)
        if not busy:
            self._busy_since = None
            return None
        if self._busy_since is None:
            self._busy_since = now
        silent = now - max(self._heard, self._busy_since)
        if silent >= STOPPED_GRACE_S and isinstance(self.host, CoreProcess) and self.host.stopped():
            return f"the engine core process is stopped by a signal and has sent nothing for {silent:.0f} s"
        limit = self.settings.engine_step_timeout_s
        if limit and silent >= limit:
            return (f"the engine core finished no step in {silent:.0f} s with requests waiting "
                    f"(ENGINE_STEP_TIMEOUT_S={limit:g}): it is hung")
        return None

    def _died(self, reason: str) -> None:
        """Report ``reason``, then end every live request with an ``error`` event."""
        self.dead = reason
        log.error("%s; ending %d requests", reason, len(self._live))
        if self.on_death is not None:  # first: /health says so before any client sees its error
            self.on_death(reason)
        with self._lock:
            live, self._live = list(self._live.values()), {}
        for e in live:
            e.loop.call_soon_threadsafe(_resolve, e.answer, CoreDied(reason))
            if e.stopped is not None:  # a stop string ended it: its text is whole, only the core's stats are missing
                self._close(e, e.stopped, FinishReason.STOP)
            else:
                self._close(e, output.end_event(e.seq, error=reason), FinishReason.ERROR)

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
                e.loop.call_soon_threadsafe(_resolve, e.answer, None)
        for r in out.rejected:
            if (e := live.get(r.request_id)) is not None:
                with self._lock:
                    self._live.pop(r.request_id, None)
                exc = Overloaded(r.message) if r.kind == "overloaded" else ValueError(r.message)
                e.loop.call_soon_threadsafe(_resolve, e.answer, exc)
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
                self._fill(e.seq, f)
                self._close(e, e.stopped, FinishReason.STOP)
            elif e.seq.finish_reason is None:  # ended without a token this step (cancelled, error)
                self._fill(e.seq, f)
                self._close(e, output.end_event(e.seq, error=f.error), FinishReason(f.reason))

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
                e.seq.times.prefill_start = start
                r.prefill_done(e.seq)
        st = out.stats
        if st is not None:
            r.publish(st.rows, {(b, t): n for b, t, n in st.tiers}, st.generated, st.own, st.waiting_by_backend,
                      st.kv_usage, st.evictable_blocks)

    def _token(self, e: _Live, t: m.NewToken, fin: m.Finished | None) -> None:
        """Append, detokenize and emit one token (:mod:`server.engine.output_processor`); end the stream on the core's
        finish (EOS before a stop string, a stop string before ``length``) or on a stop string (then abort in the
        core)."""
        seq = e.seq
        text = output.add_token(seq, e.detok, t.token_id)
        ending = FinishReason(fin.reason) if fin is not None else None
        event, reason = output.token_event(seq, e.detok, t.token_id, text, t.logprob, [tuple(p) for p in t.top],
                                           self.special_ids, ending)
        if reason is None:
            seq.emit(event)
        elif fin is not None:
            self._fill(seq, fin)
            event.error = fin.error
            self._close(e, event, reason)
        else:  # a stop string: hold the last event until the core has freed its KV and sent its stats
            seq.finish_reason = reason
            e.stopped = event
            with self._lock:
                e.abort_sent = True
                self._send(m.Abort([seq.request_id]))

    @staticmethod
    def _fill(seq: Sequence, f: m.Finished) -> None:
        """Copy the core's per-request stats onto the HTTP side's sequence."""
        seq.cached_tokens, seq.kv_stored_bytes, seq.peak_kv_stored_bytes = f.cached_tokens, f.kv_stored_bytes, f.peak_kv_stored_bytes
        seq.kv_stats = dict(f.kv_stats)
        seq.prompt_logprobs = f.prompt_logprobs
        seq.prompt_top_logprobs = ([None if top is None else [tuple(p) for p in top] for top in f.prompt_top_logprobs]
                                   if f.prompt_top_logprobs is not None else None)
        seq.preemptions = f.preemptions
        seq.times.prefill_start = f.timings.prefill_start

    def _close(self, e: _Live, last: TokenEvent, reason: FinishReason) -> None:
        """Send ``e``'s closing event and forget it."""
        with self._lock:
            self._live.pop(e.seq.request_id, None)
        e.seq.finish_reason = reason
        if self.recorder is not None:
            self.recorder.request_done(e.seq)
        e.seq.emit(output.close_event(last, reason, e.detok))
