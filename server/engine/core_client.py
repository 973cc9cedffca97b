"""The HTTP side of the engine core (:mod:`server.engine.core`), the one path between the routes and the engine.

:class:`CoreClient` starts the core (its own process, or a thread of this one with ``ENGINE_PROCESS=false``:
:mod:`server.engine.core_host`), sends it :class:`~server.engine.messages.AddRequest` and
:class:`~server.engine.messages.Abort`, and reads its :class:`~server.engine.messages.StepOutput` in an asyncio task
on the server's event loop (:meth:`CoreClient.listen`; :meth:`CoreClient.submit` starts it on its own loop when
none reads yet), which turns them into the :class:`~server.engine.sequence.TokenEvent` stream of each request: it
detokenizes (:class:`~server.engine.detokenize.IncrementalDetokenizer`), checks stop strings (a match ends the
stream and aborts the request in the core) and puts each event in the request's queue
(:attr:`~server.engine.request_state.RequestState.events`). While the core sends nothing the task looks every
:data:`POLL_MS` whether it died or hangs. It offers what :class:`server.service.GenerationService` uses of the
engine: ``backends``, ``special_ids``, ``submit`` (awaitable: the core answers whether it took the request),
``wake`` (sends the aborts of cancelled requests), ``live_requests``, ``recorder`` and ``stop``.

The HTTP side's records are :class:`~server.engine.request_state.RequestState` objects, each owned by the event loop
(the reader task and the routes run there): the core holds its own ``Sequence`` of each request; only messages pass
between them.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable

import zmq

from server.engine import messages as m
from server.engine.core_host import CoreProcess, CoreThread, start_core
from server.engine.core_sockets import new_socket_dir
from server.engine.core_streams import CoreStreams, _Live
from server.engine.detokenize import IncrementalDetokenizer
from server.engine.request_state import RequestState
from server.engine.sampling import SamplingParams

log = logging.getLogger("kvserve.core_client")

READY_TIMEOUT_S = 1800.0
"""Longest wait for the core's ``Ready`` (seconds): loading, calibrating and pricing the backends takes minutes."""
POLL_MS = 100
"""How often the reader task looks whether the core is still alive while it sends nothing (milliseconds)."""
READER = "kvserve-core-reader"
"""The name of the reader task (:meth:`CoreClient.listen`)."""
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


class CoreClient(CoreStreams):
    """The engine core and the per-request streams fed from it (:class:`~server.engine.core_streams.CoreStreams`).

    Args:
        settings: the server's settings (``engine_process``: where the core runs; the core loads from them).
        on_death: called once (from the reader task, on its event loop) with a one-line reason when the core ends
            unasked.
    """

    def __init__(self, settings, on_death: Callable[[str], None] | None = None):
        super().__init__()
        self.settings = settings
        self.on_death = on_death
        self.ready: m.Ready | None = None
        self.backends: dict[str, None] = {}
        self.tokenizer = None
        self.eos_token_ids: set[int] = set()
        self.dead: str | None = None
        self.host: CoreProcess | CoreThread | None = None
        """Where the core runs, once started (:mod:`server.engine.core_host`)."""
        self._life = threading.Lock()  # _starting, _stopping, _shut: start() and stop() come from different threads
        self._starting = False  # start() is under way: it owns the sockets, and stop() leaves the shutdown to it
        self._stopping = False  # stop() was called (the core's end is then asked for, not a death)
        self._shut = False
        self._closed = False
        self._left_running = False  # stop() gave up waiting for a core thread: the reader ends without it
        self._task: asyncio.Task | None = None  # the reader (on the loop that reads the core's outputs)
        self._heard = time.monotonic()  # when the core last sent something (the reader task's)
        self._busy_since: float | None = None  # since when requests have been live without a pause
        self._stopped_since: float | None = None  # since when the core process has been seen stopped
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
        self._rx_fd = self._rx.getsockopt(zmq.FD)  # what the reader task's loop watches
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
        if self.settings.chat_template:  # CHAT_TEMPLATE: in place of the tokenizer's own (vLLM's --chat-template)
            self.tokenizer.chat_template = self.settings.chat_template
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
        return first

    # ---- the reader task -----------------------------------------------------------------------
    def listen(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the core's outputs in a task on ``loop`` (the server's event loop) from now on, so that the core's
        death is seen, and ``/health`` told, while no request runs. Safe from any thread: from another one than
        ``loop``'s, the task starts at ``loop``'s next turn. Nothing once the client is stopped or its core dead.

        Raises:
            RuntimeError: another running event loop reads them (see :meth:`submit`).
        """
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here:
            self._listen_here(loop)
        elif not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closed meanwhile: the server is gone, nothing to read for
                loop.call_soon_threadsafe(self._listen_here, loop)

    def _listen_here(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the reader task on ``loop`` (the running one) unless it runs there; a reader left on a loop that no
        longer runs (a test's earlier ``asyncio.run``) is replaced, and the requests submitted from that loop are
        aborted: nobody reads their events any more."""
        if self._stopping or self._shut or self.dead is not None or self.host is None:
            return
        task = self._task
        if task is not None and not task.done():
            old = task.get_loop()
            if old is loop:
                return
            if old.is_running():
                raise RuntimeError("the engine core's outputs are read on another running event loop")
            if not old.is_closed():
                self._unwatch(old)
                task.cancel()  # its loop is idle: ends when (if ever) it runs again
        with self._lock:
            stale = [rid for rid, e in self._live.items() if e.loop is not loop]
            for rid in stale:
                del self._live[rid]
            if stale:
                self._send(m.Abort(stale))
        self._heard = time.monotonic()
        self._task = loop.create_task(self._read(), name=READER)

    async def _read(self) -> None:
        """The reader: every message the core sent, as it arrives (``loop.add_reader`` on the socket's descriptor);
        after :data:`POLL_MS` of silence, whether the core died or hangs. Ends with the core or the client."""
        loop = asyncio.get_running_loop()
        arrived = asyncio.Event()
        loop.add_reader(self._rx_fd, arrived.set)
        try:
            while not self._closed:
                arrived.clear()  # before reading: a message after the read sets it again
                if self._read_all():
                    await asyncio.sleep(0)  # the streams' consumers run before the next messages are read
                    continue
                try:
                    async with asyncio.timeout(POLL_MS / 1000):
                        await arrived.wait()
                    continue
                except TimeoutError:
                    pass
                if self._quiet():
                    return
        finally:
            self._unwatch(loop)

    def _unwatch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Take the socket's descriptor off ``loop`` (idempotent)."""
        if not self._closed and not loop.is_closed():
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                loop.remove_reader(self._rx_fd)

    def _read_all(self) -> bool:
        """Dispatch every message waiting on the socket (ZMQ's descriptor signals a change, not each message: read
        until ``EVENTS`` has no ``POLLIN``); whether there was one."""
        got = False
        while not self._closed and self._rx.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            raw = self._rx.recv(zmq.NOBLOCK)
            got = True
            self._heard = time.monotonic()
            try:
                out = m.decode_output(raw)
            except Exception:  # noqa: BLE001 - a bad message is the core's bug; the stream goes on
                log.exception("engine core sent a bad message")
                continue
            if isinstance(out, m.StepOutput):
                try:
                    self._dispatch(out)
                except Exception:  # noqa: BLE001 - a bug here must not end the reader, and with it every stream
                    log.exception("the engine core's output could not be dispatched")
        return got

    def _quiet(self) -> bool:
        """The core sent nothing for :data:`POLL_MS`: report its death, or end it if it hangs; whether the reader is
        done (the core ended, or a stop left a core thread running)."""
        ended = self.host.ended()
        if ended is not None and not self._stopping:
            self._died(ended)
        if ended is not None or self._left_running:
            return True
        hung = None if self._stopping else self._hung()
        if hung is not None:
            log.error("%s: ending it", hung)
            if isinstance(self.host, CoreProcess):
                self.host.kill(5.0)  # SIGKILL ends a stopped process too
            self._died(hung)
            return True
        return False

    # ---- requests -------------------------------------------------------------------------------
    def submit(self, req: RequestState) -> asyncio.Future:
        """Send ``req`` to the core; the returned future (on the running loop) resolves once the core took it. Its
        events then arrive in ``req.events``, put there by the reader task, which this starts on the running loop if
        none reads yet (:meth:`listen`).

        The future raises :class:`~server.engine.engine.Overloaded` (the core's queue is full), ``ValueError``
        (it can never fit the KV budget, or the core is draining) or :class:`CoreDied`.

        Raises:
            RuntimeError: no running event loop, or another running loop reads the core's outputs (one loop
                serves a client; a loop that has ended may hand it over to the next).
        """
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if self.dead:
            fut.set_exception(CoreDied(self.dead))
            return fut
        self._listen_here(loop)
        msg = m.AddRequest(req.request_id, req.prompt_ids, req.max_new_tokens, sampling_fields(req.params),
                           req.backend_name,
                           group=req.group, cache_salt=req.cache_salt, want_prompt_logprobs=req.want_prompt_logprobs)
        entry = _Live(req, IncrementalDetokenizer(self.tokenizer, req.stop, self.special_ids), loop, fut)
        fut.add_done_callback(lambda f: self._gave_up(req) if f.cancelled() else None)
        with self._lock:
            self._live[req.request_id] = entry
            self._send(msg)
        return fut

    def _gave_up(self, req: RequestState) -> None:
        """The submitter stopped waiting for the core's answer (its client left): abort the request."""
        req.cancel()
        self.wake()

    def _send(self, msg: m.CoreInput) -> None:
        """Send ``msg`` to the core (the caller holds ``self._lock``); nothing once the sockets are closed, or when
        no core is connected (it died: a send would wait for ever; the reader reports its death)."""
        if not self._closed:
            try:
                self._tx.send(m.encode(msg), zmq.NOBLOCK)
            except zmq.Again:
                log.warning("the engine core is not connected: %s not sent", type(msg).__name__)

    def stop(self, timeout: float = 5.0) -> None:
        """Abort every request, tell the core to drain and wait ``timeout`` seconds for it to end (then kill a
        process; a thread is left to end with this process), end the reader task (on a loop running in another
        thread it reads the core's last outputs first: call this off the loop, as the server's shutdown does); close
        the sockets and remove their folder. Once only;
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
        self._end_reader(timeout)
        with self._lock:
            self._closed = True
            self._tx.close()
        self._rx.close()
        if not self._left_running:  # a core thread left running still holds its sockets in this context
            self._ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _end_reader(self, timeout: float) -> None:
        """Let the reader task end before the sockets close: on a loop running in another thread it ends by itself
        once the core has (within :data:`POLL_MS`, after the core's last outputs; waited for up to ``timeout``
        seconds, then cancelled); on this thread's loop, or one that is not running, it cannot run before the
        sockets close: it is cancelled and its socket taken off the loop here."""
        task = self._task
        if task is None or task.done() or task.get_loop().is_closed():
            return
        loop = task.get_loop()
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here or not loop.is_running():
            self._unwatch(loop)
            task.cancel()
            return
        ended = threading.Event()
        loop.call_soon_threadsafe(task.add_done_callback, lambda _: ended.set())
        if not ended.wait(timeout):
            loop.call_soon_threadsafe(task.cancel)
            if not ended.wait(1.0):
                log.warning("the engine core's reader task did not end; closing its socket beneath it")

    def _at_exit(self) -> None:
        """At this process's exit without :meth:`stop` having ended (a port already taken, an error before the server
        ran, a stop whose wait ran out): end a core process still running (it would end with this process within
        seconds all the same) and remove the sockets' folder."""
        if isinstance(self.host, CoreProcess) and self.host.ended() is None:
            self.host.kill(5.0)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    # ---- what the reader task does with the core's outputs ------------------------------------------
    def _hung(self) -> str | None:
        """Why the core counts as hung, or ``None``: its process has been stopped (SIGSTOP) for
        :data:`STOPPED_GRACE_S` seconds, busy or idle (an idle stopped core would take the next request and never
        answer), or requests are live and it has sent nothing for ``ENGINE_STEP_TIMEOUT_S`` seconds."""
        now = time.monotonic()
        if isinstance(self.host, CoreProcess) and self.host.stopped():
            self._stopped_since = now if self._stopped_since is None else self._stopped_since
            silent = now - max(self._heard, self._stopped_since)
            if silent >= STOPPED_GRACE_S:
                return f"the engine core process is stopped by a signal and has sent nothing for {silent:.0f} s"
        else:
            self._stopped_since = None
        with self._lock:
            busy = bool(self._live)
        if not busy:
            self._busy_since = None
            return None
        if self._busy_since is None:
            self._busy_since = now
        silent = now - max(self._heard, self._busy_since)
        limit = self.settings.engine_step_timeout_s
        if limit and silent >= limit:
            return (f"the engine core finished no step in {silent:.0f} s with requests waiting "
                    f"(ENGINE_STEP_TIMEOUT_S={limit:g}): it is hung")
        return None

    def _died(self, reason: str) -> None:
        """Report ``reason``, then end every live request with an ``error`` event (on the reader's loop)."""
        self.dead = reason
        log.error("%s; ending %d requests", reason, len(self._live))
        if self.on_death is not None:  # first: /health says so before any client sees its error
            self.on_death(reason)
        self._end_all(reason, CoreDied(reason))
