"""The engine core: the :class:`~server.engine.engine.Engine` driven by plain messages, in its own process or in
a thread of the HTTP process.

Design (issue 30):

* **Boundary.** The HTTP side sends :class:`~server.engine.messages.AddRequest` (token ids, the plain sampling
  fields, backend, group, cache salt, prompt log-probabilities wanted), :class:`~server.engine.messages.Abort`
  and :class:`~server.engine.messages.Drain` on one ZMQ PUSH socket; the core answers on another with
  :class:`~server.engine.messages.Loading` stages, then :class:`~server.engine.messages.Ready` (or ``Failed``)
  once loaded, then one :class:`~server.engine.messages.StepOutput` per engine step (every request's new token
  id, log-probability and top pairs; the requests finished, with their plain per-request stats; plain KV/queue
  numbers), and one after the inputs read between two steps were accepted or refused. msgpack-encoded msgspec
  Structs (:mod:`server.engine.messages`), as vLLM v1. This is the only path between the HTTP side and the
  engine: the HTTP side's request state (its :class:`~server.engine.sequence.Sequence` objects) and the core's are
  different objects, and nothing mutable is shared between them.
* **Loading.** :func:`~server.engine.core_loading.load_core` loads the model and the backends and builds the
  engine before the loop starts (:func:`load_and_serve`).
* **Where it runs** (``ENGINE_PROCESS``). ``true``, the default: ``python -m server.engine.core`` (:func:`main`),
  over ``ipc://`` sockets; it exits when its parent process is gone (:func:`watch_parent`). ``false``: the
  same :func:`load_and_serve` in a thread of the HTTP process, over ``inproc://`` sockets of the client's ZMQ
  context. :class:`server.engine.core_client.CoreClient` starts either.
* **Who decides what.** EOS and ``max_new_tokens`` are decided here; so is everything of a step: the scheduler
  (:class:`~server.engine.scheduler.Scheduler`) admits, preempts, compresses and chooses the prompt chunks that
  run beside the decode tokens in one forward (a mixed batch). Detokenization, stop strings and streaming stay
  on the HTTP side (:mod:`server.engine.core_client`): when a stop string matches there, it ends the stream and
  sends ``Abort``; a token the core computed meanwhile is dropped. The core's sequences carry a
  :class:`NullDetokenizer`, so no text is made here.
* **The loop.** Between two steps the core reads every input waiting on its socket without blocking (it
  blocks, 100 ms at a time, only while it has nothing to run); an ``Abort`` marks its sequence cancelled, and the
  next step frees its KV before it runs anything else. It ends after a ``Drain`` once nothing is queued or
  running. Each step returns its events (:meth:`~server.engine.engine.Engine.step`), which the loop turns into
  the step's output. A step that raises is logged (the events it made still go out) and the loop goes on; anything
  else that escapes the loop ends the core, which the client reports as its death.
* **Metrics.** The HTTP side owns Prometheus. The core's engine records into a
  :class:`~server.engine.core_recorder.CoreRecorder`, which keeps plain numbers: each step's output carries the
  counted events (prefix-cache lookups, compressions, preemptions), the requests whose prefill finished, and the
  live gauges' numbers (:class:`~server.engine.messages.CoreStats`);
  the client replays them into :class:`server.metrics.Recorder`, and counts each finished request from its
  ``Finished`` and the times it saw (TTFT, ITL: when the tokens reached the HTTP side).
* ``/info``: the core sends its part (model dtype and device, the backends' parameters, quality choices,
  calibration events, KV sizes, the pool's shape) in ``Ready``; the HTTP side adds the settings and limits.
* ``/ui``: the page's routes read the model's config from ``ServerState.model_config``, which ``Ready`` carries.
* **Shutdown.** SIGTERM drains on the HTTP side; at the end the client aborts what is left, sends ``Drain`` and
  waits for the core to end.

Not carried yet: restarting a core that died (the server exits 1 instead).

Run: ``python -m server.engine.core IN_ADDR OUT_ADDR`` with the settings as JSON in ``KVSERVE_CORE_SETTINGS``
(the client, :class:`server.engine.core_client.CoreClient`, starts it so).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import zmq

from server.engine import messages as m
from server.engine.core_loading import load_core
from server.engine.core_recorder import CoreRecorder
from server.engine.engine import Engine, Overloaded
from server.engine.sampling import SamplingParams
from server.engine.sequence import FinishReason, Sequence, TokenEvent

log = logging.getLogger("kvserve.core")

IDLE_POLL_MS = 100
"""How long the loop blocks on its socket while nothing is queued or running (milliseconds)."""


class NullDetokenizer:
    """The detokenizer of a core-side sequence: no text, never a stop (both are the HTTP side's)."""

    stopped = False

    def add(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""

    def generated_text(self) -> str:
        return ""


def sampling_params(s: m.Sampling) -> SamplingParams:
    """The :class:`SamplingParams` of a message's plain fields (inverse of
    :func:`server.engine.core_client.sampling_fields`)."""
    fields = {name: getattr(s, name) for name in s.__struct_fields__}
    fields["logit_bias"] = tuple((int(t), float(b)) for t, b in s.logit_bias)
    return SamplingParams(**fields)


def finished(seq: Sequence, reason: FinishReason, error: str | None) -> m.Finished:
    """The :class:`~server.engine.messages.Finished` of a sequence the engine has just ended."""
    t = seq.times
    return m.Finished(seq.request_id, reason.value, error, cached_tokens=seq.cached_tokens, kv_stored_bytes=seq.kv_stored_bytes,
                      peak_kv_stored_bytes=seq.peak_kv_stored_bytes, kv_stats=dict(seq.kv_stats),
                      prompt_logprobs=seq.prompt_logprobs, prompt_top_logprobs=seq.prompt_top_logprobs,
                      preemptions=seq.preemptions, timings=m.Timings(t.prefill_start, t.first_token, t.last_token))


class EngineCore:
    """An :class:`Engine` fed with :mod:`~server.engine.messages` and stepped by its caller (no thread of its own).

    Args:
        engine: the engine (its thread not started).
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.recorder = engine.recorder = CoreRecorder()
        self.live: dict[str, Sequence] = {}
        self.draining = False
        self._new: list[m.NewToken] = []
        self._finished: list[m.Finished] = []
        self._accepted: list[str] = []
        self._rejected: list[m.Rejected] = []

    @property
    def idle(self) -> bool:
        """Nothing is queued, running or waiting for its grammar."""
        return not self.engine.running and not self.engine.waiting and not self.engine.compiling

    def handle(self, msg: m.CoreInput) -> None:
        """Apply one input: queue an :class:`AddRequest` (its answer goes in the next output), mark the sequences
        of an :class:`Abort` cancelled, or start draining."""
        if isinstance(msg, m.AddRequest):
            self._add(msg)
        elif isinstance(msg, m.Abort):
            for rid in msg.request_ids:
                seq = self.live.get(rid)
                if seq is not None:
                    seq.cancel()
        elif isinstance(msg, m.Drain):
            self.draining = True

    def _add(self, req: m.AddRequest) -> None:
        rid = req.request_id
        if self.draining:
            self._rejected.append(m.Rejected(rid, "draining", "the engine is shutting down"))
            return
        if req.backend not in self.engine.backends or rid in self.live:
            why = f"request id {rid!r} is already live" if rid in self.live else (
                f"KV backend {req.backend!r} is not served here; allowed: {', '.join(self.engine.backends)}")
            self._rejected.append(m.Rejected(rid, "invalid", why))
            return
        seq = Sequence(request_id=rid, prompt_ids=list(req.prompt_ids), max_new_tokens=req.max_new_tokens,
                       params=sampling_params(req.sampling), stop=[], backend_name=req.backend,
                       want_prompt_logprobs=req.want_prompt_logprobs, group=req.group, cache_salt=req.cache_salt)
        seq.detok = NullDetokenizer()
        try:
            self.engine.submit(seq)
        except Overloaded as exc:
            self._rejected.append(m.Rejected(rid, "overloaded", str(exc)))
            return
        except ValueError as exc:
            self._rejected.append(m.Rejected(rid, "invalid", str(exc)))
            return
        self.live[rid] = seq
        self._accepted.append(rid)

    def _collect(self, seq: Sequence, event: TokenEvent) -> None:
        """Put one event of a step (:meth:`Engine.step`) into the step's output."""
        if event.token_id >= 0:
            self._new.append(m.NewToken(seq.request_id, event.token_id, event.logprob,
                                        [tuple(pair) for pair in event.top]))
        if event.finish_reason is not None:
            self.live.pop(seq.request_id, None)
            self._finished.append(finished(seq, event.finish_reason, event.error))

    def stats(self) -> m.CoreStats:
        """The engine's queue and KV numbers now."""
        from server.metrics import live_rows

        e, r = self.engine, self.recorder
        rows, tiers, generated, own = r.state if r.state is not None else live_rows(e.running, e.kv.store)
        waiting = len(e.waiting) + len(e.compiling)  # a grammar's compile is waiting too
        return m.CoreStats(running=len(e.running), waiting=waiting, kv_held_bytes=e.kv_held_bytes(),
                           kv_stored_bytes=e.kv_stored_bytes(), kv_usage=e.kv.usage(),
                           evictable_blocks=e.kv.blocks.num_evictable, rows=rows,
                           tiers=[(b, t, n) for (b, t), n in tiers.items()], generated=generated,
                           waiting_by_backend=dict(r.waiting), own=own)

    def take_output(self, with_stats: bool = True) -> m.StepOutput | None:
        """What was collected since the last call, as one message (``None`` when nothing was)."""
        r = self.recorder
        if not (self._new or self._finished or self._accepted or self._rejected or r.counters or r.prefilled
                or with_stats):
            return None
        out = m.StepOutput(self._new, self._finished, self._accepted, self._rejected,
                           self.stats() if with_stats else None, r.counters, r.prefilled)
        self._new, self._finished, self._accepted, self._rejected = [], [], [], []
        r.counters, r.prefilled, r.state = [], [], None
        return out

    def step(self) -> m.StepOutput:
        """One engine step and its output: its events (:meth:`Engine.step`), then the recorder's figures. A step that
        raises is logged and the loop goes on; the events it made before it raised still go out."""
        try:
            events = self.engine.step()
        except Exception:  # noqa: BLE001 - the loop must survive anything one step does
            log.exception("engine step failed")
            events = self.engine.take_events()
        for seq, event in events:
            self._collect(seq, event)
        return self.take_output()

    def serve(self, inbox: zmq.Socket, outbox: zmq.Socket) -> int:
        """Run until drained (0): read every waiting input, answer the adds, step, send the step's output. (A core
        process whose server is gone is ended by :func:`watch_parent`.)

        Args:
            inbox: a PULL socket of encoded :data:`~server.engine.messages.CoreInput`.
            outbox: a PUSH socket for the encoded outputs.
        """
        import torch

        from server.engine import malloc_tuning

        torch.set_grad_enabled(False)
        poller = zmq.Poller()
        poller.register(inbox, zmq.POLLIN)
        busy = False
        while True:
            if self.idle:
                if busy:
                    malloc_tuning.hand_back()
                busy = False
                if self.draining:
                    return 0
            if poller.poll(0 if not self.idle else IDLE_POLL_MS):
                while True:
                    try:
                        data = inbox.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self.handle(m.decode_input(data))
                    except Exception:  # noqa: BLE001 - a bad message is the sender's bug; the loop goes on
                        log.exception("engine core: bad input message")
                answer = self.take_output(with_stats=False)
                if answer is not None:
                    outbox.send(m.encode(answer))
            if not self.idle:
                busy = True
                outbox.send(m.encode(self.step()))


def load_and_serve(settings, inbox: zmq.Socket, outbox: zmq.Socket) -> int:
    """Load the engine (each :class:`~server.engine.messages.Loading` stage sent on ``outbox``), send ``Ready``
    (or ``Failed``: then 1), and serve (:meth:`EngineCore.serve`) until drained (0).

    Args:
        settings: the server's :class:`~server.config.Settings`.
        inbox: a connected PULL socket of encoded :data:`~server.engine.messages.CoreInput`.
        outbox: a connected PUSH socket for the encoded outputs.

    Raises:
        whatever escapes the loop (a step that raises is logged, not raised).
    """
    try:
        engine, ready = load_core(settings, lambda stage: outbox.send(m.encode(m.Loading(stage))))
    except Exception as exc:  # noqa: BLE001 - told to the server, which says why and exits
        error = " ".join(str(exc).split()) or type(exc).__name__  # the server says "model failed to load: " before
        log.log(logging.ERROR if isinstance(exc, ValueError) else logging.CRITICAL, "model failed to load: %s", error,
                exc_info=not isinstance(exc, ValueError))
        outbox.send(m.encode(m.Failed(error, isinstance(exc, ValueError))))
        return 1
    outbox.send(m.encode(ready))
    started = time.perf_counter()
    code = EngineCore(engine).serve(inbox, outbox)
    log.info("engine core ends after %.0f s", time.perf_counter() - started)
    return code


PARENT_POLL_S = 0.5
"""How often the engine core process looks whether its server process is still there while it loads (seconds)."""
GUARD_GRACE_S = 2.0
"""How long after its server is gone the core's guard process kills a core that has not ended itself (seconds)."""
_guards: list = []  # the guard processes started here (kept: a Popen collected while its process runs warns)


def watch_parent(parent_pid: int) -> threading.Thread:
    """End this process (status 1) once ``parent_pid`` is no longer its parent: the server process is gone, while the
    core is still loading and pricing (minutes) or at any later time (a send to nobody would block at last). A
    daemon thread, started before the load; nothing in the step loop looks.

    A thread runs only while the interpreter lets it: a main thread blocked in a call that keeps the interpreter's
    lock (safetensors opening a named pipe held it until a writer came) stops the watcher too. So a guard process
    (:mod:`server.engine.core_guard`) watches as well, and kills (SIGKILL) a core still there
    :data:`GUARD_GRACE_S` seconds after its server is gone, whatever it is blocked in; it ends with the core."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        log.error("the server process (pid %d) is gone; the engine core exits", parent_pid)
        os._exit(1)

    thread = threading.Thread(target=watch, name="kvserve-core-parent", daemon=True)
    thread.start()
    try:
        _guards.append(subprocess.Popen([sys.executable, "-m", "server.engine.core_guard", str(os.getpid()),
                                         str(parent_pid), str(GUARD_GRACE_S)], stdin=subprocess.DEVNULL))
    except OSError as exc:  # the thread alone still ends the core whenever it can run
        log.warning("cannot start the engine core's guard process (%s); the core ends with its server only when "
                    "it is not blocked", exc)
    return thread


def main(argv: list[str] | None = None) -> int:
    """``python -m server.engine.core IN_ADDR OUT_ADDR``: connect, then :func:`load_and_serve` (watching the parent
    process); the exit status is its answer."""
    from server.config import Settings

    from server.engine.malloc_tuning import keep_step_memory

    in_addr, out_addr = (argv if argv is not None else sys.argv[1:])[:2]
    settings = Settings.model_validate_json(os.environ[m.SETTINGS_ENV])
    keep_step_memory()  # the engine steps on this process's main thread: glibc's thresholds fixed (malloc_tuning)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    watch_parent(int(os.environ.get(m.PARENT_ENV, os.getppid())))
    for sig in (signal.SIGINT, signal.SIGTERM):  # the server drains, then sends Drain (or is gone: watch_parent)
        signal.signal(sig, signal.SIG_IGN)
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(in_addr)
    outbox.connect(out_addr)
    outbox.setsockopt(zmq.LINGER, 2000)
    try:
        return load_and_serve(settings, inbox, outbox)
    finally:
        outbox.close()
        inbox.close(0)


if __name__ == "__main__":
    sys.exit(main())
