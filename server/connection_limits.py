"""Bounds on HTTP connections: a request-head timeout and a cap on open connections (``REQUEST_HEAD_TIMEOUT``,
``MAX_CONNECTIONS``).

uvicorn bounds a connection's idle time only between requests (``timeout_keep_alive``): a connection that never
completes its first request head, or a kept-alive one that starts a head and stops, was held forever (3000 such
connections stayed open for 40 s). Its ``limit_concurrency`` answers 503 to a request only once its head is in,
holds every connection beyond the limit open meanwhile, answers in plain text, and counts keep-alive and refused
connections alike. :func:`bounded_h11` extends uvicorn's h11 protocol instead:

* **Head timeout.** A connection has ``head_timeout`` seconds from being opened, and a kept-alive one from the first
  byte of its next request, to send the whole request head (request line and headers). Past it, the connection is
  closed: with ``408 Request Timeout`` when part of a head came, silently when nothing did (a client's unused
  pre-opened connection, as Apache does). The body is not timed (a slow upload of a legitimate request goes on),
  nor is the idle time between requests (uvicorn's ``timeout_keep_alive``, 5 s).
* **Connection bound.** A connection opened while ``max_connections`` others are open (idle kept-alive ones
  included) is served no request: its first request gets ``503`` with ``Retry-After: 1`` and ``Connection:
  close``, in the route's error form (TGI's ``{"error", "error_type": "overloaded"}``, OpenAI's object on
  ``/v1``); one that sends no head within :data:`REFUSED_HEAD_SECONDS` gets the TGI form then. ``/health`` and
  ``/metrics`` are answered all the same (a liveness probe must not fail, and restart the server, because clients
  hold its connections), and the connection closed after. A refused connection does not count towards the bound,
  and the connections already served (running streams) are never touched.
* **Head size.** A request head (request line and headers, to its blank line) longer than ``MAX_HEADER_BYTES``
  (uvicorn's ``h11_max_incomplete_event_size``) gets ``431 Request Header Fields Too Large`` (as TGI answers, and
  as ``MAX_HEADERS`` does) in the route's error form, before h11 parses it; the connection is then half-closed
  and what else the client sends is discarded for :data:`LINGER_SECONDS` (so that it reads the answer rather than
  a reset), then closed. h11 itself bounds only a head still incomplete in its buffer: a 100 KB head that
  arrived in one read was served.
"""

from __future__ import annotations

import logging
import re
import time

import h11
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, STATUS_PHRASES, H11Protocol

from server.error_body import error_body, error_bytes, openai_path
from server.middleware import OPEN_PATHS

log = logging.getLogger("kvserve")

REFUSED_HEAD_SECONDS = 1.0
"""How long a connection beyond ``MAX_CONNECTIONS`` may take to send the head its 503 answers (at most
``REQUEST_HEAD_TIMEOUT``): it holds a socket beyond the bound meanwhile."""
LINGER_SECONDS = 2.0
"""How long a connection whose head was too large is kept (its input discarded) after its 431, before it is
closed."""
REFUSAL_LOG_SECONDS = 10.0
"""At most one log line about refused connections per this many seconds (an attack opens thousands)."""


def _raw_response(status: int, body: dict, default_headers: list[tuple[bytes, bytes]],
                  extra: list[tuple[bytes, bytes]] = ()) -> bytes:
    """An HTTP/1.1 response that closes its connection, written without h11 (which sends no response before it
    has parsed a request)."""
    payload = error_bytes(body)
    headers = [*default_headers, (b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode()), *extra, (b"connection", b"close")]
    lines = [b"HTTP/1.1 %d %s" % (status, STATUS_PHRASES[status])] + [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + payload


HEAD_END = re.compile(b"\n\r?\n")
"""The blank line that ends a request head (h11 accepts bare ``\\n`` line ends too)."""


def head_over(buffer: bytes, max_bytes: int) -> bool:
    """Whether the request head at the start of ``buffer`` (bytes received, from the head's first byte on; the
    body or pipelined requests may follow it) is longer than ``max_bytes``, its blank line included: it does not
    end within the first ``max_bytes`` bytes though more have come. A head still short of the bound is not."""
    return len(buffer) > max_bytes and HEAD_END.search(buffer, 0, max_bytes) is None


class HeadBoundConnection(h11.Connection):
    """An :class:`h11.Connection` (server side) that checks each request head's size, the head's bytes all in or
    not, before parsing it: when :func:`head_over`, ``on_oversized(buffer)`` is called (it answers and closes the
    connection) and ``next_event`` returns ``NEED_DATA`` without parsing."""

    def __init__(self, max_head_bytes: int, on_oversized):
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes
        self.on_oversized = on_oversized
        self.oversized = False

    def next_event(self):
        if self.oversized:
            return h11.NEED_DATA
        if self.their_state is h11.IDLE:
            buffer = self.trailing_data[0]
            if head_over(buffer, self.max_head_bytes):
                self.oversized = True
                self.on_oversized(buffer)
                return h11.NEED_DATA
        return super().next_event()


def _target(head: bytes) -> str:
    """The path of the request line at the start of ``head`` (``""`` when there is none to read)."""
    words = head[:head.find(b"\n")].split(b" ")
    return words[1].partition(b"?")[0].decode("latin-1") if len(words) == 3 else ""


def _over_bound_message(limit: int) -> str:
    return f"Server is at its connection limit: {limit} connections are open (MAX_CONNECTIONS); retry shortly"


def _error_body(path: str, message: str, error_type: str) -> dict:
    """The routes' error form for ``path``: OpenAI's object on ``/v1`` (and vLLM's root routes), else TGI's."""
    return error_body(openai_path(path), message, error_type)


def bounded_h11(head_timeout: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a request-head timeout and a connection bound (see the module docstring), as a
    class to pass as ``uvicorn.Config(http=...)``.

    Args:
        head_timeout: seconds a connection has to send a whole request head (``REQUEST_HEAD_TIMEOUT``; > 0).
        max_connections: most connections served at once (``MAX_CONNECTIONS``; >= 1).
    """

    class BoundedH11Protocol(H11Protocol):
        """uvicorn's :class:`H11Protocol` with :func:`bounded_h11`'s head timeout and connection bound (through its
        ``conn``, ``connections``, ``app``, ``loop``, ``transport`` and ``server_state`` attributes)."""

        refused_since_log = 0
        last_refusal_log = float("-inf")

        def connection_made(self, transport) -> None:  # type: ignore[override]
            limit = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
            self.conn = HeadBoundConnection(limit, self._head_too_large)
            super().connection_made(transport)
            self.head_timer = None
            self.head_bytes = 0  # bytes of the request head under way (0: none begun)
            self.refused = len(self.connections) > max_connections
            if self.refused:
                self.connections.discard(self)  # not served, so not counted
                self.app = self._refuse
                self._log_refusal()
            self._arm(min(head_timeout, REFUSED_HEAD_SECONDS) if self.refused else head_timeout)

        def data_received(self, data: bytes) -> None:
            if self.conn.oversized:  # answered 431: the rest of what the client sends is discarded
                return
            if self.head_timer is None and self.conn.their_state is h11.IDLE:
                self._arm(head_timeout)  # a kept-alive connection began its next request
            if self.conn.their_state is h11.IDLE:
                self.head_bytes += len(data)
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the head is in (or the request was refused as invalid)
                self._disarm()
                self.head_bytes = 0

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self.head_timer = self.loop.call_later(seconds, self._head_timed_out)

        def _disarm(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _head_timed_out(self) -> None:
            self.head_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            default = self.server_state.default_headers
            if self.refused:
                body = _error_body("", _over_bound_message(max_connections), "overloaded")
                self.transport.write(_raw_response(503, body, default, [(b"retry-after", b"1")]))
            elif self.head_bytes:
                body = _error_body("", f"the request head (request line and headers) did not arrive within "
                                       f"{head_timeout:g} s (REQUEST_HEAD_TIMEOUT)", "validation")
                self.transport.write(_raw_response(408, body, default))
            self.transport.close()

        def _head_too_large(self, buffer: bytes) -> None:
            self._disarm()
            limit = self.conn.max_head_bytes
            body = _error_body(_target(buffer[:limit]), f"the request head (request line and headers) is longer than "
                               f"{limit} bytes (MAX_HEADER_BYTES)", "validation")
            self.transport.write(_raw_response(431, body, self.server_state.default_headers))
            if not self.transport.can_write_eof():
                return self.transport.close()
            self.transport.write_eof()
            self.head_timer = self.loop.call_later(LINGER_SECONDS, self.transport.close)

        async def _refuse(self, scope, receive, send) -> None:
            if scope["type"] != "http":
                return
            if scope["path"] in OPEN_PATHS:  # a probe: answered (then closed), so that load does not fail it
                self.cycle.keep_alive = False
                return await self.config.loaded_app(scope, receive, send)
            body = _error_body(scope["path"], _over_bound_message(max_connections), "overloaded")
            payload = error_bytes(body)
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                (b"retry-after", b"1"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": payload})

        @classmethod
        def _log_refusal(cls) -> None:
            cls.refused_since_log += 1
            now = time.monotonic()
            if now - cls.last_refusal_log >= REFUSAL_LOG_SECONDS:
                log.warning("%d connections refused (503): %d are open (MAX_CONNECTIONS)", cls.refused_since_log,
                            max_connections)
                cls.refused_since_log, cls.last_refusal_log = 0, now

    return BoundedH11Protocol
