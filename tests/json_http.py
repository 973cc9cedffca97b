"""JSON-over-HTTP helpers for the tests that call a test server's routes: one answer, or one stream's events."""

from __future__ import annotations

import json

import httpx


def post(srv, path, body, status=200):
    """POST ``body`` to ``srv`` and return the JSON answer, which must have ``status``."""
    r = httpx.post(srv.url + path, json=body, timeout=120)
    assert r.status_code == status, (path, body, r.status_code, r.text)
    return r.json()


def sse(srv, path, body) -> list:
    """POST ``body`` and return the stream's ``data:`` events parsed (``[DONE]`` left out)."""
    with httpx.stream("POST", srv.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(x) for x in lines if x != "[DONE]"]
