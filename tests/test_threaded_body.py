"""Large JSON bodies are parsed and validated off the event loop (server/api/threaded_body.py), with FastAPI's
answers: the server's routes read a 1.8 MB body of 64 x 7,420 token ids in a worker thread (a value test: where the
parse and the validation ran, not how long they took), and valid, invalid and broken bodies get what FastAPI's own
routes answer."""

from __future__ import annotations

import asyncio
import json
import sys

import pydantic
import pytest
from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from server.api.request_model import RequestModel
from server.api.threaded_body import ThreadedBodyRoute
from server.errors import install_error_handlers
from server.middleware import SMALL_BODY_BYTES

BIG = json.dumps({"model": "m", "prompt": [[(i * 7 + k) % 500 + 10 for i in range(7420)] for k in range(64)],
                  "max_tokens": 1}, separators=(",", ":")).encode()


def _on_loop() -> bool:
    return asyncio._get_running_loop() is not None


@pytest.fixture
def where(monkeypatch):
    """``{"parse": [...], "validate": [...]}``: for each ``json.loads`` of a body over SMALL_BODY_BYTES and each
    pydantic validation of raw JSON (a dict, not a model instance), whether it ran on the event loop."""
    seen = {"parse": [], "validate": []}
    loads, validate = json.loads, pydantic.TypeAdapter.validate_python

    def spy_loads(s, *args, **kwargs):
        if len(s) > SMALL_BODY_BYTES:
            seen["parse"].append(_on_loop())
        return loads(s, *args, **kwargs)

    def spy_validate(self, value, *args, **kwargs):
        if isinstance(value, dict) and ("prompt" in value or "inputs" in value):
            seen["validate"].append(_on_loop())
        return validate(self, value, *args, **kwargs)

    monkeypatch.setattr(json, "loads", spy_loads)
    monkeypatch.setattr(pydantic.TypeAdapter, "validate_python", spy_validate)
    return seen


def test_the_servers_routes_parse_a_large_body_off_the_event_loop(where):
    """/v1/completions with the issue's body (64 prompts x 7,420 token ids): every parse
    and every validation of it runs in a worker thread (before: on the loop, holding /health 150-430 ms for three
    such bodies), and /generate with a 100 kB prompt; the model is not loaded, so a valid body then gets 503, an
    invalid one 400 naming its field."""
    from server.app import create_app
    from server.config import load_settings

    app = create_app(load_settings())
    app.state.kvserve.info["max_total_tokens"] = 8192  # as SmolLM2's; no lifespan: the model never loads
    client = TestClient(app)
    headers = {"content-type": "application/json"}
    assert client.post("/v1/completions", content=BIG, headers=headers).status_code == 503
    ids = json.dumps({"inputs": "x" * 100_000, "parameters": {"max_new_tokens": 1}}).encode()
    assert client.post("/generate", content=ids, headers=headers).status_code == 503
    assert where["parse"] and not any(where["parse"]), where
    assert where["validate"] and not any(where["validate"]), where
    bad = BIG.replace(b'"max_tokens":1', b'"max_tokens":"many"')
    r = client.post("/v1/completions", content=bad, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert not any(where["parse"] + where["validate"])


def test_a_small_body_is_read_as_fastapi_reads_it(where):
    client = TestClient(_app(ThreadedBodyRoute))
    r = client.post("/echo", json={"prompt": [[1, 2]], "max_tokens": 1})
    assert r.status_code == 200 and r.json() == {"prompts": 1, "tokens": 2}
    assert where["validate"] == [True]  # on the loop: too few values to hold it


class Body(RequestModel):
    model: str = "m"
    prompt: list[list[int]]
    max_tokens: int = pydantic.Field(16, ge=1)


def _app(route_class) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    router = APIRouter(route_class=route_class)

    @router.post("/echo")
    async def echo(body: Body):
        return {"prompts": len(body.prompt), "tokens": sum(map(len, body.prompt))}

    app.include_router(router)
    return app


@pytest.mark.parametrize("body", [
    BIG,
    BIG[:-20],  # not JSON: cut short
    BIG.replace(b'"max_tokens":1', b'"max_tokens":0'),  # out of range
    BIG.replace(b"[10,", b'["ten",', 1),  # a string among the token ids
    BIG.replace(b'"prompt":', b'"prompts":'),  # a required field missing
    b"[" + BIG + b"]",  # not an object
    b'{"prompt":' + b"[" * 5000 + b"1" + b"]" * 5000 + b',"pad":"' + b"x" * SMALL_BODY_BYTES + b'"}',  # too deep
    BIG.replace(b'"m"', b'"\xff"'),  # not UTF-8
], ids=["valid", "cut", "range", "type", "missing", "array", "deep", "utf8"])
def test_the_answers_are_fastapis_own(body):
    """The same status and body from a route of each class, for a large body valid, not JSON, or invalid."""
    plain, threaded = TestClient(_app(APIRoute)), TestClient(_app(ThreadedBodyRoute))
    headers = {"content-type": "application/json"}
    want, got = plain.post("/echo", content=body, headers=headers), threaded.post("/echo", content=body,
                                                                                   headers=headers)
    assert (got.status_code, got.json()) == (want.status_code, want.json())


@pytest.mark.parametrize("route_class", [APIRoute, ThreadedBodyRoute])
@pytest.mark.parametrize("pad", [0, SMALL_BODY_BYTES], ids=["small", "large"])
@pytest.mark.parametrize("body, reason", [
    (b'{"prompt":[[1]],"max_tokens":' + b"9" * 5000 + b"}", "an integer has more than 4300 digits"),
    (b'{"prompt":' + b"[" * 5000 + b"1" + b"]" * 5000 + b"}", "JSON nested too deeply to parse"),
    (b'{"prompt":[["\xff"]]}', "There was an error parsing the body (expected UTF-8 JSON)"),
], ids=["bignum", "deep", "utf8"])
def test_a_body_that_cannot_be_parsed_is_answered_with_its_reason(route_class, pad, body, reason):
    """UTF-8 JSON that Python's parser refuses (an integer past its 4,300-digit limit, nesting past its recursion
    limit) is a 400 that says so, not "expected UTF-8 JSON"; bodies of either size, through either route class."""
    body = body[:-1] + b',"pad":"' + b"x" * pad + b'"}' if pad else body
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)  # Python's default (a test runner may raise it, and 5,000 levels then parse)
    try:
        r = TestClient(_app(route_class)).post("/echo", content=body, headers={"content-type": "application/json"})
    finally:
        sys.setrecursionlimit(limit)
    assert r.status_code == 422 and r.json()["error"] == f"invalid request body: {reason}", r.text
