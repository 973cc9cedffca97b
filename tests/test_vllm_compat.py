"""What clients written for vLLM rely on (#26): SSE framed with `\\n`, vLLM's tokenizer routes, the bundled chat
template, the Responses API, and `model` checked against the served names. Against a real server."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import MODEL_DIR

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who made light?"}]
STREAMS = [("/generate_stream", {"inputs": "And God said", "parameters": {"max_new_tokens": 4}}),
           ("/generate", {"inputs": "And God said", "parameters": {"max_new_tokens": 4}, "stream": True}),
           ("/", {"inputs": "And God said", "parameters": {"max_new_tokens": 4}, "stream": True}),
           ("/v1/completions", {"prompt": "And God said", "max_tokens": 4, "stream": True}),
           ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "stream": True}),
           ("/v1/responses", {"input": "Who made light?", "max_output_tokens": 4, "stream": True})]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


def raw_stream(srv, path, body) -> bytes:
    with httpx.stream("POST", srv.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return b"".join(r.iter_raw())


@pytest.mark.parametrize("path,body", STREAMS, ids=[p for p, _ in STREAMS])
def test_sse_events_are_framed_with_newlines(server, path, body):
    """Every event ends with `\\n\\n` and no `\\r` is sent: a client splitting on `\\n\\n` (inference-perf) sees
    every event (sse-starlette's default was `\\r\\n`, and inference-perf saw 0 tokens)."""
    data = raw_stream(server, path, body)
    assert b"\r" not in data and data.endswith(b"\n\n")
    events = [e for e in data.split(b"\n\n") if e]
    assert len(events) >= 3 and all(e.split(b"\n")[-1].startswith(b"data: ") for e in events)
    if path.startswith("/v1/") and path != "/v1/responses":
        assert events[-1] == b"data: [DONE]"


def test_tokenize_detokenize_and_tokenizer_info_have_vllms_shapes(server, tok):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "And God said", "return_token_strs": True}).json()
    ids = tok.encode("And God said")
    assert r == {"count": len(ids), "max_model_len": 1024, "tokens": ids, "token_strs": tok.convert_ids_to_tokens(ids)}
    assert set(httpx.post(server.url + "/tokenize", json={"prompt": "x"}).json()) == {"count", "max_model_len", "tokens"}
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json() == {"prompt": "And God said"}
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["tokenizer_class"] and info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == 1024
    for path, body, param in [("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/tokenize", {"prompt": "x", "model": "gpt-4"}, "model")]:
        r = httpx.post(server.url + path, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


def test_chat_template_gives_the_servers_tokens(server, tok):
    """The bundled models carry the plain template the server used without one: a client applying it counts
    the tokens the server feeds the model (usage.prompt_tokens, /tokenize with messages)."""
    assert tok.chat_template
    client_ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == "System: Be brief.\nUser: Who made light?\nAssistant:"
    assert httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"] == list(client_ids)
    usage = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1},
                       timeout=60).json()["usage"]
    assert usage["prompt_tokens"] == len(client_ids)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Who made "}, {"type": "text", "text": "light?"}]}]
    assert tok.apply_chat_template(parts, tokenize=False, add_generation_prompt=True) == "User: Who made light?\nAssistant:"


def test_responses_api_text_in_text_out(server):
    from openai import OpenAI

    oai = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    chat = oai.chat.completions.create(model=MODEL_DIR.name, messages=MESSAGES, max_tokens=8, temperature=0)
    out = oai.responses.create(model=MODEL_DIR.name, instructions="Be brief.", input="Who made light?",
                               max_output_tokens=8, temperature=0)
    assert out.output_text == chat.choices[0].message.content
    assert out.usage.input_tokens == chat.usage.prompt_tokens and out.usage.output_tokens == 8
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    items = [{"role": "system", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Who made light?"}]}]
    assert oai.responses.create(model=MODEL_DIR.name, input=items, max_output_tokens=8,
                                temperature=0).output_text == out.output_text
    events = list(oai.responses.create(model=MODEL_DIR.name, instructions="Be brief.", input="Who made light?",
                                       max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == out.output_text
    assert events[-1].response.output_text == out.output_text


@pytest.mark.parametrize("field,value", [("tools", [{"type": "function", "name": "f"}]), ("previous_response_id", "r"),
                                         ("reasoning", {"effort": "low"}), ("include", ["x"]),
                                         ("input", [{"type": "function_call_output", "call_id": "c", "output": "o"}]),
                                         ("input", [{"role": "user", "content": [{"type": "input_text"}]}])])
def test_responses_api_refuses_what_it_does_not_serve(server, field, value):
    body = {"input": "Who made light?", field: value}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(field), r.text


def test_model_is_checked_against_the_served_names(server):
    for path, body in [("/v1/completions", {"prompt": "a", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}),
                       ("/v1/responses", {"input": "a", "max_output_tokens": 1})]:
        r = httpx.post(server.url + path, json={**body, "model": "gpt-4"}, timeout=60)
        assert r.status_code == 404, r.text
        assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                     "param": "model", "code": "model_not_found"}
        assert "gpt-4" in r.json()["error"]["message"]
        for ok in (str(MODEL_DIR), MODEL_DIR.name, "tgi", "dummy", None):
            assert httpx.post(server.url + path, json={**body, "model": ok}, timeout=60).status_code == 200


def test_the_served_name_is_model_id_as_given(server):
    """As vLLM names a local model: by the path it was given (tools load the tokenizer from the served name), the
    folder's name kept as an alias; answers carry the first."""
    assert httpx.get(server.url + "/info").json()["served_model_names"] == [str(MODEL_DIR), MODEL_DIR.name]
    assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == [str(MODEL_DIR)]
    for name in (str(MODEL_DIR), MODEL_DIR.name):
        out = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1,
                                                                     "model": name}, timeout=60)
        assert out.status_code == 200 and out.json()["model"] == str(MODEL_DIR), out.text


def test_served_model_name_aliases(tmp_path):
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.config import load_settings

    app = create_app(load_settings(served_model_name="kjv, my-org/kjv", model_id=str(MODEL_DIR)),
                     load_in_background=False)
    with TestClient(app) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["kjv"]
        for name in ("kjv", "my-org/kjv"):
            out = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "model": name})
            assert out.status_code == 200 and out.json()["model"] == "kjv"
        assert client.post("/v1/completions", json={"prompt": "a", "model": MODEL_DIR.name}).status_code == 404
