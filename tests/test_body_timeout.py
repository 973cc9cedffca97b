"""A body's Content-Type and REQUEST_BODY_TIMEOUT against a real server on 127.0.0.1 (#32: 128 sockets sending a
``text/plain`` head and one body byte held every generation slot, and a JSON body that stopped held its socket
forever; a form or XML body got "Input should be a valid dictionary"). Each test fails without its fix."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.conftest import server_with
from tests.raw_http import connect, read_to_close

BODY_TIMEOUT = 1.0
server = server_with({"REQUEST_BODY_TIMEOUT": str(BODY_TIMEOUT), "MAX_CONCURRENT_REQUESTS": "2",
                      "KV_BACKENDS": ""})
GENERATE = {"inputs": "Hello", "parameters": {"max_new_tokens": 1}}


def stalled(srv, path: str, content_type: str) -> socket.socket:
    """A connection that sent a whole head declaring a 100-byte body, then one byte of it, and nothing more."""
    s = connect(srv)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\nContent-Length: 100\r\n\r\n{{"
              .encode())
    return s


def status_and_json(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "application/xml",
                                          "*/*"])
def test_a_body_that_is_not_json_gets_415_in_tgi_form(server, content_type):
    r = httpx.post(server.url + "/generate", content=json.dumps(GENERATE), headers={"Content-Type": content_type},
                   timeout=30)
    assert r.status_code == 415
    assert r.json() == {"error": f"Content-Type `{content_type}` is not supported: send the body as JSON, with "
                                 "`Content-Type: application/json`", "error_type": "validation"}


def test_a_form_body_gets_415_in_openai_form(server):
    r = httpx.post(server.url + "/v1/completions", data={"prompt": "Hello", "max_tokens": "1"}, timeout=30)
    assert r.status_code == 415
    assert r.json() == {"error": {"message": "Content-Type `application/x-www-form-urlencoded` is not supported: "
                                             "send the body as JSON, with `Content-Type: application/json`",
                                  "type": "invalid_request_error", "param": None, "code": "validation"}}


def test_an_edge_error_is_written_compact_and_utf8_as_every_other_answer(server):
    """The errors the ASGI edge writes itself (415 here; 401, 408, 429 and the connection bound the same way) had
    ``json.dumps``' default spacing and ``\\u`` escapes, where the routes' answers (and TGI's, vLLM's) are compact
    UTF-8 (:func:`server.error_body.error_bytes`)."""
    r = httpx.post(server.url + "/generate", content="{}", headers={"Content-Type": "text/plain"}, timeout=30)
    assert r.status_code == 415
    assert r.content == ('{"error":"Content-Type `text/plain` is not supported: send the body as JSON, with '
                         '`Content-Type: application/json`","error_type":"validation"}').encode()


@pytest.mark.parametrize("headers", [{"Content-Type": "application/json; charset=utf-8"},
                                     {"Content-Type": "Application/JSON"},
                                     {"Content-Type": "application/vnd.api+json"}, {}])
def test_json_with_parameters_or_no_content_type_is_served(server, headers):
    r = httpx.post(server.url + "/generate", content=json.dumps(GENERATE).encode(), headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert "generated_text" in r.json()


@pytest.mark.parametrize("path,openai", [("/generate", False), ("/v1/chat/completions", True)])
def test_a_body_that_stops_gets_408_and_the_connection_is_closed(server, path, openai):
    s = stalled(server, path, "application/json")
    try:
        answer = read_to_close(s, within=BODY_TIMEOUT + 10)
    finally:
        s.close()
    assert answer is not None, "the connection was not closed"
    status, body = status_and_json(answer)
    message = f"no part of the request body came within {BODY_TIMEOUT:g} s (REQUEST_BODY_TIMEOUT)"
    assert status == 408
    assert body == ({"error": {"message": message, "type": "invalid_request_error", "param": None,
                               "code": "validation"}} if openai else {"error": message, "error_type": "validation"})


def test_a_slow_body_that_keeps_coming_is_served(server):
    payload = json.dumps(GENERATE).encode()
    s = connect(server, timeout=60)
    try:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                  b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n")
        for i in range(0, len(payload), len(payload) // 3 + 1):  # 3 parts, 0.6 s apart: 1.8 s in all
            time.sleep(0.6 * BODY_TIMEOUT)
            s.sendall(payload[i:i + len(payload) // 3 + 1])
        answer = read_to_close(s, within=60)
    finally:
        s.close()
    status, body = status_and_json(answer)
    assert status == 200 and "generated_text" in body


def test_stalled_bodies_hold_no_generation_slot(server):
    sockets = [stalled(server, "/generate", "text/plain") for _ in range(5)]
    sockets += [stalled(server, "/generate", "application/json") for _ in range(5)]
    try:
        time.sleep(0.3)  # every head is in
        r = httpx.post(server.url + "/generate", json=GENERATE, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        for s in sockets:
            s.close()


def test_a_chunked_body_that_stops_gets_408(server):
    s = connect(server)
    try:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n")  # no last chunk: PAYLOAD_LIMIT counts it as read
        answer = read_to_close(s, within=BODY_TIMEOUT + 10)
    finally:
        s.close()
    assert answer is not None, "the connection was not closed"
    assert status_and_json(answer) == (408, {"error": f"no part of the request body came within {BODY_TIMEOUT:g} s "
                                                      "(REQUEST_BODY_TIMEOUT)", "error_type": "validation"})
