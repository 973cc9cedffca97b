"""ASGI middleware at the HTTP edge: HEAD answered as GET, JSON content type, body-read timeout, body-size limit,
bounds on a JSON body's shape, header count, optional bearer-token authentication, and the count of generation
requests in flight (``MAX_CONCURRENT_REQUESTS``, and refusal while draining).

Each answers with the same JSON error bodies as the routes (TGI's form, OpenAI's on ``/v1``) and never
lets a refused request reach a route.
"""

from __future__ import annotations

import asyncio
import hmac
import threading

from server.error_body import error_body, error_bytes, openai_path

OPEN_PATHS = ("/health", "/metrics")


async def _send_error(send, path: str, status: int, message: str, error_type: str, param: str | None = None) -> None:
    payload = error_bytes(error_body(openai_path(path), message, error_type, param))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if status == 429:
        headers.append((b"retry-after", b"1"))  # seconds (RFC 9110 section 10.2.3)
    if status == 408:
        headers.append((b"connection", b"close"))  # the rest of the body is not read (RFC 9110 section 15.5.9)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def _replay(body: bytes, receive):
    """An ASGI ``receive`` that gives the app ``body`` (read already, whole) first, then what ``receive`` gives (a
    disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _invalid_status(scope) -> int:
    return 400 if openai_path(scope["path"]) else 422


class HeadAsGet:
    """Answer ``HEAD`` as ``GET`` without the body (RFC 9110 section 9.3.2): the GET's status and headers
    (``Content-Length`` the GET's), for every path, so a path without a GET route answers HEAD as it answers GET
    (404, or 405 naming its methods). FastAPI's routes take only the methods they name: ``HEAD /metrics`` was 405,
    and aiperf probes ``/metrics`` with HEAD before it starts."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "HEAD":
            return await self.app(scope, receive, send)

        async def headers_only(message):
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return  # a streamed body's parts: none is sent
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        return await self.app({**scope, "method": "GET"}, receive, headers_only)


class HeaderLimit:
    """Refuse a request with more than ``max_headers`` header fields: 431 (RFC 6585). Their total size is bounded
    before any of this runs (``MAX_HEADER_BYTES``: :mod:`server.connection_limits`)."""

    def __init__(self, app, max_headers: int):
        self.app = app
        self.max_headers = max_headers

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and len(scope.get("headers") or []) > self.max_headers:
            return await _send_error(send, scope["path"], 431, f"more than MAX_HEADERS={self.max_headers} request "
                                     "header fields", "validation")
        return await self.app(scope, receive, send)


BODY_METHODS = ("POST", "PUT", "PATCH")


def is_json(content_type: bytes) -> bool:
    """Whether a Content-Type value names JSON: ``application/json`` or ``application/<x>+json``, parameters
    (``; charset=utf-8``) allowed, case-insensitive."""
    media = content_type.split(b";", 1)[0].strip().lower()
    kind, _, subtype = media.partition(b"/")
    return kind == b"application" and (subtype == b"json" or subtype.endswith(b"+json"))


class JsonContentType:
    """Refuse a request body whose ``Content-Type`` is present and is not JSON (a POST, PUT or PATCH with a
    non-empty body) with 415 ``validation``, before any of it is read: every route takes a JSON body. A missing
    ``Content-Type`` is taken as JSON (as vLLM does; the app is built with FastAPI's ``strict_content_type`` off)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") not in BODY_METHODS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        content_type = headers.get(b"content-type")
        has_body = headers.get(b"content-length", b"0").strip() != b"0" or b"transfer-encoding" in headers
        if content_type is not None and has_body and not is_json(content_type):
            received = content_type.decode("latin-1")[:100]
            return await _send_error(send, scope["path"], 415, f"Content-Type `{received}` is not supported: send "
                                     "the body as JSON, with `Content-Type: application/json`", "validation")
        return await self.app(scope, receive, send)


class _BodyTimedOut(Exception):
    """No body bytes came within the timeout (raised from the wrapped ``receive``)."""


class BodyTimeout:
    """Close a request whose body stops arriving: when no part of it comes within ``timeout`` seconds of the
    previous one (or of the request head), 408 ``validation`` (``Connection: close``). Only reads of an
    unfinished body are timed: once it is whole, waits on ``receive`` (for a client's disconnect) are not.

    The body is read whole by the middleware inside this one (:class:`PayloadLimit`, :class:`BodyBounds`), so
    the timeout ends the request before a route, or the in-flight count, sees it.

    Args:
        timeout: seconds (``REQUEST_BODY_TIMEOUT``; > 0).
    """

    def __init__(self, app, timeout: float):
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        done = False

        async def timed_receive():
            nonlocal done
            if done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except asyncio.TimeoutError:
                raise _BodyTimedOut from None
            done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        try:
            return await self.app(scope, timed_receive, send)
        except _BodyTimedOut:
            return await _send_error(send, scope["path"], 408, f"no part of the request body came within "
                                     f"{self.timeout:g} s (REQUEST_BODY_TIMEOUT)", "validation")


GENERATION_PATHS = ("/", "/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions", "/v1/responses",
                    "/ui/api/generate")


class InFlight:
    """Counts the generation requests in flight (a POST to a generation route, from its arrival until its response
    has been sent, streamed or not) in ``state.in_flight``; refuses one more than ``limit`` with 429
    ``overloaded`` (``Retry-After: 1``), and every new one with 503 ``unhealthy`` once ``state.draining`` is set
    (a shutdown).

    Args:
        state: the server state (:class:`server.state.ServerState`: ``in_flight``, ``draining``).
    """

    def __init__(self, app, limit: int, state):
        self.app = app
        self.limit = limit
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        if self.state.draining:
            return await _send_error(send, scope["path"], 503, "server is shutting down", "unhealthy")
        if self.state.in_flight >= self.limit:
            return await _send_error(send, scope["path"], 429, f"Model is overloaded: {self.limit} requests are "
                                     "already queued or running (MAX_CONCURRENT_REQUESTS)", "overloaded")
        self.state.in_flight += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


class PayloadLimit:
    """Refuse request bodies larger than ``limit`` bytes (declared or streamed) with ``validation``: 422 on the TGI
    routes, 400 on ``/v1`` (OpenAI's status for invalid input, as every other invalid OpenAI request gets)."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        too_big = f"request body larger than PAYLOAD_LIMIT={self.limit} bytes"
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _send_error(send, scope["path"], _invalid_status(scope), too_big, "validation")
        # A body without a declared length is read here, counted, then replayed to the app.
        if declared is None and scope.get("method") in BODY_METHODS:
            chunks, size, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    return
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                more = message.get("more_body", False)
                if size > self.limit:
                    return await _send_error(send, scope["path"], _invalid_status(scope), too_big, "validation")
            return await self.app(scope, _replay(b"".join(chunks), receive), send)
        return await self.app(scope, receive, send)


SMALL_BODY_BYTES = 65536
"""Bytes: bodies up to this size are parsed and validated on the event loop (too few values in them to hold it);
larger ones are measured, parsed and validated in :func:`in_body_thread`."""
UNLOADED_MAX_ITEMS = 4096
"""The array bound while the model loads (its MAX_TOTAL_TOKENS is not known yet; the routes answer 503)."""
OTHER_VALUES = 1024
"""Values a request may hold besides its prompts' token ids (stop sequences, logit_bias, other fields)."""
OTHER_CONTAINERS = 256
"""Objects and arrays a request may hold besides one a position of the model (the body, the prompts of a batch,
stop lists, logit_bias, a response format)."""

_BODY_THREAD = threading.Lock()


async def in_body_thread(fn, *args):
    """``fn(*args)`` in a worker thread, one large body at a time (the reading of a body over
    :data:`SMALL_BODY_BYTES`: its shape check, its parse and validation), so that the event loop serves the other
    requests meanwhile. One at a time: a C call holds Python's global lock until it returns (``json.loads`` of a
    1.8 MB body about 25 ms), and with a thread per body the loop could wait for several such calls in turn.

    Raises:
        what ``fn`` raises.
    """
    import anyio

    def run():
        with _BODY_THREAD:
            return fn(*args)

    return await anyio.to_thread.run_sync(run)


class BodyBounds:
    """Refuse a JSON body that holds more values, or a longer array, than a request the server can serve, before
    it is parsed and validated (:func:`server.body_bounds.body_fault`, in the worker thread of large bodies:
    :func:`in_body_thread`): no array longer than ``MAX_TOTAL_TOKENS`` (token ids, messages, input items: each
    costs a token at least), no more values than ``MAX_SEQUENCES_PER_REQUEST`` prompts of that many token ids, plus
    :data:`OTHER_VALUES`, and no more objects and arrays than ``MAX_TOTAL_TOKENS`` plus :data:`OTHER_CONTAINERS`:
    every message, content part or input item takes a position of the prompt at least, or is of no use (text cut
    into parts shorter than a token). 400 (``validation``, ``param`` naming the field) on the OpenAI routes, 422
    on TGI's.

    Args:
        state: the server state (:class:`server.state.ServerState`: ``info["max_total_tokens"]`` once loaded).
    """

    def __init__(self, app, state):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        content_type = dict(scope.get("headers") or []).get(b"content-type", b"") if scope["type"] == "http" else b""
        if scope["type"] != "http" or scope.get("method") not in BODY_METHODS or (
                content_type and not is_json(content_type)):
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if len(body) > SMALL_BODY_BYTES:
            from server.body_bounds import body_fault
            from server.service import MAX_SEQUENCES_PER_REQUEST

            max_items = self.state.info.get("max_total_tokens") or UNLOADED_MAX_ITEMS
            fault = await in_body_thread(body_fault, body, MAX_SEQUENCES_PER_REQUEST * max_items + OTHER_VALUES,
                                         max_items, max_items + OTHER_CONTAINERS)
            if fault is not None:
                message, field = fault
                return await _send_error(send, scope["path"], _invalid_status(scope), message, "validation", field)
        return await self.app(scope, _replay(body, receive), send)


class BearerAuth:
    """When an API key is set, every route but /health and /metrics needs ``Authorization: Bearer <key>``.

    The scheme name is case-insensitive (RFC 9110 section 11.1: ``bearer``, ``BEARER`` are the same
    scheme); the key must match exactly. ``static_paths`` (the built-in page's files, which hold no server
    data) are open to GET and HEAD only: ``POST /`` still needs the key.
    """

    def __init__(self, app, api_key: str, static_paths: tuple[str, ...] = ()):
        self.app = app
        self.expected = api_key.encode()
        self.static_paths = frozenset(static_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or (
                scope["path"] in self.static_paths and scope.get("method") in ("GET", "HEAD")):
            return await self.app(scope, receive, send)
        scheme, _, key = dict(scope.get("headers") or []).get(b"authorization", b"").strip().partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.expected):
            return await _send_error(send, scope["path"], 401, "missing or invalid API key (Authorization: Bearer)",
                                     "authentication")
        return await self.app(scope, receive, send)
