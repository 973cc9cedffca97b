"""Bad input never gives a 500 or a dead server: each case's status code and error body."""

from __future__ import annotations

import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.config import load_settings
from tests.conftest import server_with

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


strict_server = server_with({"API_KEY": KEY, "PAYLOAD_LIMIT": "4096", "MAX_INPUT_TOKENS": "64",
                             "MAX_TOTAL_TOKENS": "96", "MAX_CONCURRENT_REQUESTS": "2", "MAX_BATCH_SIZE": "1"})


def post(srv, path, body=None, content=None, headers=AUTH):
    kwargs = {"json": body} if content is None else {"content": content}
    return httpx.post(srv.url + path, headers={"content-type": "application/json", **headers}, timeout=60, **kwargs)


TGI_422 = [
    ("missing inputs", {"parameters": {}}),
    ("empty inputs", {"inputs": ""}),
    ("inputs not a string", {"inputs": ["a"]}),
    ("max_new_tokens a string", {"inputs": "a", "parameters": {"max_new_tokens": "5"}}),
    ("max_new_tokens zero", {"inputs": "a", "parameters": {"max_new_tokens": 0}}),
    ("max_new_tokens negative", {"inputs": "a", "parameters": {"max_new_tokens": -3}}),
    ("temperature negative", {"inputs": "a", "parameters": {"temperature": -0.5}}),
    ("top_p zero", {"inputs": "a", "parameters": {"top_p": 0}}),
    ("top_p above one", {"inputs": "a", "parameters": {"top_p": 1.01}}),
    ("top_k negative", {"inputs": "a", "parameters": {"top_k": -1}}),
    ("too many stop sequences", {"inputs": "a", "parameters": {"stop": [str(i) for i in range(17)]}}),
    ("prompt over MAX_INPUT_TOKENS", {"inputs": "And God said " * 40}),
    ("prompt + new tokens over MAX_TOTAL_TOKENS", {"inputs": "And God said", "parameters": {"max_new_tokens": 95}}),
    ("unknown kv_backend", {"inputs": "a", "parameters": {"kv_backend": "nope"}}),
]


@pytest.mark.parametrize("name,body", TGI_422, ids=[c[0] for c in TGI_422])
def test_tgi_invalid_input_is_422_with_error_body(strict_server, name, body):
    for path in ("/generate", "/generate_stream"):
        r = post(strict_server, path, body)
        assert r.status_code == 422, (path, r.text)
        data = r.json()
        assert set(data) == {"error", "error_type"} and data["error_type"] == "validation" and data["error"]


@pytest.mark.parametrize("name,content", [("invalid JSON", b'{"inputs": "a",'), ("invalid UTF-8", b'{"inputs": "\xff\xfe"}'),
                                          ("JSON not an object", b'[1, 2]'), ("body over PAYLOAD_LIMIT",
                                                                              b'{"inputs": "' + b"a" * 5000 + b'"}')])
def test_bad_bodies_are_422(strict_server, name, content):
    r = post(strict_server, "/generate", content=content)
    assert r.status_code == 422, r.text
    assert r.json()["error_type"] == "validation"


OPENAI_400 = [  # (body, the field `param` names)
    ({"prompt": ""}, "prompt"), ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "temperature": -1}, "temperature"), ({"prompt": "a", "top_p": 2}, "top_p"),
    ({"prompt": 3}, "prompt"), ({"prompt": "a", "stop": [str(i) for i in range(17)]}, "stop"),
    ({"prompt": "And God said " * 40}, "prompt"), ({"prompt": "And God said", "max_tokens": 95}, "max_tokens"),
    ({"prompt": "And God said", "max_completion_tokens": 95}, "max_completion_tokens"),
    ({"prompt": "a", "kv_backend": "nope"}, "kv_backend"), ({"prompt": "a", "n": 17}, "n"),
]


@pytest.mark.parametrize("body,param", OPENAI_400, ids=[str(c[0])[:40] for c in OPENAI_400])
def test_openai_invalid_input_is_400_with_openai_error_naming_the_field(strict_server, body, param):
    r = post(strict_server, "/v1/completions", body)
    assert r.status_code == 400, (body, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and param in err["message"]
    assert "inputs" not in err["message"]


@pytest.mark.parametrize("path", ["/generate", "/generate_stream"])
def test_a_parameter_beside_inputs_is_refused_saying_it_goes_in_parameters(strict_server, path):
    """``{"inputs": ..., "kv_backend": "int8"}`` was "`kv_backend` is not supported by this server"; the refusal
    names the field's place, ``parameters.kv_backend`` (an empty one too: it is not served as the default)."""
    for value in ("int8", ""):
        r = post(strict_server, path, {"inputs": "a", "kv_backend": value})
        assert r.status_code == 422 and r.json() == {
            "error": '`kv_backend` goes in `parameters`, as `parameters.kv_backend`: '
                     '{..., "parameters": {"kv_backend": ...}}',
            "error_type": "validation"}, (value, r.text)
    r = post(strict_server, path, {"inputs": "a", "max_new_tokens": 3})
    assert r.status_code == 422 and r.json()["error"].startswith(
        "`max_new_tokens` goes in `parameters`, as `parameters.max_new_tokens`")


def test_an_empty_kv_backend_is_refused_naming_it(strict_server):
    """``"kv_backend": ""`` was served by the default backend, as if unset: it is a 4xx naming the field."""
    for path in ("/generate", "/generate_stream"):
        r = post(strict_server, path, {"inputs": "a", "parameters": {"kv_backend": ""}})
        assert r.status_code == 422 and "parameters.kv_backend" in r.json()["error"], (path, r.text)
    for path, body in (("/v1/completions", {"prompt": "a", "max_tokens": 1}),
                       ("/v1/responses", {"input": "a", "max_output_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1})):
        assert post(strict_server, path, body).status_code == 200, path
        r = post(strict_server, path, {**body, "kv_backend": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_backend", (path, r.text)


def test_openai_chat_errors_name_chat_fields(strict_server):
    r = post(strict_server, "/v1/chat/completions", {"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = post(strict_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "And God said " * 40}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_api_key_required_except_health_and_metrics(strict_server):
    assert httpx.get(strict_server.url + "/health").status_code == 200
    assert httpx.get(strict_server.url + "/metrics").status_code == 200
    for path in ("/info", "/v1/models"):
        r = httpx.get(strict_server.url + path)
        assert r.status_code == 401
    r = post(strict_server, "/generate", {"inputs": "a"}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error_type"] == "authentication"
    r = post(strict_server, "/v1/completions", {"prompt": "a"}, headers={})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(strict_server.url + "/info", headers=AUTH).status_code == 200


def test_overload_is_429_and_accepted_requests_finish(strict_server):
    """MAX_CONCURRENT_REQUESTS=2: two long requests are accepted, the third is refused, the two finish."""
    results = {}

    def long(i):
        results[i] = post(strict_server, "/generate", {"inputs": "And God said", "parameters": {"max_new_tokens": 60}})

    threads = [threading.Thread(target=long, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    import time

    deadline = time.time() + 30
    while time.time() < deadline:  # wait until both are queued or running
        m = strict_server.metrics()
        busy = sum(v for k, v in m.items() if k.startswith(("kvserve_requests_running{", "kvserve_requests_waiting{")))
        if busy >= 2:
            break
        time.sleep(0.02)
    r = post(strict_server, "/generate", {"inputs": "a", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 429 and r.json()["error_type"] == "overloaded"
    for t in threads:
        t.join(60)
    assert all(results[i].status_code == 200 for i in range(2))
    assert httpx.get(strict_server.url + "/health").status_code == 200


def test_not_ready_is_503():
    app = create_app(load_settings(), load_in_background=True)
    client = TestClient(app)  # no lifespan: the model never loads
    assert client.get("/health").status_code == 503
    r = client.post("/generate", json={"inputs": "a"})
    assert r.status_code == 503 and r.json()["error_type"] == "unhealthy"
    r = client.post("/v1/completions", json={"prompt": "a"})
    assert r.status_code == 503 and r.json()["error"]["message"]


def test_a_completion_without_max_tokens_is_not_refused_as_if_it_had_sent_one():
    """``/v1/completions`` without ``max_tokens`` gets 16 new tokens (OpenAI's and vLLM's default). A prompt that
    leaves fewer is refused, as vLLM does, but the refusal was "Given: 85 `prompt` tokens and 16 `max_tokens`"
    with ``param`` ``max_tokens``, a value the client never sent: it names the prompt and the default as such."""
    from transformers import AutoTokenizer

    from server.api.openai_convert import completion_requests
    from server.api.openai_schemas import CompletionRequest
    from server.service import GenerationService, InvalidRequest, Limits
    from tests.conftest import MODEL_DIR
    from tests.test_service_disconnect import FakeEngine

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    service = GenerationService(FakeEngine(), tok, Limits(90, 96, 4), "full")
    prompt = "And God said " * 28
    room = 96 - len(tok.encode(prompt))
    assert 1 <= room < 16

    def build(**fields):
        _, reqs, _ = completion_requests(CompletionRequest(prompt=prompt, **fields), service)
        return service.build_request(reqs[0])

    with pytest.raises(InvalidRequest) as unsent:
        build()
    assert unsent.value.param == "prompt", str(unsent.value)
    assert str(unsent.value) == (f"`prompt` tokens + the default `max_tokens` (16; not sent) must be <= 96. "
                                 f"Given: {96 - room} `prompt` tokens: send `max_tokens` <= {room} or a shorter "
                                 f"`prompt`")
    with pytest.raises(InvalidRequest) as sent:  # sent: named as before
        build(max_tokens=16)
    assert sent.value.param == "max_tokens" and "and 16 `max_tokens`" in str(sent.value)
    assert build(max_tokens=room).max_new_tokens == room


def failed_stream_data(monkeypatch, path: str, body: dict, error: str) -> list[str]:
    """The ``data:`` lines of a stream on an in-process app whose request's last event is made a failure with
    ``error``, after its first tokens."""
    return failed_request(monkeypatch, path, body, error, lambda r: [
        line.removeprefix("data:").strip() for line in r.iter_lines() if line.startswith("data:")])


def failed_request(monkeypatch, path: str, body: dict, error: str, read):
    """``read(response)`` of a request on an in-process app whose last event is made a failure with ``error`` (the
    engine failed that generation; the core goes on), after its first tokens."""
    from dataclasses import replace

    from server.engine.sequence import FinishReason
    from tests.conftest import MODEL_DIR

    app = create_app(load_settings(model_id=str(MODEL_DIR)), load_in_background=False)
    with TestClient(app) as client:
        service = app.state.kvserve.service
        run = service.run

        async def failing(req, receive=None):
            seq, events = await run(req, receive)

            async def stream():
                got = [ev async for ev in events]
                for ev in got[:-1]:
                    yield ev
                yield replace(got[-1], finish_reason=FinishReason.ERROR, error=error)
            return seq, stream()

        monkeypatch.setattr(service, "run", failing)
        with client.stream("POST", path, json=body) as r:
            return read(r)


def test_a_failed_tgi_generation_is_a_424_as_tgi_answers_it(monkeypatch):
    """TGI answers a generation that failed (``InferError::GenerationError``) with 424 Failed Dependency and
    ``error_type`` ``generation``; kvserve's ``/generate`` answered 500."""
    import json

    body = {"inputs": "And God said", "parameters": {"max_new_tokens": 3}}
    status, got = failed_request(monkeypatch, "/generate", body, "boom", lambda r: (r.status_code, json.loads(r.read())))
    assert (status, got) == (424, {"error": "boom", "error_type": "generation"})


def test_a_failed_tgi_stream_ends_with_tgi_s_compact_error_event(monkeypatch):
    """TGI's router writes a failed stream's last event with serde_json (``impl From<InferError> for Event``):
    ``data:{"error":"...","error_type":"generation"}``, compact, its text UTF-8, as every other event of the stream
    is written; kvserve wrote that one with ``json.dumps``'s defaults (``{"error": "...", "error_type": ...}``,
    non-ASCII escaped)."""
    import json

    body = {"inputs": "And God said", "parameters": {"max_new_tokens": 3}}
    data = failed_stream_data(monkeypatch, "/generate_stream", body, "décodage: boom")
    assert len(data) == 3 and all(json.loads(d)["token"] for d in data[:-1])
    assert data[-1] == '{"error":"décodage: boom","error_type":"generation"}'


@pytest.mark.parametrize("path, body, done", [
    ("/v1/completions", {"prompt": "And God said", "max_tokens": 3, "stream": True}, True),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}, True),
    ("/v1/chat/completions", {"model": "tgi", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                              "stream": True}, False)])
def test_a_failed_openai_stream_ends_with_its_error_then_done(monkeypatch, path, body, done):
    """vLLM ends a stream that fails with the error event and then ``data: [DONE]`` (its serving_chat and
    serving_completion), so a client that reads up to ``[DONE]`` stops; kvserve ended it after the error event.
    TGI's chat shape sends no ``[DONE]`` at all (its client reads every line as JSON)."""
    import json

    data = failed_stream_data(monkeypatch, path, body, "boom")
    errors = [i for i, d in enumerate(data) if d != "[DONE]" and "error" in json.loads(d)]
    assert len(errors) == 1 and json.loads(data[errors[0]])["error"] == {"message": "boom", "type": "server_error",
                                                                         "param": None, "code": None}, data
    assert data[errors[0] + 1:] == (["[DONE]"] if done else []), data
