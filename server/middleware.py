"""ASGI middleware at the HTTP edge: body-size limit and optional bearer-token authentication.

Both answer with the same JSON error bodies as the routes (TGI's form, OpenAI's on ``/v1``) and never
let the request reach a route.
"""

from __future__ import annotations

import hmac
import json

OPEN_PATHS = ("/health", "/metrics")


async def _send_error(send, path: str, status: int, message: str, error_type: str) -> None:
    from server.errors import OPENAI_TYPES

    if path.startswith("/v1/"):
        body = {"error": {"message": message, "type": OPENAI_TYPES.get(error_type, error_type), "param": None,
                          "code": error_type}}
    else:
        body = {"error": message, "error_type": error_type}
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class PayloadLimit:
    """Refuse request bodies larger than ``limit`` bytes with 422 ``validation`` (declared or streamed)."""

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
            return await _send_error(send, scope["path"], 422, too_big, "validation")
        # A body without a declared length is read here, counted, then replayed to the app.
        if declared is None and scope.get("method") in ("POST", "PUT", "PATCH"):
            chunks, size, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    return
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                more = message.get("more_body", False)
                if size > self.limit:
                    return await _send_error(send, scope["path"], 422, too_big, "validation")
            body = b"".join(chunks)
            sent = False

            async def replay():
                nonlocal sent
                if not sent:
                    sent = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            return await self.app(scope, replay, send)
        return await self.app(scope, receive, send)


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
