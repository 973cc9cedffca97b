"""``HEAD`` is answered as ``GET`` without the body on every GET route (RFC 9110 section 9.3.2): it was 405 on
the FastAPI routes (``/metrics``, ``/health``, ``/v1/models``, ``/info``), and aiperf probes ``/metrics`` with HEAD
before it starts."""

from __future__ import annotations

import httpx
import pytest

from server.app import create_app
from server.config import load_settings
from tests.conftest import server_with
from tests.raw_http import connect, read_to_close

server = server_with({"KV_BACKENDS": "full"})

UNSCHEMED = ["/", "/ui", "/ui/assets/app.js", "/ui/assets/style.css", "/docs", "/redoc", "/openapi.json"]
"""The GET routes outside the OpenAPI schema (the page, its files, the schema's own pages)."""
MOVING = {"/metrics", "/info", "/ui/api/live"}
"""Routes whose answer moves between two calls (counters, uptime): their Content-Length is not compared."""


def get_routes() -> list[str]:
    """Every GET route: the schema's GET operations and :data:`UNSCHEMED`."""
    paths = create_app(load_settings()).openapi()["paths"]
    return sorted({p for p, ops in paths.items() if "get" in ops} | set(UNSCHEMED))


def test_the_routes_are_the_apps():
    assert {"/metrics", "/health", "/v1/models", "/info", "/tokenizer_info"} <= set(get_routes())


@pytest.mark.parametrize("path", get_routes())
def test_head_answers_as_get_without_the_body(server, path):
    get = httpx.get(server.url + path, timeout=30)
    head = httpx.head(server.url + path, timeout=30)
    assert head.status_code == get.status_code, (path, head.status_code, get.status_code)
    assert head.content == b""
    skip = {"date"} | ({"content-length"} if path in MOVING else set())
    assert {k: v for k, v in head.headers.items() if k not in skip} == \
        {k: v for k, v in get.headers.items() if k not in skip}


def test_no_body_bytes_reach_the_wire(server):
    """httpx would drop a body sent after a HEAD's head; the socket shows none is sent."""
    s = connect(server)
    try:
        s.sendall(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        raw = read_to_close(s, 30)
    finally:
        s.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"content-length: " in head.lower() and body == b""


@pytest.mark.parametrize("path,status", [("/no-such-route", 404), ("/v1/no-such-route", 404), ("/generate", 405)])
def test_a_path_without_a_get_route_answers_head_as_get(server, path, status):
    head, get = httpx.head(server.url + path, timeout=10), httpx.get(server.url + path, timeout=10)
    assert head.status_code == get.status_code == status and head.content == b""
    assert head.headers.get("allow") == get.headers.get("allow")


def test_head_meets_the_key_check_as_get():
    """In the app itself (no uvicorn to drop a HEAD's body): the body is dropped, and the checks are the GET's."""
    from fastapi.testclient import TestClient

    client = TestClient(create_app(load_settings(api_key="k3y")))  # no lifespan: the model never loads
    for path, status in [("/info", 401), ("/metrics", 200), ("/ui", 200)]:
        get, head = client.get(path), client.head(path)
        assert head.status_code == get.status_code == status and head.content == b"" and get.content
        assert path in MOVING or head.headers["content-length"] == get.headers["content-length"]


def test_a_405_names_the_allowed_methods():
    """RFC 9110 requires ``Allow`` on a 405: Starlette's exception carries it and the error handler dropped it (an
    attack: ``DELETE /health`` answered 405 without it); the body stays the error body of the route's family."""
    from fastapi.testclient import TestClient

    client = TestClient(create_app(load_settings()))  # no lifespan: the model never loads
    for method, path, allow in [("DELETE", "/health", "GET, HEAD"), ("GET", "/generate", "POST"),
                                ("PUT", "/v1/chat/completions", "POST")]:
        r = client.request(method, path)
        assert r.status_code == 405 and r.headers.get("allow") == allow, (method, path, r.headers)
        assert r.json()["error"] if path.startswith("/v1") else r.json()["error_type"] == "http", r.text
