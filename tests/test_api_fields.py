"""Every documented request field of both APIs has an effect (checked by value) or is refused with a 4xx
naming it; nothing is silently ignored. Plus the OpenAI and TGI wire details real clients rely on."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from server.api.openai_schemas import ChatRequest, CompletionRequest
from server.api.tgi_schemas import TGIParameters, TGIRequest
from tests.conftest import MODEL_DIR
from tests.json_http import post, sse

PROMPT = "And God said"
EOS = 0


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


_BASELINES: dict = {}


def _baseline(srv, path, body):
    """The greedy answer without any optional field, asked once per server (it is deterministic)."""
    key = (srv.url, path)
    if key not in _BASELINES:
        _BASELINES[key] = post(srv, path, body)
    return _BASELINES[key]


def gen(srv, **params):
    body = {"inputs": params.pop("inputs", PROMPT), "parameters": {"max_new_tokens": 10, "details": True, **params}}
    return post(srv, "/generate", body) if params or body["inputs"] != PROMPT else _baseline(srv, "/generate", body)


def cmpl(srv, **fields):
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, **fields}
    return post(srv, "/v1/completions", body) if fields else _baseline(srv, "/v1/completions", body)


def chat(srv, **fields):
    body = {"messages": [{"role": "user", "content": "Who made light?"}], "max_tokens": 10, "temperature": 0, **fields}
    return post(srv, "/v1/chat/completions", body) if fields else _baseline(srv, "/v1/chat/completions", body)


def text(out) -> str:
    return out["generated_text"] if "generated_text" in out else out["choices"][0].get("text") or \
        out["choices"][0]["message"]["content"]


def refused(srv, path, body, field, status):
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == status, (body, r.text)
    err = r.json()["error"]
    message = err if isinstance(err, str) else err["message"]
    assert field in message, (field, message)
    if path.startswith("/v1"):
        assert err["param"] == field and err["type"] == "invalid_request_error"


# ---- TGI -------------------------------------------------------------------------------------------

def tgi_max_new_tokens(srv, tok):
    assert gen(srv, max_new_tokens=3)["details"]["generated_tokens"] == 3


def tgi_sampling_rule(srv, tok):
    """temperature, top_k, top_p, typical_p each switch sampling on (TGI's rule); temperature 0 is greedy."""
    greedy = gen(srv)
    assert greedy["details"]["seed"] is None
    for field, value in (("temperature", 1.3), ("top_k", 50), ("top_p", 0.95), ("typical_p", 0.95)):
        a, b = gen(srv, **{field: value, "seed": 1}), gen(srv, **{field: value, "seed": 2})
        assert a["details"]["seed"] == 1 and b["details"]["seed"] == 2, field
        assert a["generated_text"] != b["generated_text"], field
    assert gen(srv, temperature=1.3, seed=1)["generated_text"] == gen(srv, temperature=1.3, seed=1)["generated_text"]
    assert gen(srv, temperature=0, do_sample=True, seed=1)["generated_text"] == greedy["generated_text"]
    assert gen(srv, do_sample=True, seed=3)["details"]["seed"] == 3


def tgi_top_k_one_is_greedy(srv, tok):
    assert gen(srv, top_k=1, seed=5)["generated_text"] == gen(srv)["generated_text"]


def tgi_stop(srv, tok):
    full = gen(srv)["generated_text"]
    out = gen(srv, stop=[full[8:12]])
    assert out["generated_text"] == full[: full.index(full[8:12])] and out["details"]["finish_reason"] == "stop_sequence"


def tgi_repetition_penalty(srv, tok):
    assert gen(srv, repetition_penalty=1.3)["generated_text"] != gen(srv)["generated_text"]


def tgi_frequency_penalty(srv, tok):
    base, pen = gen(srv), gen(srv, frequency_penalty=2.0)
    assert pen["generated_text"] != base["generated_text"]
    assert pen["generated_text"].count("Israel") < base["generated_text"].count("Israel")


def tgi_truncate(srv, tok):
    long = "In the beginning God created the heaven"
    out = gen(srv, inputs=long, truncate=3, decoder_input_details=True)
    kept = tok.encode(long)[-3:]
    assert [t["id"] for t in out["details"]["prefill"]] == kept
    assert out["generated_text"] == text(cmpl(srv, prompt=kept))
    assert out["generated_text"] != gen(srv, inputs=long)["generated_text"]


def tgi_top_n_tokens(srv, tok):
    out = gen(srv, top_n_tokens=3)
    tops, tokens = out["details"]["top_tokens"], out["details"]["tokens"]
    assert len(tops) == len(tokens) == 10
    for top, token in zip(tops, tokens):
        assert len(top) == 3 and top[0]["id"] == token["id"]  # greedy: the chosen token is the most likely
        assert top[0]["logprob"] == pytest.approx(token["logprob"])
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
    events = sse(srv, "/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "top_n_tokens": 2}})
    assert [len(e["top_tokens"]) for e in events] == [2, 2, 2, 2]
    assert "top_tokens" not in gen(srv)["details"]


def tgi_best_of(srv, tok):
    out = gen(srv, best_of=2, do_sample=True)
    others = out["details"]["best_of_sequences"]
    assert len(others) == 1
    best = sum(t["logprob"] for t in out["details"]["tokens"])
    assert best >= sum(t["logprob"] for t in others[0]["tokens"])
    assert out["details"]["seed"] != others[0]["seed"]
    refused(srv, "/generate", {"inputs": PROMPT, "parameters": {"best_of": 2}}, "best_of", 422)
    refused(srv, "/generate", {"inputs": PROMPT, "parameters": {"best_of": 2, "do_sample": True, "seed": 1}},
            "seed", 422)
    refused(srv, "/generate_stream", {"inputs": PROMPT, "parameters": {"best_of": 2, "do_sample": True}},
            "best_of", 422)


def tgi_details(srv, tok):
    assert "details" not in post(srv, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
    assert gen(srv)["details"]["generated_tokens"] == 10


def tgi_decoder_input_details(srv, tok):
    assert gen(srv)["details"]["prefill"] == []
    prefill = gen(srv, decoder_input_details=True)["details"]["prefill"]
    assert [t["id"] for t in prefill] == tok.encode(PROMPT) and prefill[0]["logprob"] is None


def tgi_return_full_text(srv, tok):
    assert gen(srv, return_full_text=True)["generated_text"] == PROMPT + gen(srv)["generated_text"]


def tgi_seed(srv, tok):
    assert gen(srv, do_sample=True, seed=9)["generated_text"] == gen(srv, do_sample=True, seed=9)["generated_text"]


def tgi_kv_backend(srv, tok):
    refused(srv, "/generate", {"inputs": PROMPT, "parameters": {"kv_backend": "nope"}}, "kv_backend", 422)


def tgi_cache_salt(srv, tok):
    """The salt changes which cached blocks a request may share, never its tokens; a bad one is refused."""
    assert gen(srv, cache_salt="tenant-a")["generated_text"] == gen(srv)["generated_text"]
    refused(srv, "/generate", {"inputs": PROMPT, "parameters": {"cache_salt": ""}}, "cache_salt", 422)
    refused(srv, "/generate", {"inputs": PROMPT, "parameters": {"cache_salt": 1}}, "cache_salt", 422)


def tgi_stream(srv, tok):
    events = sse(srv, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 3}, "stream": True})
    assert len(events) == 3 and events[-1]["generated_text"] == gen(srv, max_new_tokens=3)["generated_text"]


def tgi_inputs(srv, tok):
    assert gen(srv, inputs="In the beginning")["generated_text"] != gen(srv)["generated_text"]


def tgi_grammar(srv, tok):
    """The output follows the regular expression (the JSON cases: tests/test_structured_outputs.py)."""
    assert gen(srv, grammar={"type": "regex", "value": "(yea|nay)\\."})["generated_text"] in ("yea.", "nay.")


TGI_CASES = {
    "grammar": tgi_grammar, "inputs": tgi_inputs, "stream": tgi_stream, "max_new_tokens": tgi_max_new_tokens, "temperature": tgi_sampling_rule,
    "top_p": tgi_sampling_rule, "top_k": tgi_top_k_one_is_greedy, "typical_p": tgi_sampling_rule,
    "do_sample": tgi_sampling_rule, "seed": tgi_seed, "stop": tgi_stop, "repetition_penalty": tgi_repetition_penalty,
    "frequency_penalty": tgi_frequency_penalty, "truncate": tgi_truncate, "top_n_tokens": tgi_top_n_tokens,
    "best_of": tgi_best_of, "details": tgi_details, "decoder_input_details": tgi_decoder_input_details,
    "return_full_text": tgi_return_full_text, "kv_backend": tgi_kv_backend, "cache_salt": tgi_cache_salt,
}


# ---- OpenAI ----------------------------------------------------------------------------------------

def oa_prompt_forms(srv, tok):
    ids = tok.encode(PROMPT)
    one = cmpl(srv)["choices"][0]["text"]
    assert cmpl(srv, prompt=ids)["choices"][0]["text"] == one
    out = cmpl(srv, prompt=[PROMPT, "In the beginning"])
    assert [c["index"] for c in out["choices"]] == [0, 1] and out["choices"][0]["text"] == one
    assert out["choices"][1]["text"] == cmpl(srv, prompt="In the beginning")["choices"][0]["text"]
    out = cmpl(srv, prompt=[ids, tok.encode("In the beginning")])
    assert [c["text"] for c in out["choices"]] == [one, out["choices"][1]["text"]] and len(out["choices"]) == 2
    assert out["usage"]["prompt_tokens"] == len(ids) + len(tok.encode("In the beginning"))
    refused(srv, "/v1/completions", {"prompt": [tok.vocab_size + 5]}, "prompt", 400)


def oa_max_tokens(srv, tok):
    assert cmpl(srv, max_tokens=3)["usage"]["completion_tokens"] == 3
    assert cmpl(srv, max_tokens=9, max_completion_tokens=4)["usage"]["completion_tokens"] == 4
    assert chat(srv, max_tokens=None, max_completion_tokens=5)["usage"]["completion_tokens"] == 5
    # the defaults the README states: 16 for completions (OpenAI's), 100 for chat (as /generate)
    assert cmpl(srv, max_tokens=None, ignore_eos=True)["usage"]["completion_tokens"] == 16
    assert chat(srv, max_tokens=None, ignore_eos=True)["usage"]["completion_tokens"] == 100


def oa_temperature_seed_n(srv, tok):
    a = cmpl(srv, temperature=1.0, seed=7, n=2)
    assert [c["index"] for c in a["choices"]] == [0, 1]
    for j in range(2):  # choice j uses seed + j
        assert a["choices"][j]["text"] == cmpl(srv, temperature=1.0, seed=7 + j)["choices"][0]["text"]
    assert a["choices"][0]["text"] != a["choices"][1]["text"]
    out = cmpl(srv, prompt=[PROMPT, "In the beginning"], n=2)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    c = chat(srv, n=3, temperature=1.0, seed=1)
    assert [x["index"] for x in c["choices"]] == [0, 1, 2]


def oa_top_p(srv, tok):
    greedy = cmpl(srv)["choices"][0]["text"]
    assert cmpl(srv, temperature=1.0, top_p=1e-6, seed=3)["choices"][0]["text"] == greedy


def oa_top_k(srv, tok):
    greedy = cmpl(srv)["choices"][0]["text"]
    assert cmpl(srv, temperature=1.0, top_k=1, seed=3)["choices"][0]["text"] == greedy


def oa_stop(srv, tok):
    full = cmpl(srv)["choices"][0]["text"]
    for stop in (full[8:12], [full[8:12], "zzz"]):
        out = cmpl(srv, stop=stop)["choices"][0]
        assert out["text"] == full[: full.index(full[8:12])] and out["finish_reason"] == "stop"


def oa_penalties(srv, tok):
    base = cmpl(srv, max_tokens=12)["choices"][0]["text"]
    for field in ("frequency_penalty", "presence_penalty"):
        out = cmpl(srv, max_tokens=12, **{field: 2.0})["choices"][0]["text"]
        assert out.count("Israel") < base.count("Israel"), (field, out)
    assert cmpl(srv, max_tokens=12, repetition_penalty=1.3)["choices"][0]["text"] != base


def oa_logit_bias(srv, tok):
    target = tok.encode(" light")[0]
    out = cmpl(srv, max_tokens=3, logit_bias={str(target): 100}, logprobs=0)
    assert out["choices"][0]["logprobs"]["tokens"] == [" light"] * 3


def oa_eos_controls(srv, tok):
    force_eos = {str(EOS): 100}
    out = cmpl(srv, logit_bias=force_eos)
    assert out["usage"]["completion_tokens"] == 1 and out["choices"][0]["finish_reason"] == "stop"
    out = cmpl(srv, logit_bias=force_eos, min_tokens=4)
    assert out["usage"]["completion_tokens"] == 5 and out["choices"][0]["finish_reason"] == "stop"
    out = cmpl(srv, logit_bias=force_eos, ignore_eos=True, max_tokens=6)
    assert out["usage"]["completion_tokens"] == 6 and out["choices"][0]["finish_reason"] == "length"
    refused(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "min_tokens": 3}, "min_tokens", 400)


def oa_echo_logprobs(srv, tok, ref_model=None):
    ids = tok.encode(PROMPT)
    out = cmpl(srv, max_tokens=0, echo=True, logprobs=2)
    choice = out["choices"][0]
    assert choice["text"] == PROMPT and out["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.decode([i]) for i in ids] and lp["token_logprobs"][0] is None
    assert lp["text_offset"] == [0, 3, 7] and lp["top_logprobs"][0] is None
    assert all(len(top) in (2, 3) for top in lp["top_logprobs"][1:])
    gen_ = cmpl(srv, max_tokens=3, logprobs=1)["choices"][0]
    assert len(gen_["logprobs"]["tokens"]) == 3 and "".join(gen_["logprobs"]["tokens"]) == gen_["text"]
    for token, logprob, top in zip(*(gen_["logprobs"][k] for k in ("tokens", "token_logprobs", "top_logprobs"))):
        assert top[token] == logprob == max(top.values())  # greedy: the chosen token is the most likely
    assert cmpl(srv, echo=True, max_tokens=2)["choices"][0]["text"].startswith(PROMPT)


def oa_best_of(srv, tok):
    out = cmpl(srv, temperature=1.0, best_of=3, n=1, logprobs=0, seed=4)
    best = sum(out["choices"][0]["logprobs"]["token_logprobs"])
    for j in range(3):
        other = cmpl(srv, temperature=1.0, seed=4 + j, logprobs=0)["choices"][0]["logprobs"]["token_logprobs"]
        assert best >= sum(other) - 1e-4  # the same sample scored in a batch of 3 and alone: fp32 rounding
    refused(srv, "/v1/completions", {"prompt": PROMPT, "best_of": 2, "stream": True}, "best_of", 400)


def oa_stream(srv, tok):
    whole = cmpl(srv)["choices"][0]["text"]
    chunks = sse(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "stream": True,
                                          "stream_options": {"include_usage": True}})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole
    assert chunks[-1]["usage"]["completion_tokens"] == 10
    chunks = sse(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                               "temperature": 0, "stream": True})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] == "length"
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        for options in ({"include_usage": True}, {"continuous_usage_stats": True}):  # would do nothing: refused
            refused(srv, path, {**body, "max_tokens": 2, "stream_options": options}, "stream_options", 400)
        assert post(srv, path, {**body, "max_tokens": 2, "stream_options": {"include_usage": False}})["choices"]


def oa_chat_messages(srv, tok):
    parts = chat(srv, messages=[{"role": "user", "content": [{"type": "text", "text": "Who made "},
                                                             {"type": "text", "text": "light?"}]}])
    assert text(parts) == text(chat(srv))
    assert text(chat(srv, messages=[{"role": "user", "content": "In the beginning"}])) != text(chat(srv))
    refused(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content[0].type", 400)
    for part in ({"type": "text"}, {"type": "text", "text": None}):  # OpenAI's schema requires a text part's text
        refused(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "Hi"}, part]}]}, "messages[0].content[1].text", 400)


def oa_chat_logprobs(srv, tok):
    out = chat(srv, logprobs=True, top_logprobs=2)["choices"][0]
    content = out["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == out["message"]["content"]
    for c in content:
        assert len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["logprob"] == pytest.approx(c["logprob"])
        assert c["bytes"] == list(c["token"].encode())
    assert chat(srv)["choices"][0]["logprobs"] is None
    refused(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs", 400)


def oa_kv_backend(srv, tok):
    refused(srv, "/v1/completions", {"prompt": PROMPT, "kv_backend": "nope"}, "kv_backend", 400)


def oa_cache_salt(srv, tok):
    """Same tokens with a salt; a bad salt is refused; and once the prefix cache serves a repeated long prompt
    (`cached_tokens` > 0), a salt never seen before gets none of it."""
    assert text(cmpl(srv, cache_salt="tenant-a")) == text(cmpl(srv))
    assert text(chat(srv, cache_salt="tenant-a")) == text(chat(srv))
    refused(srv, "/v1/completions", {"prompt": PROMPT, "cache_salt": ""}, "cache_salt", 400)
    refused(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "cache_salt": "x" * 257},
            "cache_salt", 400)
    long = " ".join([PROMPT] * 24)
    for _ in range(2):
        again = cmpl(srv, prompt=long, max_tokens=1, cache_salt="tenant-b")["usage"]
    assert 0 <= again["prompt_tokens_details"]["cached_tokens"] <= again["prompt_tokens"]
    if again["prompt_tokens_details"]["cached_tokens"]:
        fresh = cmpl(srv, prompt=long, max_tokens=1, cache_salt=f"tenant-{uuid.uuid4().hex}")["usage"]
        assert fresh["prompt_tokens_details"]["cached_tokens"] == 0


def oa_model_user(srv, tok):
    """`model` names the served model (or huggingface_hub's placeholder `tgi`), else 404 `model_not_found`; `user`
    is informational (as in OpenAI): same output."""
    assert text(cmpl(srv, model=MODEL_DIR.name, user="u1")) == text(cmpl(srv, model="tgi")) == text(cmpl(srv))
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "model": "gpt-4"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def oa_response_format(srv, tok):
    """`}` pushed up: alone it is not JSON; with `json_object` it is `{}` (tests/test_structured_outputs.py)."""
    assert not text(cmpl(srv, max_tokens=20, logit_bias={"93": 8})).startswith("{")
    assert text(cmpl(srv, max_tokens=20, logit_bias={"93": 8}, response_format={"type": "json_object"})) == "{}"


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}


def oa_tools(srv, tok):
    """`tools` reach the prompt; `tool_choice` none gives content, a named function a call of it; with
    `parallel_tool_calls: false`, `required` gives one call (tests/test_structured_outputs.py)."""
    none = chat(srv, tools=[WEATHER], tool_choice="none")
    assert none["usage"]["prompt_tokens"] > chat(srv)["usage"]["prompt_tokens"] and text(none) is not None
    named = chat(srv, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                 max_tokens=30)["choices"][0]
    assert named["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    one = chat(srv, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=60)["choices"][0]
    assert len(one["message"]["tool_calls"]) == 1 and one["finish_reason"] == "tool_calls"


def oa_guided(srv, tok):
    """vLLM's structured outputs: the output is one of the choices (tests/test_structured_outputs.py)."""
    for fields in ({"guided_choice": ["yea", "nay"]}, {"structured_outputs": {"choice": ["yea", "nay"]}},
                   {"guided_regex": "yea|nay"}, {"guided_json": {"enum": ["yea", "nay"]}}):
        assert text(cmpl(srv, **fields)).strip('"') in ("yea", "nay")


OPENAI_CASES = {
    "structured_outputs": oa_guided, "guided_json": oa_guided, "guided_regex": oa_guided, "guided_choice": oa_guided,
    "response_format": oa_response_format, "tools": oa_tools, "tool_choice": oa_tools, "parallel_tool_calls": oa_tools,
    "prompt": oa_prompt_forms, "max_tokens": oa_max_tokens, "max_completion_tokens": oa_max_tokens,
    "temperature": oa_temperature_seed_n, "seed": oa_temperature_seed_n, "n": oa_temperature_seed_n,
    "top_p": oa_top_p, "top_k": oa_top_k, "stop": oa_stop, "frequency_penalty": oa_penalties,
    "presence_penalty": oa_penalties, "repetition_penalty": oa_penalties, "logit_bias": oa_logit_bias,
    "ignore_eos": oa_eos_controls, "min_tokens": oa_eos_controls, "echo": oa_echo_logprobs,
    "logprobs": oa_echo_logprobs, "best_of": oa_best_of, "stream": oa_stream, "stream_options": oa_stream,
    "messages": oa_chat_messages, "top_logprobs": oa_chat_logprobs, "kv_backend": oa_kv_backend,
    "model": oa_model_user, "user": oa_model_user, "cache_salt": oa_cache_salt,
}


def test_every_documented_field_is_covered():
    """Adding a field to a request schema without a case here fails this test."""
    tgi = set(TGIParameters.model_fields) | set(TGIRequest.model_fields) - {"parameters"}
    assert tgi == set(TGI_CASES)
    assert set(CompletionRequest.model_fields) | set(ChatRequest.model_fields) == set(OPENAI_CASES)


@pytest.mark.parametrize("case", sorted(set(TGI_CASES.values()) | set(OPENAI_CASES.values()), key=lambda f: f.__name__),
                         ids=lambda f: f.__name__)
def test_field_has_its_effect(server, tok, case):
    case(server, tok)


def test_chat_logprobs_field(server, tok):
    oa_chat_logprobs(server, tok)  # `logprobs` on chat (a bool there)


REFUSED_OPENAI = {"suffix": "x", "functions": [{"name": "f"}], "audio": {"voice": "x"}, "made_up_field": 1}
REFUSED_COMPLETIONS = {"tools": [{"type": "function"}], "tool_choice": "auto", "parallel_tool_calls": True}
"""Chat's tool fields (tests/test_structured_outputs.py) mean nothing to a completion."""
REFUSED_TGI = {"watermark": True, "adapter_id": "x", "made_up": 1}


@pytest.mark.parametrize("field,value", REFUSED_OPENAI.items(), ids=list(REFUSED_OPENAI))
def test_unimplemented_openai_fields_are_400_naming_them(server, field, value):
    refused(server, "/v1/completions", {"prompt": PROMPT, field: value}, field, 400)
    refused(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], field: value}, field, 400)


@pytest.mark.parametrize("field,value", REFUSED_COMPLETIONS.items(), ids=list(REFUSED_COMPLETIONS))
def test_chat_only_fields_are_400_on_completions(server, field, value):
    refused(server, "/v1/completions", {"prompt": PROMPT, field: value}, field, 400)


@pytest.mark.parametrize("field,value", REFUSED_TGI.items(), ids=list(REFUSED_TGI))
def test_unimplemented_tgi_fields_are_422_naming_them(server, field, value):
    refused(server, "/generate", {"inputs": PROMPT, "parameters": {field: value}}, field, 422)


def test_unset_unimplemented_fields_ask_for_nothing(server):
    """Clients send unset fields as null/false/[]: accepted, same output."""
    base = gen(server)["generated_text"]
    assert gen(server, grammar=None, watermark=False, adapter_id=None)["generated_text"] == base
    assert text(cmpl(server, suffix=None, tools=[], parallel_tool_calls=False)) == text(cmpl(server))


FLOATS_TGI = ["temperature", "top_p", "typical_p", "repetition_penalty", "frequency_penalty"]
FLOATS_OPENAI = ["temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]


@pytest.mark.parametrize("raw", ["Infinity", "-Infinity", "NaN", "1e400"])
def test_non_finite_numbers_are_refused_naming_the_field(server, raw):
    for field in FLOATS_TGI:
        body = '{"inputs": "a", "parameters": {"%s": %s}}' % (field, raw)
        r = httpx.post(server.url + "/generate", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422 and field in r.json()["error"], (field, raw, r.text)
    for field in FLOATS_OPENAI:
        body = '{"prompt": "a", "max_tokens": 1, "%s": %s}' % (field, raw)
        r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, raw, r.text)
    body = '{"prompt": "a", "logit_bias": {"5": %s}}' % raw
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["param"]


@pytest.mark.parametrize("prompt,got", [({"a": 1}, "an object"), (3.5, "a number"), (True, "a boolean")])
def test_a_prompt_of_none_of_its_types_is_said_once_in_a_clients_words(server, prompt, got):
    """A prompt that is none of OpenAI's four forms gets one readable sentence naming them and what was sent, not one
    error per form with pydantic's validator names (``list[function-before[_integral_float_to_int(), int]]``)."""
    r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "prompt", r.text
    assert error["message"] == f"prompt: expected str, list[str], list[int] or list[list[int]]; got {got}", r.text


HUGE = 2**70  # more than any integer the engine's messages carry (64 bits)


def test_integers_too_large_for_the_engine_are_refused_naming_the_field(server):
    """``top_k`` and ``min_tokens`` beyond 2^63 - 1 got a 500 (the engine core's message could not carry them) and the
    connection was dropped; now 4xx naming the field, and the server answers next."""
    for path in ("/generate", "/generate_stream"):
        body = '{"inputs": "a", "parameters": {"top_k": %d}}' % HUGE
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422 and "top_k" in r.json()["error"], (path, r.text)
    for field in ("top_k", "min_tokens"):
        for path, base in (("/v1/completions", '"prompt": "a"'),
                           ("/v1/chat/completions", '"messages": [{"role": "user", "content": "a"}]')):
            body = '{%s, "%s": %d}' % (base, field, HUGE)
            r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, field, r.text)
    r = httpx.post(server.url + "/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 1, "top_k": 2**63 - 1}})
    assert r.status_code == 200, r.text


def test_post_root_answers_a_one_element_list(server):
    out = post(server, "/", {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}})
    assert isinstance(out, list) and len(out) == 1
    assert out[0]["generated_text"] == gen(server, max_new_tokens=4)["generated_text"]


def test_echo_logprobs_equal_the_models(server, tok, ref_model):
    """The prompt log-probabilities of ``echo`` + ``max_tokens: 0`` equal model(...)'s within 1e-4."""
    model, _ = ref_model
    prompt = "In the beginning God created the heaven and the earth."
    ids = tok.encode(prompt)
    lp = cmpl(server, prompt=ids, max_tokens=0, echo=True, logprobs=1)["choices"][0]["logprobs"]["token_logprobs"]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    want = ref.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()
    assert lp[0] is None and lp[1:] == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "assistant"}, {"role": "system", "content": None},
                                     {"role": "user", "content": None}],
                         ids=["missing", "missing-assistant", "null", "null-user"])
def test_a_chat_turn_without_content_is_400_naming_it(server, message):
    """A turn without its text is refused, not read as an empty turn; only an assistant turn may be null
    (:func:`test_a_null_assistant_turn_is_an_empty_one`)."""
    messages = [message, {"role": "user", "content": "x"}]
    for path in ("/v1/chat/completions", "/tokenize"):
        body = {"messages": messages, "max_tokens": 1} if path.startswith("/v1") else {"messages": messages}
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code in (400, 422), (path, r.text)
        assert "messages.0.content" in r.text, r.text
    r = httpx.post(server.url + "/v1/responses", json={"input": messages, "max_output_tokens": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content", r.text


def test_a_null_assistant_turn_is_an_empty_one(server):
    """``{"role": "assistant", "content": null}`` (nullable in OpenAI's schema; vLLM reads it as empty) was 400."""
    def history(content):
        return [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": content},
                {"role": "user", "content": "Who made light?"}]

    assert text(chat(server, messages=history(None))) == text(chat(server, messages=history("")))
    ids = [post(server, "/tokenize", {"messages": history(c)})["tokens"] for c in (None, "")]
    assert ids[0] == ids[1] and len(ids[0]) > 5
    r = httpx.post(server.url + "/v1/responses", json={"input": history(None), "max_output_tokens": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[1].content", r.text  # Responses: required


def _nulls(model, keep=()) -> dict:
    """``null`` for every optional field of a request ``model`` but ``keep``."""
    return {name: None for name, f in model.model_fields.items() if not f.is_required() and name not in keep}


def test_null_is_unset_for_every_optional_field(server):
    """As vLLM reads them (and text-generation's ``chat()`` sends them): ``null`` takes the field's default."""
    from server.api.responses import ResponsesRequest

    keep = ("max_tokens", "temperature")  # set by the baseline
    nulls = {**_nulls(ChatRequest, keep), "stream_options": {"include_usage": None, "continuous_usage_stats": None}}
    assert nulls["n"] is None and nulls["logprobs"] is None and nulls["stream"] is None
    assert text(chat(server, **nulls)) == text(chat(server))
    nulls = _nulls(CompletionRequest, keep)
    assert nulls["echo"] is None and nulls["best_of"] is None
    assert text(cmpl(server, **nulls)) == text(cmpl(server))
    out = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": None, "temperature": None, "seed": 1,
                                           "ignore_eos": True})
    assert out["usage"]["completion_tokens"] == 16  # OpenAI's default
    body = {"input": "Who made light?", "max_output_tokens": 6, "temperature": 0}
    want = post(server, "/v1/responses", body)["output"][0]["content"][0]["text"]
    out = post(server, "/v1/responses", {**body, **_nulls(ResponsesRequest, ("max_output_tokens", "temperature"))})
    assert out["output"][0]["content"][0]["text"] == want
    params = {name: None for name in TGIParameters.model_fields if name not in ("max_new_tokens", "details")}
    assert gen(server, **params)["generated_text"] == gen(server)["generated_text"]


def test_chat_answers_carry_a_system_fingerprint(server):
    """text-generation's ``chat()`` needs it (TGI sends it): the same string on every chunk and the answer."""
    from server import __version__

    want = f"kvserve-{__version__}-full"
    assert chat(server)["system_fingerprint"] == want
    chunks = sse(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                                 "stream": True, "stream_options": {"include_usage": True}})
    assert chunks and {c["system_fingerprint"] for c in chunks} == {want}


def _chat_stream_lines(server, model: str | None) -> list[str]:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True, "ignore_eos": True,
            **({"model": model} if model else {})}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_chat_stream_deltas_are_openais_and_tgis_for_tgis_client(server):
    """OpenAI's and vLLM's deltas (``role`` once: a client adding up deltas would read ``assistantassistant``), and
    TGI's for ``model: "tgi"``, what TGI's ``text-generation`` client sends: it needs ``role`` and ``tool_calls`` on
    every delta and reads every ``data:`` line as JSON (no ``[DONE]``)."""
    lines = _chat_stream_lines(server, None)
    assert lines[-1] == "[DONE]"
    deltas = [json.loads(x)["choices"][0]["delta"] for x in lines[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[-1] == {}
    assert all(set(d) == {"content"} for d in deltas[1:-1]) and len(deltas) == 5
    lines = _chat_stream_lines(server, "tgi")
    chunks = [json.loads(x) for x in lines]  # every line is JSON
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert all(set(d) == {"role", "content", "tool_calls"} and d["role"] == "assistant" and d["tool_calls"] is None
               and isinstance(d["content"], str) for d in deltas) and len(deltas) == 5
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_tiny_top_p_keeps_the_most_likely_token(server):
    """top_p 1e-46 (0.0 in float32) is greedy, not an empty answer, on the OpenAI and the TGI routes."""
    greedy = text(cmpl(server))
    assert greedy and text(cmpl(server, temperature=1.0, top_p=1e-46, seed=3)) == greedy
    assert gen(server, top_p=1e-46, seed=3)["generated_text"] == gen(server)["generated_text"]


def test_the_openapi_schema_is_json_schema():
    """Bounds are JSON Schema's (``minimum``, not pydantic's ``ge``); a body whose unknown keys are refused unless
    unset says so (no ``additionalProperties: true``); an optional field takes ``null``."""
    from server.api.request_model import UNSET_VALUE
    from server.app import create_app
    from server.config import Settings

    doc = create_app(Settings()).openapi()
    text_ = json.dumps(doc)
    for name in ("ge", "gt", "le", "lt"):
        assert f'"{name}":' not in text_, name
    schemas = doc["components"]["schemas"]
    assert {"type": "integer", "minimum": 0} in schemas["ChatRequest"]["properties"]["max_tokens"]["anyOf"]
    for name in ("ChatRequest", "CompletionRequest", "ChatMessage", "ResponsesRequest", "TGIParameters",
                 "TGIRequest", "TokenizeRequest"):
        assert schemas[name]["additionalProperties"] == UNSET_VALUE, name
    for field in ("n", "stream", "logprobs", "top_logprobs"):
        assert {"type": "null"} in schemas["ChatRequest"]["properties"][field]["anyOf"], field
