"""The attack findings of #26, each against a real server (or the app in-process) and each failing without its fix:
lone surrogates, tokenizing on the event loop, unbounded request heads, MAX_CONCURRENT_REQUESTS counting
sequences, PAYLOAD_LIMIT's status on the OpenAI routes, and logit_bias aliases."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.conftest import MODEL_DIR, server_with

robust_server = server_with({"MAX_CONCURRENT_REQUESTS": "8", "MAX_BATCH_SIZE": "4"})
ROUTES = [("/generate", '{"inputs": "x%sy"}', "inputs", 422), ("/generate_stream", '{"inputs": "x%sy"}', "inputs", 422),
          ("/v1/completions", '{"prompt": "x%sy", "max_tokens": 2}', "prompt", 400),
          ("/v1/completions", '{"prompt": "x", "stop": ["%s"], "max_tokens": 2}', "stop", 400),
          ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x%sy"}], "max_tokens": 2}',
           "messages[0].content", 400), ("/v1/responses", '{"input": "x%sy", "max_output_tokens": 2}', "input", 400),
          ("/v1/responses", '{"input": "x", "instructions": "x%sy", "max_output_tokens": 2}', "instructions", 400),
          ("/v1/responses", '{"input": [{"role": "user", "content": "x%sy"}], "max_output_tokens": 2}',
           "input[0].content", 400),
          ("/tokenize", '{"prompt": "x%sy"}', "prompt", 400)]


def post_raw(srv, path, body: str, timeout=60):
    return httpx.post(srv.url + path, content=body.encode(), headers={"content-type": "application/json"},
                      timeout=timeout)


@pytest.mark.parametrize("path,body,field,status", ROUTES, ids=[f"{r[0]}:{r[2]}" for r in ROUTES])
def test_a_lone_surrogate_is_a_4xx_naming_the_field(robust_server, path, body, field, status):
    """`"x\\ud800y"` is valid JSON but not Unicode text; tokenizers raised TypeError (a 500)."""
    r = post_raw(robust_server, path, body % "\\ud800")
    assert r.status_code == status, r.text
    err = r.json()["error"]
    message = err if isinstance(err, str) else err["message"]
    assert field in message and (isinstance(err, str) or err["param"] == field)


def test_inputs_name_a_lone_surrogate_after_a_pair_as_stop_and_prompt_do(robust_server):
    """After a valid pair, a lone surrogate in ``inputs`` got pydantic's "unable to parse raw data as a unicode
    string" (its ``min_length`` check reads the text as UTF-8), naming neither the character nor where it is; now
    ``inputs`` is named as ``parameters.stop`` and OpenAI's ``prompt`` are."""
    text = "ab\\ud800\\udc00x\\ud800"
    stop = post_raw(robust_server, "/generate", '{"inputs": "a", "parameters": {"stop": ["%s"]}}' % text)
    prompt = post_raw(robust_server, "/v1/completions", '{"prompt": "%s", "max_tokens": 2}' % text)
    assert stop.status_code == 422 and prompt.status_code == 400, (stop.text, prompt.text)
    message = prompt.json()["error"]["message"]
    assert "surrogates not allowed at character" in message, message
    for path in ("/generate", "/generate_stream"):
        r = post_raw(robust_server, path, '{"inputs": "%s"}' % text)
        assert r.status_code == 422 and r.json()["error"] == message.replace("`prompt`", "`inputs`"), r.text
    assert stop.json()["error"].split(": ", 1)[1] == message.split(": ", 1)[1], stop.text


def test_a_run_of_lone_surrogates_is_named_by_its_first_never_echoed():
    """A 1.98 MB body of lone surrogates came back as a 4.62 MB error: the message echoed the whole run, each
    escaped. It names the first, its position and the run's length."""
    from server.service import utf8_error

    err = utf8_error("ok" + "\udc80" * 330_000 + "x\ud800", "prompt")
    assert str(err) == ("`prompt` is not valid Unicode text: surrogates not allowed at character 2 (\\udc80, the "
                        "first of 330000 in a row)") and err.param == "prompt"
    assert str(utf8_error("x\ud800y", "inputs")) == ("`inputs` is not valid Unicode text: surrogates not allowed at "
                                                     "character 1 (\\ud800)")
    assert utf8_error("ok \u00e9", "prompt") is None


def test_a_prompt_its_bytes_prove_too_long_is_refused_before_tokenizing(robust_server):
    """A 1.9 MB prompt (inside PAYLOAD_LIMIT) was tokenized for ~4 s on the event loop before its 422; now it is
    refused at once from its byte length, and /health answers meanwhile."""
    body = '{"prompt": "%s", "max_tokens": 1}' % ("And God said unto Moses, " * 76_000)
    assert 1_800_000 < len(body) < 2_000_000
    began = time.perf_counter()
    r = post_raw(robust_server, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "bytes" in r.json()["error"]["message"]
    assert time.perf_counter() - began < 2.0


def test_tokenizing_runs_off_the_event_loop(monkeypatch):
    """While one request's prompt is being tokenized (made slow here), /health and other requests are answered."""
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.config import load_settings

    app = create_app(load_settings(model_id=str(MODEL_DIR)), load_in_background=False)
    with TestClient(app) as client:
        tokenizer = app.state.kvserve.service.tokenizer
        real = tokenizer.encode

        def slow(text, *args, **kwargs):
            if "SLOW" in text:
                time.sleep(2.0)
            return real(text, *args, **kwargs)

        monkeypatch.setattr(tokenizer, "encode", slow)
        slow_request = threading.Thread(target=client.post, args=("/v1/completions",),
                                        kwargs={"json": {"prompt": "SLOW", "max_tokens": 1}})
        slow_request.start()
        time.sleep(0.3)
        began = time.perf_counter()
        assert client.get("/health").status_code == 200
        assert client.post("/generate", json={"inputs": "And", "parameters": {"max_new_tokens": 1}}).status_code == 200
        assert time.perf_counter() - began < 1.0  # not after the 2 s tokenization
        slow_request.join(30)


def _raw_http(srv, head: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        try:
            s.sendall(head)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # the server closed the connection while we were still sending: the head was refused
            return b""
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except OSError:
            pass
        return b"".join(chunks)


def test_request_heads_are_bounded(robust_server):
    """One 1 MiB header was accepted (and 20 MiB unfinished heads grew the server by 259 MiB): a head over
    MAX_HEADER_BYTES (16 KiB) now gets 431 and the connection is closed; more than MAX_HEADERS (100) fields get 431."""
    big = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"
    answer = _raw_http(robust_server, big)
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431"), answer[:200]
    many = {f"x-h{i}": "1" for i in range(150)}
    r = httpx.get(robust_server.url + "/health", headers=many)
    assert r.status_code == 431 and "MAX_HEADERS" in r.json()["error"]
    fine = {f"x-h{i}": "1" for i in range(40)}
    assert httpx.get(robust_server.url + "/health", headers=fine).status_code == 200


def test_max_concurrent_requests_counts_requests_not_sequences(robust_server):
    """MAX_CONCURRENT_REQUESTS=8: one request of n=9 on an idle server was 429 (it counted sequences) though it
    could never succeed; it is one request."""
    r = httpx.post(robust_server.url + "/v1/completions", json={"prompt": "And", "n": 9, "max_tokens": 2,
                                                                "temperature": 1}, timeout=120)
    assert r.status_code == 200 and len(r.json()["choices"]) == 9


def test_logit_bias_aliases_and_count(robust_server):
    for bias, words in [({"433": -100, "+433": 100}, "same token"), ({"433": 1, "0433": 1}, "same token"),
                        ({str(i): 1 for i in range(301)}, "at most 300")]:
        r = httpx.post(robust_server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1, "logit_bias": bias})
        assert r.status_code == 400 and words in r.json()["error"]["message"] and r.json()["error"]["param"] == "logit_bias"
    r = httpx.post(robust_server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1,
                                                               "logit_bias": {str(i): 1 for i in range(300)}})
    assert r.status_code == 200


def test_payload_limit_is_400_on_openai_routes_and_422_on_tgi():
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.config import load_settings

    client = TestClient(create_app(load_settings(payload_limit=100), load_in_background=True))
    big = {"prompt": "a" * 200}
    r = client.post("/v1/completions", json=big)
    assert r.status_code == 400 and "PAYLOAD_LIMIT" in r.json()["error"]["message"]
    assert client.post("/generate", json={"inputs": "a" * 200}).status_code == 422


ONE_TOKEN_PROMPTS = '{"prompt": [%s], "max_tokens": 1}' % ",".join(["[1]"] * 474_985)  # 1.9 MB
MESSAGES = json.dumps({"messages": [{"role": "user", "content": "a"}] * 61_000, "max_tokens": 1},
                      separators=(",", ":"))
BIG_BODIES = [("/v1/completions", ONE_TOKEN_PROMPTS, "prompt", 400),
              ("/v1/chat/completions", MESSAGES, "messages", 400),
              ("/v1/responses", MESSAGES.replace('"messages"', '"input"'), "input", 400),
              ("/v1/completions", json.dumps({"prompt": [1] * 2000, "max_tokens": 1, "stop": "x" * 70_000}), "prompt",
               400),
              ("/generate", json.dumps({"inputs": "a", "parameters": {"stop": ["a"] * 300_000}}), "parameters", 422)]


def test_large_json_arrays_are_refused_before_they_hold_the_event_loop(robust_server):
    """A 1.9 MB body of 474,985 one-token prompts was parsed and validated on the event loop: its 400 came after
    2.6 s, and /health and every stream waited as long. Its shape is now measured from its bytes, in a worker
    thread, and refused naming the field; /health is answered within 1 s all the while (three at once)."""
    assert all(len(body) < 2_000_000 for _, body, _, _ in BIG_BODIES)  # inside PAYLOAD_LIMIT
    results, late, done = [], [], threading.Event()

    def poll_health():
        with httpx.Client(timeout=1.0) as client:
            while not done.is_set():
                try:
                    client.get(robust_server.url + "/health")
                except httpx.TimeoutException:
                    late.append(1)

    def send(path, body):
        results.append((path, post_raw(robust_server, path, body, timeout=120)))

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        for _ in range(2):
            senders = [threading.Thread(target=send, args=(path, body)) for path, body, _, _ in BIG_BODIES]
            for t in senders:
                t.start()
            for t in senders:
                t.join()
    finally:
        done.set()
        poller.join()
    assert late == []  # no /health call waited 1 s
    for path, body, field, status in BIG_BODIES:
        for got_path, r in results:
            if got_path == path and r.request.content == body.encode():
                err = r.json()["error"]
                assert r.status_code == status and field in (err if isinstance(err, str) else err["message"]), r.text
                assert isinstance(err, str) or err["param"] == field


def test_truncate_tokenizes_only_the_tail_it_keeps(monkeypatch):
    """TGI's ``truncate`` tokenized a 1.9 MB prompt whole (3.7-18.8 s of a tokenizer thread) before keeping its last
    tokens; only a tail of the text is tokenized now, and the answer is that of a short prompt ending the same."""
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.config import load_settings

    app = create_app(load_settings(model_id=str(MODEL_DIR)), load_in_background=False)
    with TestClient(app) as client:
        tokenizer = app.state.kvserve.service.tokenizer
        real, lengths = tokenizer.encode, []

        def encode(text, *args, **kwargs):
            lengths.append(len(text))
            return real(text, *args, **kwargs)

        monkeypatch.setattr(tokenizer, "encode", encode)
        params = {"truncate": 12, "max_new_tokens": 4, "details": True, "decoder_input_details": True}
        verse = "And God said unto Moses, "
        big = client.post("/generate", json={"inputs": verse * 76_000, "parameters": params})
        assert big.status_code == 200 and max(lengths) < 10_000, (big.text[:300], max(lengths))
        small = client.post("/generate", json={"inputs": verse * 4, "parameters": params}).json()
        assert big.json()["details"]["prefill"] == small["details"]["prefill"]
        assert len(small["details"]["prefill"]) == 12 and big.json()["generated_text"] == small["generated_text"]


@pytest.mark.parametrize("item", [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                                  {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
def test_a_responses_item_of_another_type_is_named_by_its_type(robust_server, item):
    """A ``function_call`` item was refused naming ``input[0].call_id`` ("not supported"), a field of the item the
    server does not take at all: the 400 names the item's type."""
    r = httpx.post(robust_server.url + "/v1/responses", json={"input": [item], "max_output_tokens": 2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].type", r.text

