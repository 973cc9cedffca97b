"""Graceful shutdown on SIGTERM (what Kubernetes sends on every rollout), as vLLM and TGI drain.

1. Stop admitting: ``/health`` answers 503 (a readiness probe takes the pod out of its Service) and every new
   generation request gets 503 ``unhealthy``; the listening socket stays open so that both can be said.
2. The generation requests in flight have ``SHUTDOWN_GRACE_SECONDS`` to finish as usual.
3. Those still running then end: each stream gets a last event whose finish reason is ``abort`` (and
   ``data: [DONE]`` on the OpenAI routes); a non-streaming request gets 503. Then uvicorn shuts down.

A second SIGTERM, or SIGINT (Ctrl-C), stops at once (uvicorn's own shutdown). A SIGTERM before the model is served
stops at once too (nothing to drain), exiting 0.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import uvicorn

log = logging.getLogger("kvserve")

LAST_EVENTS_SECONDS = 5.0
"""After the grace period: how long the ended streams have to send their last events before uvicorn stops."""


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on the first SIGTERM (see the module docstring).

    Args:
        config: uvicorn's configuration.
        state: the server state (:class:`server.state.ServerState`: ``draining``, ``in_flight``, ``service``).
        grace_seconds: ``SHUTDOWN_GRACE_SECONDS``.
    """

    def __init__(self, config: uvicorn.Config, state, grace_seconds: float):
        super().__init__(config)
        self.state = state
        self.grace_seconds = grace_seconds
        self.drainer: threading.Thread | None = None
        self.stop_signals: list[int] = []
        """The signals that stopped (or force-stopped) this server, in order; not the first SIGTERM, which drains."""

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and self.drainer is None and self.state.service is not None:
            self.drainer = threading.Thread(target=self.drain, name="kvserve-drain", daemon=True)
            self.drainer.start()
            return
        self.stop_signals.append(sig)
        if sig == signal.SIGTERM and self.drainer is None:
            # before the model is served there is nothing to drain: stop now (the engine core is ended and its
            # sockets' folder removed on the way out) and exit 0, as after a drain, not killed by the SIGTERM uvicorn
            # would raise again once stopped
            self.should_exit = True
            return
        super().handle_exit(sig, frame)

    def drain(self) -> None:
        """Steps 1-3 of the module docstring, then ask uvicorn to stop (blocking; runs in its own thread)."""
        state = self.state
        state.draining = True
        log.info("SIGTERM: draining %d generation requests in flight for up to %.0f s (SHUTDOWN_GRACE_SECONDS)",
                 state.in_flight, self.grace_seconds)
        began = time.monotonic()
        while state.in_flight and time.monotonic() - began < self.grace_seconds:
            time.sleep(0.05)
        if state.in_flight:
            ended = state.service.abort_all()
            log.warning("shutdown: %d generations did not finish within %.0f s; ended with finish_reason abort",
                        ended, self.grace_seconds)
            deadline = time.monotonic() + LAST_EVENTS_SECONDS
            while state.in_flight and time.monotonic() < deadline:
                time.sleep(0.05)
        log.info("shutdown: drained in %.1f s", time.monotonic() - began)
        self.should_exit = True
