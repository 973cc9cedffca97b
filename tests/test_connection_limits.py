"""REQUEST_HEAD_TIMEOUT and MAX_CONNECTIONS against a real server on 127.0.0.1 (#32: 3000 half-sent request heads
stayed open for 40 s with no timeout, and nothing bounded the connections). Each test fails without its bound."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.conftest import server_with
from tests.raw_http import connect, read_to_close

HEAD_TIMEOUT = 1.0
head_server = server_with({"REQUEST_HEAD_TIMEOUT": str(HEAD_TIMEOUT), "KV_BACKENDS": ""})
BOUND = 20
bound_server = server_with({"MAX_CONNECTIONS": str(BOUND), "REQUEST_HEAD_TIMEOUT": "30", "KV_BACKENDS": ""})
PARTIAL_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\n"  # no blank line: the head never ends


def read_response(s: socket.socket) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a Content-Length (the connection stays open): ``(status, body)``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:])
    length = int(next(v for k, v in fields.items() if k.lower() == b"content-length"))
    while len(body) < length:
        body += s.recv(65536)
    return int(head.split()[1]), body


def status_and_json(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_half_sent_heads_are_closed_after_the_head_timeout(head_server):
    """50 connections send a head without its blank line, 5 send nothing: every one is closed by the server
    within 5 s (REQUEST_HEAD_TIMEOUT=1): the half-sent ones with 408, the silent ones with no answer; /health
    answers 200 meanwhile."""
    half = [connect(head_server) for _ in range(50)]
    silent = [connect(head_server) for _ in range(5)]
    try:
        for s in half:
            s.sendall(PARTIAL_HEAD)
        assert httpx.get(head_server.url + "/health", timeout=5).status_code == 200
        deadline = time.monotonic() + 5
        answers = [read_to_close(s, max(0.1, deadline - time.monotonic())) for s in half]
        quiet = [read_to_close(s, max(0.1, deadline - time.monotonic())) for s in silent]
    finally:
        for s in half + silent:
            s.close()
    assert sum(a is None for a in answers) == 0, "half-sent heads still open after 5 s"
    for answer in answers:
        status, body = status_and_json(answer)
        assert status == 408 and "REQUEST_HEAD_TIMEOUT" in body["error"]
    assert quiet == [b""] * 5
    assert httpx.get(head_server.url + "/health", timeout=5).status_code == 200


def test_the_head_timeout_spares_slow_bodies_and_idle_keep_alive_but_times_the_next_head(head_server):
    """A body sent 1.5 s after its head (timeout 1 s) is served; a kept-alive connection idle for 1.5 s serves its
    next request (uvicorn's keep-alive timeout, 5 s, governs the wait between requests); a next head that stops
    half-way is closed with 408."""
    body = b'{"prompt": "And God said"}'
    with connect(head_server) as s:
        s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                  % len(body) + body[:5])
        time.sleep(1.5 * HEAD_TIMEOUT)
        s.sendall(body[5:])
        status, answer = read_response(s)
        assert status == 200 and json.loads(answer)["count"] > 0
        time.sleep(1.5 * HEAD_TIMEOUT)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(s)[0] == 200
        s.sendall(PARTIAL_HEAD)
        answer = read_to_close(s, 5)
    assert answer is not None, "a kept-alive connection's half-sent head was never timed out"
    assert status_and_json(answer)[0] == 408


def test_connections_beyond_max_connections_get_503_and_running_streams_go_on(bound_server):
    """MAX_CONNECTIONS=20: with one stream running and 25 idle connections open, connections beyond the bound get
    503 overloaded (at once to a request, after 1 s to silence) and are closed, but for /health (answered, then
    closed); the stream runs to its end, and once the idle connections close a request is served again."""
    events = []
    with httpx.stream("POST", bound_server.url + "/generate_stream", timeout=60,
                      json={"inputs": "And", "parameters": {"max_new_tokens": 40, "details": True}}) as stream:
        lines = stream.iter_lines()
        events.append(next(line for line in lines if line.startswith("data:")))
        idle = [connect(bound_server) for _ in range(25)]  # the 20th connection onwards is beyond the bound
        try:
            asking = [connect(bound_server) for _ in range(10)]
            for s in asking:
                s.sendall(b"GET /info HTTP/1.1\r\nHost: x\r\n\r\n")
            answers = [read_to_close(s, 5) for s in asking]
            with connect(bound_server) as probe:  # beyond the bound too, but a probe is answered (and closed)
                probe.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                probe_answer = read_to_close(probe, 5)
            for s in asking:
                s.close()
            idle_answers = [read_to_close(s, 0.1 if i < BOUND - 1 else 5) for i, s in enumerate(idle)]
            events += [line for line in lines if line.startswith("data:")]
        finally:
            for s in idle:
                s.close()
        assert stream.status_code == 200
    for answer in answers:
        assert answer is not None, "a connection beyond MAX_CONNECTIONS was served or held open"
        status, body = status_and_json(answer)
        assert status == 503 and body["error_type"] == "overloaded" and "MAX_CONNECTIONS" in body["error"]
    assert probe_answer is not None and status_and_json(probe_answer)[0] == 200
    refused = [a for a in idle_answers if a is not None]
    assert len(refused) >= 25 - (BOUND - 1)
    assert all(status_and_json(a)[0] == 503 for a in refused)
    final = json.loads(events[-1].removeprefix("data:"))
    assert final["generated_text"] is not None and final["details"]["generated_tokens"] == len(events)
    deadline = time.monotonic() + 5
    while (status := httpx.get(bound_server.url + "/health", timeout=5).status_code) != 200 and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert status == 200


def test_the_settings_are_flags_and_variables_and_refuse_bad_values(monkeypatch):
    """`--request-head-timeout 2.5 --max-connections 50` (or the variables) set them; 0, a negative or an infinite
    timeout, and 0 connections stop start-up naming the flag or variable."""
    from server.config import ConfigError, load_settings
    from tests.test_config import serve_settings

    s = serve_settings("--request-head-timeout", "2.5", "--max-connections", "50")
    assert (s.request_head_timeout, s.max_connections) == (2.5, 50)
    monkeypatch.setenv("MAX_CONNECTIONS", "7")
    assert load_settings().max_connections == 7 and load_settings().request_head_timeout == 10.0
    for flags, name in [(["--request-head-timeout", "0"], "--request-head-timeout"),
                        (["--request-head-timeout", "inf"], "--request-head-timeout"),
                        (["--max-connections", "0"], "--max-connections")]:
        with pytest.raises(ConfigError, match=f"invalid {name}="):
            serve_settings(*flags)
    monkeypatch.setenv("REQUEST_HEAD_TIMEOUT", "-1")
    with pytest.raises(ConfigError, match="invalid REQUEST_HEAD_TIMEOUT="):
        load_settings()


def head_of(size: int, path: str = "/health") -> bytes:
    """A GET request head of exactly ``size`` bytes (its blank line included)."""
    start, end = f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Pad: ".encode(), b"\r\n\r\n"
    return start + b"a" * (size - len(start) - len(end)) + end


@pytest.mark.parametrize("size, write", [(17 * 1024, 8192), (60 * 1024, None), (100 * 1024, None)],
                         ids=["17KB-in-8KB-writes", "60KB-in-one-write", "100KB-in-one-write"])
def test_heads_over_max_header_bytes_get_431_however_they_arrive(head_server, size, write):
    """#32: h11 bounds only a head still incomplete in its buffer, so a 17 KB head sent as 8 KB writes, or a
    60 KB or 100 KB one sent at once, got 200: each now gets 431 in the route's error form (MAX_HEADER_BYTES is
    16384) and the connection is closed."""
    head = head_of(size, "/v1/models")
    with connect(head_server) as s:
        for i in range(0, len(head), write or len(head)):
            s.sendall(head[i:i + (write or len(head))])
            time.sleep(0.05 if write else 0)  # separate reads
        answer = read_to_close(s, 5)
    assert answer is not None, "the connection was not closed"
    status, body = status_and_json(answer)
    assert status == 431 and "MAX_HEADER_BYTES" in body["error"]["message"], body
    assert body["error"]["type"] == "invalid_request_error"


def test_heads_within_max_header_bytes_are_served_with_their_body(head_server):
    """A head of exactly MAX_HEADER_BYTES (16384) is served; so is one just under it followed, in the same write,
    by a 300 KB body (the body is not counted as head) and by a pipelined request."""
    with connect(head_server) as s:
        s.sendall(head_of(16384))
        assert read_response(s)[0] == 200
        body = json.dumps({"prompt": "And God said " * 1000}).encode() + b" " * 300_000  # JSON's whitespace
        start = f"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
                f"Content-Length: {len(body)}\r\nX-Pad: ".encode()
        head = start + b"a" * (16000 - len(start) - 4) + b"\r\n\r\n"
        s.sendall(head + body + head_of(16000).replace(b"Host: x", b"Host: x\r\nConnection: close"))
        answer = read_to_close(s, 60)
    assert answer is not None
    first, second = answer.split(b"HTTP/1.1 ")[1:]
    assert first.startswith(b"200") and json.loads(first.partition(b"\r\n\r\n")[2])["count"] >= 3000
    assert second.startswith(b"200")
