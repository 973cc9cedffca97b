"""Large request bodies parsed and validated in a worker thread, not on the event loop.

FastAPI reads a route's JSON body (``json.loads``) and validates it (pydantic) on the event loop, in time that grows
with the body: a valid 1.8 MB ``/v1/completions`` body of 64 prompts of 7,420 token ids takes about 25 ms to parse
and 30 ms to validate on a CPU, and three such bodies at once held ``/health`` for 150-430 ms. A route of
:class:`ThreadedBodyRoute` does both in a worker thread when the body is larger than
:data:`server.middleware.SMALL_BODY_BYTES` (one large body at a time: :func:`server.middleware.in_body_thread`),
and hands FastAPI the validated model, which it takes as it is (a model instance is not validated again); the loop
stays free for the other requests while it runs (it waits for Python's lock for one C call at most, not for the
whole body). A smaller body is read as FastAPI reads it.
The answers are FastAPI's own: the same validation of the same body field, the same errors (a body that cannot
be parsed is reported by FastAPI from the exception the thread met).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from server.middleware import SMALL_BODY_BYTES, in_body_thread, is_json


class _ParsedRequest(Request):
    """The request whose ``body`` was read and whose JSON (``value``: the validated body, or the exception the parse
    raised) was computed in a worker thread."""

    def __init__(self, request: Request, body: bytes, value: Any):
        super().__init__(request.scope, request.receive)
        self._raw, self._value = body, value

    async def body(self) -> bytes:
        return self._raw

    async def json(self) -> Any:
        if isinstance(self._value, _ParseFailed):
            raise self._value.error  # FastAPI answers it as for any body it cannot parse
        return self._value


class _ParseFailed:
    """What :func:`validated_body` returns when the body cannot be parsed: ``error``, the exception."""

    def __init__(self, error: Exception):
        self.error = error


def validated_body(field, body: bytes) -> Any:
    """``body`` parsed and validated as FastAPI validates a route's one body field (``loc`` ``("body", ...)``).

    Returns:
        the validated value, or :class:`_ParseFailed` with the exception ``json.loads`` raised (not JSON, not UTF-8,
        nested past Python's recursion limit), which FastAPI answers from the request (400, or its JSON error).

    Raises:
        RequestValidationError: the body is JSON but not a valid value of ``field`` (FastAPI's errors).
    """
    try:
        data = json.loads(body)
    except Exception as exc:  # noqa: BLE001 - FastAPI answers every failure to parse, as when it parses itself
        return _ParseFailed(exc)
    value, errors = field.validate(data, {}, loc=("body",))
    if errors:
        raise RequestValidationError(errors, body=data)
    return value


class ThreadedBodyRoute(APIRoute):
    """A route that parses and validates a JSON body over :data:`~server.middleware.SMALL_BODY_BYTES` in a worker
    thread (:func:`validated_body` in :func:`~server.middleware.in_body_thread`); other requests, and routes without
    one body model, are FastAPI's."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        field = self.body_field
        if field is None or self._embed_body_fields:
            return handler

        async def route(request: Request):
            body = await request.body()
            content_type = request.headers.get("content-type")
            if len(body) <= SMALL_BODY_BYTES or (content_type and not is_json(content_type.encode("latin-1"))):
                return await handler(request)
            value = await in_body_thread(validated_body, field, body)
            return await handler(_ParsedRequest(request, body, value))

        return route
