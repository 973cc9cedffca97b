"""``cache_salt`` (vLLM's per-request isolation of the prefix cache) on every generation route: accepted as a
non-empty string of at most 256 characters and carried to the engine's ``Sequence.cache_salt``, refused otherwise
(400 on the OpenAI routes, 422 on TGI's, naming the field), and refused when the server runs without its prefix
cache. And ``usage.prompt_tokens_details.cached_tokens`` from ``Sequence.cached_tokens``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from server.api.openai import _usage
from server.service import MAX_CACHE_SALT_CHARS, GenerationRequest, GenerationService, InvalidRequest, Limits
from server.engine.sampling import SamplingParams
from tests.conftest import MODEL_DIR
from tests.test_service_disconnect import FakeEngine

SALT = "tenant-a:7f3c"
MSG = [{"role": "user", "content": "Who made light?"}]
# route -> (body with `cache_salt` set to the value given, error status, the field's name in the error's text)
ROUTES = {
    "/v1/completions": (lambda s: {"prompt": "And God said", "max_tokens": 2, "cache_salt": s}, 400),
    "/v1/chat/completions": (lambda s: {"messages": MSG, "max_tokens": 2, "cache_salt": s}, 400),
    "/v1/responses": (lambda s: {"input": "Who made light?", "max_output_tokens": 2, "cache_salt": s}, 400),
    "/generate": (lambda s: {"inputs": "And God said", "parameters": {"max_new_tokens": 2, "cache_salt": s}}, 422),
    "/generate_stream": (lambda s: {"inputs": "And God said", "parameters": {"max_new_tokens": 2, "cache_salt": s}},
                         422),
}
BAD = {"empty": "", "number": 7, "list": ["a"], "too-long": "x" * (MAX_CACHE_SALT_CHARS + 1),
       "lone-surrogate": "\ud800"}


def _app(**settings):
    from server.app import create_app
    from server.config import load_settings

    return create_app(load_settings(model_id=str(MODEL_DIR), kv_backends="", **settings), load_in_background=False)


@pytest.fixture(scope="module")
def client():
    """An in-process server whose sequences are recorded as the service builds them."""
    app = _app()
    with TestClient(app) as c:
        service = app.state.kvserve.service
        built, build = [], service.build_request

        def recording(req):
            seq = build(req)
            built.append(seq)
            return seq

        service.build_request = recording
        c.built = built
        yield c


def _post(client, route, body):
    if route.endswith("_stream") or body.get("stream"):
        with client.stream("POST", route, json=body) as r:
            return r.status_code, r.read().decode()
    r = client.post(route, json=body)
    return r.status_code, r.text


@pytest.mark.parametrize("route", ROUTES)
def test_salt_reaches_the_sequence(client, route):
    make, _ = ROUTES[route]
    client.built.clear()
    status, text = _post(client, route, make(SALT))
    assert status == 200, text
    assert client.built and all(seq.cache_salt == SALT for seq in client.built)
    client.built.clear()
    body = make(SALT)
    (body["parameters"] if "parameters" in body else body).pop("cache_salt")
    assert _post(client, route, body)[0] == 200
    assert client.built and all(seq.cache_salt is None for seq in client.built)


def test_salt_reaches_every_choice(client):
    client.built.clear()
    status, text = _post(client, "/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 1, "cache_salt": SALT})
    assert status == 200, text
    assert len(client.built) == 4 and {seq.cache_salt for seq in client.built} == {SALT}


@pytest.mark.parametrize("bad", BAD.values(), ids=list(BAD))
@pytest.mark.parametrize("route", ROUTES)
def test_bad_salt_is_refused_naming_it(client, route, bad):
    make, code = ROUTES[route]
    client.built.clear()
    body = json.dumps(make(bad))  # json.dumps writes a lone surrogate as its \ud800 escape, as a client's JSON can
    r = client.post(route, content=body, headers={"content-type": "application/json"})
    assert r.status_code == code, r.text
    err = r.json()["error"]
    assert "cache_salt" in (err if isinstance(err, str) else err["message"]), err
    if route.startswith("/v1"):
        assert err["param"] == "cache_salt" and err["type"] == "invalid_request_error"
    assert not client.built


def _service(prefix_caching: bool) -> GenerationService:
    from transformers import AutoTokenizer

    return GenerationService(FakeEngine(), AutoTokenizer.from_pretrained(MODEL_DIR), Limits(1023, 1024, 4), "full",
                             prefix_caching=prefix_caching)


def _request(salt, **kw) -> GenerationRequest:
    return GenerationRequest(prompt="And God said", max_new_tokens=4, params=SamplingParams(), stop=[],
                             backend="full", cache_salt=salt, **kw)


def test_without_the_prefix_cache_a_salt_is_refused():
    """KV_PREFIX_CACHING=false: a salt would isolate nothing (an accepted field that does nothing), so it is
    refused naming the field in the route's words; a request without one is served as before."""
    service = _service(prefix_caching=False)
    with pytest.raises(InvalidRequest, match="cache_salt.*KV_PREFIX_CACHING=false") as exc:
        service.build_request(_request(SALT))
    assert exc.value.param == "cache_salt"
    with pytest.raises(InvalidRequest) as exc:
        service.build_request(_request(SALT, fields={"cache_salt": "parameters.cache_salt"}))
    assert exc.value.param == "parameters.cache_salt"
    assert service.build_request(_request(None)).cache_salt is None
    assert _service(prefix_caching=True).build_request(_request(SALT)).cache_salt == SALT


@pytest.mark.parametrize("bad", BAD.values(), ids=list(BAD))
def test_the_service_refuses_a_bad_salt_itself(bad):
    """The schemas refuse these first; a GenerationRequest built elsewhere is checked the same."""
    with pytest.raises(InvalidRequest) as exc:
        _service(prefix_caching=True).build_request(_request(bad))
    assert exc.value.param == "cache_salt"


def test_a_salt_for_a_backend_that_is_never_cached_is_taken():
    """dca (per-sequence stores) and elastic (quantized when the pool ran short) never share blocks, so a salted
    request shares nothing, as the salt promises: it is taken (a client salting every request per tenant must not
    break on a dca or elastic server)."""
    service = _service(prefix_caching=True)
    seq = service.build_request(GenerationRequest(prompt="And God said", max_new_tokens=4, params=SamplingParams(),
                                                  stop=[], backend="dca", cache_salt=SALT))
    assert seq.cache_salt == SALT and seq.backend_name == "dca"


@pytest.fixture(scope="module")
def uncached():
    """An in-process server with KV_PREFIX_CACHING off (one for every route below)."""
    with TestClient(_app(kv_prefix_caching=False)) as c:
        yield c


@pytest.mark.parametrize("route", ROUTES)
def test_server_without_prefix_cache_refuses_a_salt(route, uncached):
    make, code = ROUTES[route]
    r = uncached.post(route, json=make(SALT))
    assert r.status_code == code, r.text
    err = r.json()["error"]
    assert "cache_salt" in (err if isinstance(err, str) else err["message"])
    body = make(SALT)
    (body["parameters"] if "parameters" in body else body).pop("cache_salt")
    assert _post(uncached, route, body)[0] == 200


def test_usage_reports_cached_prompt_tokens():
    """OpenAI's (and vLLM's) `prompt_tokens_details.cached_tokens`: the counted prompts' tokens served from the
    prefix cache (one sequence per prompt: n choices of one prompt share its prefill)."""
    seqs = [SimpleNamespace(prompt_ids=[1] * 40, output_ids=[2] * 3, cached_tokens=c, kv_stats={}) for c in (32, 32, 16, 16)]
    usage = _usage(seqs, seqs[::2])
    assert usage.prompt_tokens == 80 and usage.completion_tokens == 12
    assert usage.prompt_tokens_details.cached_tokens == 48
    assert usage.model_dump()["prompt_tokens_details"] == {"cached_tokens": 48}


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_usage_carries_cached_tokens_stream_or_not(client, route):
    """On the wire: the non-streaming answer's usage and the stream's final usage chunk."""
    make, _ = ROUTES[route]
    out = client.post(route, json=make(SALT)).json()
    details = out["usage"]["prompt_tokens_details"]
    assert 0 <= details["cached_tokens"] <= out["usage"]["prompt_tokens"]
    body = {**make(SALT), "stream": True, "stream_options": {"include_usage": True}}
    status, text = _post(client, route, body)
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert status == 200 and chunks[-1]["choices"] == []
    final = chunks[-1]["usage"]
    assert 0 <= final["prompt_tokens_details"]["cached_tokens"] <= final["prompt_tokens"]
    resp = client.post("/v1/responses", json=ROUTES["/v1/responses"][0](SALT)).json()
    assert 0 <= resp["usage"]["input_tokens_details"]["cached_tokens"] <= resp["usage"]["input_tokens"]


def test_salt_isolates_the_prefix_cache(client):
    """End to end with the prefix cache: a repeated prompt is served from the cache only for the same salt, and
    `cached_tokens` says so, streamed or not; no salt and another salt share nothing with it."""
    import uuid

    long = " ".join(["And God said"] * 24)
    a, b = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"

    def cached(salt, route="/v1/completions"):
        body = ({"prompt": long} if route == "/v1/completions" else {"messages": [{"role": "user", "content": long}]})
        body = {**body, "max_tokens": 1, **({"cache_salt": salt} if salt else {})}
        if route == "/v1/completions":
            return client.post(route, json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        status, text = _post(client, route, {**body, "stream": True, "stream_options": {"include_usage": True}})
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        return chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(a) == 0 and cached(a) > 0
    assert cached(b) == 0 and cached(None) == 0  # (no other test of this module sends this prompt)
    assert cached(f"c-{uuid.uuid4().hex}", "/v1/chat/completions") == 0
    assert cached(a, "/v1/chat/completions") == 0  # another prompt (the chat template's), the same salt
    assert cached(a, "/v1/chat/completions") > 0
