"""Structured outputs and tool calls: ``response_format`` (``json_object``, ``json_schema``) on both OpenAI routes,
TGI's ``grammar``, and ``tools`` with every ``tool_choice``, checked by value (the output parses and validates
against its schema: greedy and seeded sampling, streamed and not, ``n`` = 2), through preemption and the prefix
cache; bad schemas and bad tools are 400 naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pydantic
import pytest
import torch

from server.api.openai_schemas import ChatRequest
from server.api.tools import ToolStream, parse, plan
from server.engine.grammar import Grammars, schema_text, strict_schema
from server.engine.sampling import RowRequest, SamplingParams, allowed_tokens, sample_batch
from tests.engine_helpers import make_engine, make_seq, run_all, run_step
from tests.json_http import post, sse

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "Who was the first king of Israel? Answer as JSON."}]
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def MANY(n: int, prefix: str = "p") -> dict:  # noqa: N802 - reads as a constant in the tables
    """An object schema of ``n`` optional string properties."""
    return {"type": "object", "properties": {f"{prefix}{i}": {"type": "string"} for i in range(n)}}


def valid(text: str, schema: dict) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


# ---- the sampler and the engine (no server) ---------------------------------------------------------

def test_the_bitmask_unpacks_as_llguidance_lays_it_out():
    """Bit j of word i allows token 32 i + j, the sign bit included; bits past the vocabulary are dropped."""
    import llguidance.torch

    words = torch.tensor([[1 | (1 << 5), -2**31, 3]], dtype=torch.int32)  # tokens 0, 5, 63, 64, 65
    allowed = allowed_tokens(words, 66)
    assert allowed.shape == (1, 66) and allowed[0].nonzero().flatten().tolist() == [0, 5, 63, 64, 65]
    assert allowed_tokens(words, 65)[0].nonzero().flatten().tolist() == [0, 5, 63, 64]
    theirs = torch.zeros(1, 66)
    llguidance.torch.apply_token_bitmask_inplace(theirs, words)
    assert torch.equal(torch.isfinite(theirs), allowed)


def test_the_mask_binds_greedy_and_sampled_rows_alike():
    """The best token is masked out: greedy takes the best allowed one, a sampled row draws only allowed ones."""
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0], [5.0, 4.0, 3.0, 0.0]])
    allowed = torch.tensor([0b1100], dtype=torch.int32)  # tokens 2 and 3
    rows = [RowRequest(SamplingParams(), [1], [], allowed=allowed),
            RowRequest(SamplingParams(do_sample=True, seed=1), [1], [], torch.Generator().manual_seed(1), allowed)]
    for _ in range(20):
        greedy, sampled = sample_batch(logits, rows)
        assert greedy.token == 2 and sampled.token in (2, 3)


def test_the_mask_holds_after_a_repetition_penalty_that_is_zero_in_float32():
    """A penalty of 5.5e-269 (accepted: it is > 0) is 0 in float32; applied after the mask it made -inf * 0 = NaN
    of the disallowed tokens and a disallowed token was drawn (found by schemathesis: a 500 "the request's grammar
    cannot go on"). The mask now comes last."""
    logits = torch.tensor([[5.0, -4.0, 3.0, -1.0], [5.0, -4.0, 3.0, -1.0]])
    allowed = torch.tensor([0b1000], dtype=torch.int32)  # token 3 alone
    params = dict(repetition_penalty=5.5e-269)
    rows = [RowRequest(SamplingParams(**params), [0, 1, 3], [], allowed=allowed),
            RowRequest(SamplingParams(do_sample=True, seed=1, temperature=0.5, **params), [0, 1, 3], [],
                       torch.Generator().manual_seed(1), allowed)]
    for _ in range(10):
        assert [s.token for s in sample_batch(logits, rows)] == [3, 3]


@pytest.fixture(scope="module")
def engine(ref_model):
    model, tok = ref_model
    return make_engine(model, tok)


def _grammar_run(engine, tok, params_list, **kw):
    seqs = [make_seq(tok, f"And God said {i}", 60, params=p) for i, p in enumerate(params_list)]
    run_all(engine, seqs, **kw)
    return seqs


def test_the_engine_follows_a_schema_greedy_and_sampled(ref_model, engine):
    model, tok = ref_model
    grammar = dict(grammar_kind="json_schema", grammar=schema_text(PERSON))
    seqs = _grammar_run(engine, tok, [SamplingParams(**grammar), SamplingParams(do_sample=True, seed=7, **grammar),
                                      SamplingParams(do_sample=True, seed=8, **grammar)])
    for seq in seqs:
        valid(tok.decode(seq.output_ids), PERSON)
        assert seq.finish_reason.value == "eos_token" and seq.output_ids[-1] != 0  # ended at the grammar's end


def test_the_grammar_survives_preemption(ref_model):
    """Four grammar streams on a pool too small for them: preempted and recomputed (the matcher is kept, the
    recomputed tokens are not sampled again), each answer is the one it gets unpreempted."""
    model, tok = ref_model
    long_text = {"type": "object", "properties": {"text": {"type": "string", "minLength": 400}}, "required": ["text"]}
    grammar = dict(grammar_kind="json_schema", grammar=schema_text(long_text))
    params = [SamplingParams(do_sample=True, seed=s, **grammar) for s in range(4)]
    tight = make_engine(model, tok, budget=12 * 262144, max_batch_size=4, block_size=16)
    seqs = _grammar_run(tight, tok, params)
    assert sum(s.preemptions for s in seqs) > 0
    alone = _grammar_run(make_engine(model, tok), tok, params)
    for a, b in zip(seqs, alone):
        assert a.output_ids == b.output_ids and len(a.output_ids) == 60
        assert tok.decode(a.output_ids).startswith('{"text": "')


def test_a_grammar_that_does_not_compile_ends_its_request_only(ref_model, engine):
    model, tok = ref_model
    events = []
    bad = make_seq(tok, "x", 5, params=SamplingParams(grammar_kind="json_schema", grammar='{"type": 3}'), events=events)
    good = make_seq(tok, "y", 5)
    run_all(engine, [bad, good])
    assert events[-1].finish_reason.value == "error" and "grammar" in events[-1].error
    assert good.finish_reason.value == "length"


def test_a_slow_grammar_compiles_beside_the_steps(ref_model, engine):
    """A schema that takes long to compile does not hold the running streams: they step while it compiles."""
    model, tok = ref_model
    wide = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(600)}}
    slow = make_seq(tok, "x", 3, params=SamplingParams(grammar_kind="json_schema", grammar=schema_text(wide)))
    running = make_seq(tok, "y", 40)
    engine.submit(running)
    engine.submit(slow)
    steps = 0
    while engine.compiling:
        run_step(engine)
        steps += 1
    assert steps > 1 and len(running.output_ids) > 1
    run_all(engine, [])
    assert slow.finish_reason is not None and slow.grammar is not None


def test_grammars_share_one_compiler(ref_model):
    model, tok = ref_model
    grammars = Grammars(tok, model.config.vocab_size, {0})
    a, b = grammars.state("json_object", ""), grammars.state("json_object", "")
    assert a.matcher is not b.matcher and torch.equal(a.mask, b.mask)
    assert allowed_tokens(a.mask, model.config.vocab_size)[0].nonzero().flatten().tolist() == tok.encode("{")


# ---- the tool-call parser (no server) ---------------------------------------------------------------

def _plan(choice="auto", **kw):
    return plan(ChatRequest.model_validate({"messages": MESSAGES, "tools": [WEATHER, TIME], "tool_choice": choice,
                                            **kw}), constrained=False)


@pytest.mark.parametrize("text,content,calls", [
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>', None,
     [("get_weather", '{"city": "Rome"}')]),
    ('Let me see.\n<tool_call>\n[{"name": "get_time", "arguments": {"zone": "UTC"}}, '
     '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}]\n</tool_call>', "Let me see.",
     [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Oslo"}')]),
    ('{"name": "get_weather", "parameters": {"city": "Rome"}}', None, [("get_weather", '{"city": "Rome"}')]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}', None, [("get_weather", '{"city": "Rome"}')]),
    ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>', '<tool_call>{"name": "launch", "arguments": {}}'
     '</tool_call>', []),
    ("In the beginning {was} the word", "In the beginning {was} the word", []),
])
def test_auto_parses_hermes_and_bare_calls_of_known_tools(text, content, calls):
    assert parse(text, _plan()) == (content, calls)
    stream, got, deltas = ToolStream(_plan()), "", []
    for i in range(0, len(text), 3):  # three characters a piece
        piece, d = stream.feed(text[i:i + 3])
        got, deltas = got + piece, deltas + d
    piece, d = stream.end()
    got, deltas = got + piece, deltas + d
    assert [(d.function.name, d.function.arguments) for d in deltas] == calls and stream.called == bool(calls)
    if calls:
        assert got.strip() == (content or "")
    else:
        assert got == text


def test_parallel_tool_calls_false_keeps_one_call():
    text = '<tool_call>[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]</tool_call>'
    assert parse(text, _plan(parallel_tool_calls=False))[1] == [("get_time", '{"zone": "UTC"}')]


# ---- the routes -------------------------------------------------------------------------------------

def chat(server, **fields):
    return post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 60, **fields})


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}], ids=["greedy", "seeded"])
def test_chat_json_schema_validates_streamed_or_not_for_each_choice(server, sampling):
    body = {"response_format": SCHEMA_FORMAT, "n": 2, **sampling}
    out = chat(server, **body)
    texts = [c["message"]["content"] for c in out["choices"]]
    for choice, text in zip(out["choices"], texts):
        valid(text, PERSON)
        assert choice["finish_reason"] == "stop"
    chunks = sse(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 60, "stream": True, **body})
    streamed = ["".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"][0]["index"] == k)
                for k in range(2)]
    assert streamed == texts  # same seed, same answer; each choice its own matcher
    if "seed" in sampling:
        assert texts[0] != texts[1]


def test_completions_json_schema_and_json_object(server):
    out = post(server, "/v1/completions", {"prompt": "And God said", "max_tokens": 60, "temperature": 0,
                                           "response_format": SCHEMA_FORMAT})
    valid(out["choices"][0]["text"], PERSON)
    chunks = sse(server, "/v1/completions", {"prompt": "And God said", "max_tokens": 60, "temperature": 0.8,
                                             "seed": 3, "stream": True, "response_format": SCHEMA_FORMAT})
    valid("".join(c["choices"][0]["text"] for c in chunks if c["choices"]), PERSON)
    # json_object: `}` pushed up (the output alone does not start as JSON), the grammar makes it one JSON object
    bias = {"logit_bias": {"93": 8}, "max_tokens": 40, "temperature": 0, "prompt": "And God said"}
    assert not post(server, "/v1/completions", bias)["choices"][0]["text"].startswith("{")
    obj = post(server, "/v1/completions", {**bias, "response_format": {"type": "json_object"}})["choices"][0]
    assert json.loads(obj["text"]) == {} and obj["finish_reason"] == "stop"


def test_vllm_structured_outputs_and_guided_fields(server):
    """vLLM's extensions: ``structured_outputs`` (``json``, ``regex``, ``choice``, ``json_object``) and the older
    ``guided_json`` / ``guided_regex`` / ``guided_choice``, on both routes."""
    choices = ["Saul", "David (the king)", "none of them"]
    for fields in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        assert chat(server, temperature=0, **fields)["choices"][0]["message"]["content"] in choices
        out = post(server, "/v1/completions", {"prompt": "And God said", "temperature": 0.9, "seed": 2, **fields})
        assert out["choices"][0]["text"] in choices and out["choices"][0]["finish_reason"] == "stop"
    for fields in ({"guided_json": PERSON}, {"guided_json": json.dumps(PERSON)}, {"structured_outputs": {"json": PERSON}}):
        valid(chat(server, temperature=0, **fields)["choices"][0]["message"]["content"], PERSON)
    for fields in ({"guided_regex": "[0-9]{3}-[0-9]{4}"}, {"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}}):
        text = chat(server, temperature=0, **fields)["choices"][0]["message"]["content"]
        assert len(text) == 8 and text[3] == "-" and text.replace("-", "").isdigit()
    out = chat(server, temperature=0, structured_outputs={"json_object": True}, logit_bias={"93": 8})
    assert json.loads(out["choices"][0]["message"]["content"]) == {}


def test_text_format_and_unset_fields_change_nothing(server):
    base = chat(server, temperature=0, max_tokens=8)
    for extra in ({"response_format": {"type": "text"}}, {"tools": None, "tool_choice": None, "response_format": None}):
        assert chat(server, temperature=0, max_tokens=8, **extra)["choices"] == base["choices"]


def test_the_prefix_cache_serves_a_grammar_request_the_same_answer(server):
    long = [{"role": "system", "content": "Answer with a name and an age. " * 8}] + MESSAGES
    body = {"temperature": 0, "response_format": SCHEMA_FORMAT, "messages": long, "max_tokens": 60}
    first, second = (post(server, "/v1/chat/completions", body) for _ in range(2))
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert first["choices"] == second["choices"]


def test_tgi_grammar_json_and_regex(server):
    out = post(server, "/generate", {"inputs": "And God said", "parameters": {
        "max_new_tokens": 60, "grammar": {"type": "json", "value": PERSON}, "details": True}})
    valid(out["generated_text"], PERSON)
    out = post(server, "/generate", {"inputs": "And God said", "parameters": {
        "max_new_tokens": 20, "grammar": {"type": "regex", "value": "(yea|nay), [a-z]{1,8}\\."}}})
    assert out["generated_text"].split(", ")[0] in ("yea", "nay") and out["generated_text"].endswith(".")


def _calls(chunks: list, k: int = 0) -> list[dict]:
    """Tool-call deltas of choice ``k`` added up by ``index``, as OpenAI's clients do."""
    calls: dict[int, dict] = {}
    for c in chunks:
        for ch in c["choices"]:
            for d in (ch["delta"].get("tool_calls") or []) if ch["index"] == k else []:
                call = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
                call["id"] = d.get("id") or call["id"]
                call["name"] = d["function"].get("name") or call["name"]
                call["arguments"] += d["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def test_a_named_tool_choice_answers_one_call_of_it(server):
    body = {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "temperature": 0}
    out = chat(server, **body)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    valid(call["function"]["arguments"], WEATHER["function"]["parameters"])
    chunks = sse(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 60, "stream": True, **body})
    (streamed,) = _calls(chunks)
    assert streamed["name"] == "get_weather" and streamed["arguments"] == call["function"]["arguments"]
    # one entry per index in a delta, as vLLM and OpenAI send (an attack: the header and the first piece of the
    # arguments came as two entries of index 0), the first with the id, the name and arguments
    entries = [c["choices"][0]["delta"]["tool_calls"] for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    assert all(len(e) == 1 for e in entries), entries[:2]
    assert entries[0][0]["function"]["name"] == "get_weather" and entries[0][0]["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)


def test_a_tool_choice_string_naming_a_tool_is_that_named_function(server):
    """TGI takes ``tool_choice`` as a function's name (its client ``text-generation`` sends it so): the same
    answer as OpenAI's ``{"type": "function", ...}``; a string naming no tool is 400 naming ``tool_choice``."""
    body = {"messages": MESSAGES, "max_tokens": 60, "temperature": 0, "tools": [WEATHER, TIME]}
    want = post(server, "/v1/chat/completions", {**body, "tool_choice": {"type": "function",
                                                                          "function": {"name": "get_time"}}})
    out = post(server, "/v1/chat/completions", {**body, "tool_choice": "get_time"})
    (call,) = out["choices"][0]["message"]["tool_calls"]
    assert call["function"] == want["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["function"]["name"] == "get_time" and out["choices"][0]["finish_reason"] == "tool_calls"
    for choice in ("get_weathr", "named"):
        r = httpx.post(server.url + "/v1/chat/completions", json={**body, "tool_choice": choice}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
        assert choice in r.json()["error"]["message"], r.text


class _TgiFunction(pydantic.BaseModel):  # text-generation 0.7.0's types.py: what its chat(stream=True) parses
    name: str | None
    arguments: str


class _TgiDeltaToolCall(pydantic.BaseModel):
    index: int
    id: str
    type: str
    function: _TgiFunction


class _TgiDelta(pydantic.BaseModel):
    role: str
    content: str | None = None
    tool_calls: _TgiDeltaToolCall | None


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"],
                         ids=["named", "required"])
def test_a_tgi_shaped_stream_sends_one_call_object_per_delta(server, tool_choice):
    """``model: "tgi"`` streams TGI's shape: ``delta.tool_calls`` one call object (index, id, type, function with
    name and arguments), as TGI's client ``text-generation`` 0.7 declares it, not OpenAI's list (an attack: the
    client failed to parse the list); the pieces add up to the call the OpenAI shape streams."""
    body = {"messages": MESSAGES, "max_tokens": 60, "stream": True, "temperature": 0, "tools": [WEATHER, TIME],
            "tool_choice": tool_choice, "parallel_tool_calls": False}
    (want,) = _calls(sse(server, "/v1/chat/completions", body))
    deltas = [_TgiDelta.model_validate(c["choices"][0]["delta"])
              for c in sse(server, "/v1/chat/completions", {**body, "model": "tgi"})]
    calls = [d.tool_calls for d in deltas if d.tool_calls is not None]
    assert calls and calls[0].id.startswith("call_") and calls[0].function.name == want["name"]
    assert all(c.index == 0 and c.type == "function" and c.function.name is None for c in calls[1:])
    assert "".join(c.function.arguments for c in calls) == want["arguments"]


@pytest.mark.parametrize("sampling", [{"temperature": 0, "parallel_tool_calls": False},
                                      {"temperature": 1.0, "seed": 5}], ids=["greedy-one-call", "seeded"])
def test_required_answers_calls_that_follow_their_schemas(server, sampling):
    """``required``: calls of the tools, each valid; one with ``parallel_tool_calls: false`` (finished by the
    grammar), else those complete when ``max_tokens`` ends a list the reference model keeps adding to."""
    tools = {"get_weather": WEATHER, "get_time": TIME}
    body = {"tools": list(tools.values()), "tool_choice": "required", "n": 2, **sampling}
    out = chat(server, **body)
    chunks = sse(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 60, "stream": True, **body})
    for k, choice in enumerate(out["choices"]):
        assert choice["message"]["tool_calls"] and choice["message"]["content"] is None
        if "parallel_tool_calls" in sampling:
            assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1
        for call in choice["message"]["tool_calls"]:
            valid(call["function"]["arguments"], tools[call["function"]["name"]]["function"]["parameters"])
        assert [(c["name"], c["arguments"]) for c in _calls(chunks, k)] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]


def test_auto_renders_the_tools_and_a_tool_conversation(server):
    """``auto`` on a model that answers in prose: content, finish ``stop``/``length``; the tools and an earlier
    call and its result are in the prompt (more prompt tokens)."""
    plain = chat(server, temperature=0, max_tokens=4)
    auto = chat(server, temperature=0, max_tokens=4, tools=[WEATHER])
    assert auto["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 20
    assert auto["choices"][0]["finish_reason"] in ("stop", "length") and "tool_calls" not in auto["choices"][0]["message"]
    history = MESSAGES + [
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 25 C"}]
    out = post(server, "/v1/chat/completions", {"messages": history, "tools": [WEATHER], "max_tokens": 4,
                                                "temperature": 0})
    assert out["usage"]["prompt_tokens"] > auto["usage"]["prompt_tokens"] + 10


DEEP: dict = {"type": "string"}
for _ in range(40):  # 81 levels of objects and arrays, past MAX_SCHEMA_DEPTH
    DEEP = {"type": "object", "properties": {"a": DEEP}, "required": ["a"]}
def test_the_openai_sdk_parses_answers_and_tool_calls(server):
    """The ``openai`` package's own helpers: ``parse`` with a pydantic ``response_format``, ``parse`` of a tool call
    (``pydantic_function_tool``), a streamed named call added up by ``chat.completions.stream``, and the call and
    its result sent back in the history."""
    import openai
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=150)

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    ask = {"model": "dummy", "temperature": 0, "max_tokens": 150, "messages": [{"role": "user", "content": "A king"}]}
    answer = client.chat.completions.parse(response_format=Person, **ask).choices[0]
    assert isinstance(answer.message.parsed, Person) and answer.finish_reason == "stop"
    tools = [openai.pydantic_function_tool(Person, name="add_person")]
    called = client.chat.completions.parse(tools=tools, tool_choice="required", parallel_tool_calls=False, **ask)
    (call,) = called.choices[0].message.tool_calls
    assert call.function.name == "add_person" and isinstance(call.function.parsed_arguments, Person)
    named = {"type": "function", "function": {"name": "add_person"}}
    whole = client.chat.completions.parse(tools=tools, tool_choice=named, **ask).choices[0].message.tool_calls[0]
    with client.chat.completions.stream(tools=tools, tool_choice=named, **ask) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.tool_calls[0].function.parsed_arguments == \
        whole.function.parsed_arguments  # greedy: the same arguments, streamed in pieces
    history = ask["messages"] + [
        {"role": "assistant", "tool_calls": [{"id": call.id, "type": "function",
                                              "function": {"name": "add_person", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "added"}]
    assert client.chat.completions.create(**{**ask, "messages": history, "max_tokens": 4}, tools=tools).choices


BAD = [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nosuch"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"properties": 3}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": DEEP}}},
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nosuch"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": PERSON}, "guided_json"),
    ({"guided_choice": ["a"], "structured_outputs": {"regex": "b"}}, "structured_outputs.regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"json": {"type": "nosuch"}}}, "structured_outputs.json"),
    # found by an attack: each compiled alone but failed at the first token, a 500 (token N outside the grammar)
    ({"guided_json": {"$ref": "#"}}, "guided_json"),
    ({"guided_json": {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "many", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}}}},
     "response_format.json_schema.schema"),
    # found by an attack: these passed the check (its forced tokens stop before the object opens) and failed
    # mid-output, mid-stream too: "Current row has 2399 items; max is 2000"
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "nested", "schema": {
        "type": "object", "properties": {"x": {"type": "string", "maxLength": 12}, "y": MANY(600)},
        "required": ["x", "y"]}}}}, "response_format.json_schema.schema"),
    ({"guided_json": {"anyOf": [MANY(260), MANY(260, "q")]}}, "guided_json"),
    ({"guided_json": {"type": "array", "items": {"$ref": "#/$defs/o"}, "$defs": {"o": MANY(501)}}}, "guided_json"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": MANY(600)}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ({"guided_regex": "(a{1000}){1000}"}, "guided_regex"),
    ({"guided_regex": "ab\\"}, "guided_regex"),  # a lone trailing backslash was dropped, not refused
    ({"guided_json": "[" * 20000 + "]" * 20000}, "guided_json"),  # JSON text nested past Python's recursion: a 500
    ({"guided_regex": "ab", "min_tokens": 3}, "min_tokens"),  # the grammar would end it before min_tokens
    ({"guided_regex": "ab", "ignore_eos": True}, "ignore_eos"),
    ({"messages": MESSAGES + [{"role": "tool", "content": "r"}]}, "messages[1].tool_call_id"),
    ({"messages": MESSAGES + [{"role": "tool", "tool_call_id": "nosuch", "content": "r"}]},
     "messages[1].tool_call_id"),
    ({"messages": MESSAGES + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[p for _, p in BAD])
def test_bad_schemas_and_tools_are_400_naming_the_field(server, fields, param):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **fields},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_a_required_call_follows_a_tool_whose_parameters_hold_local_refs(server):
    """pydantic writes nested models as ``$defs`` and ``#/$defs/...``: inside ``required``'s list of calls they
    must still point at the tool's own parameters (they were refused: "Pointer '/$defs/Item' does not exist")."""
    order = {"type": "function", "function": {"name": "order", "parameters": {
        "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"],
        "$defs": {"Item": {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}}, "required": ["kind"]}}}}}
    out = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 120, "temperature": 0,
                                                "tools": [order], "tool_choice": "required",
                                                "parallel_tool_calls": False})
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "order"
    valid(call["function"]["arguments"], order["function"]["parameters"])


def test_bad_grammars_on_completions_and_tgi(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "response_format": {"type": "json_schema",
                   "json_schema": {"name": "p", "schema": {"type": "nosuch"}}}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema", r.text
    for grammar, field in [({"type": "json", "value": {"type": "nosuch"}}, "parameters.grammar.value"),
                           ({"type": "json", "value": "not json"}, "parameters.grammar.value"),
                           ({"type": "regex", "value": "(unclosed"}, "parameters.grammar.value"),
                           ({"type": "json", "value": {"$ref": "#"}}, "parameters.grammar.value"),
                           ({"type": "json", "value": "[" * 20000 + "]" * 20000}, "parameters.grammar.value"),
                           ({"type": "xml", "value": "x"}, "grammar")]:
        r = httpx.post(server.url + "/generate", json={"inputs": "a", "parameters": {"grammar": grammar}}, timeout=60)
        assert r.status_code == 422 and field in r.json()["error"], r.text


INFINITE = ("the schema requires a value of itself inside itself (a required property, `allOf`, `$ref` or `minItems` "
            "leads back to it): no finite JSON value matches it")


@pytest.mark.parametrize("fields,reason", [
    ({"guided_json": {"$ref": "#"}}, "the schema only refers to itself: no value matches it"),
    ({"guided_json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
     "the schema only refers to itself: no value matches it"),
    ({"guided_regex": "[^\\s\\S]"}, "no string matches the regular expression"),
    ({"guided_json": {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                      "required": ["next"]}}, "$ref": "#/$defs/n"}}, INFINITE),
    ({"guided_json": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}}, INFINITE),
    ({"guided_json": {"type": "object", "properties": {"\ud800": {"type": "string"}}}},
     "it holds text that is not valid Unicode: surrogates not allowed in `\\ud800`"),
    ({"guided_json": {"type": "integer", "minimum": 1e300}},
     "an integer's `minimum` or `maximum` is beyond the 64-bit integers the matcher bounds")],
    ids=["self", "cycle", "regex", "required-cycle", "nonempty-nesting", "lone-surrogate", "huge-integer-bound"])
def test_a_grammar_nothing_matches_is_refused_in_words(server, fields, reason):
    """llguidance says "NoExtensionBias" where no token can start a grammar, "Too many items" for a schema that
    requires itself (the nesting: it passed the check and ran to ``max_tokens`` as ``[[[[...``), "unexpected end of
    hex escape" for a lone surrogate, and "min=Some(9223372036854775807)" for a bound the client never sent: the 400
    says why."""
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, headers={"content-type": "application/json"},
                   content=json.dumps({"messages": MESSAGES, "max_tokens": 4, **fields}))  # \ud800 escaped
    (param,) = fields
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["message"] == f"`{param}` cannot be followed: {reason}", r.text


# ---- the real model ---------------------------------------------------------------------------------

@pytest.mark.real_model
def test_smollm2_answers_a_schema_and_a_required_tool_call():
    """SmolLM2-135M-Instruct (when fetched): its chat template does not render tools, so they reach the prompt as a
    hermes system turn; a ``required`` call and a ``json_schema`` answer both validate, greedy and sampled."""
    from server.api.openai_convert import chat_prompt
    from server.model_fetch import DEFAULT_DIR, is_current
    from server.model_loading import load_model

    if not is_current(DEFAULT_DIR):
        pytest.skip("the real model is not fetched (kvserve fetch-model)")
    model, tok = load_model(str(DEFAULT_DIR), torch.device("cpu"), torch.float32)
    engine = make_engine(model, tok)
    body = ChatRequest.model_validate({"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                                       "tools": [WEATHER, TIME], "tool_choice": "required"})
    tools = plan(body, constrained=False)
    prompt, _ = chat_prompt(tok, body, tools=[WEATHER, TIME])
    assert "<tools>" in prompt and "get_weather" in prompt
    person, _ = chat_prompt(tok, [m for m in ChatRequest.model_validate(
        {"messages": [{"role": "user", "content": "Describe a famous scientist as JSON with name and age."}]}).messages])
    runs = [(prompt, tools.grammar), (person, ("json_schema", schema_text(PERSON)))]
    seqs = []
    for text, (kind, grammar) in runs:
        for params in (SamplingParams(), SamplingParams(do_sample=True, temperature=0.7, seed=1)):
            seq = make_seq(tok, "", 80, params=SamplingParams(**{**params.__dict__, "grammar_kind": kind,
                                                                  "grammar": grammar}))
            seq.prompt_ids, seq.request_id = tok.encode(text, add_special_tokens=False), f"{len(seqs)}"
            seqs.append(seq)
    run_all(engine, seqs)
    for seq in seqs[:2]:
        content, calls = parse(tok.decode(seq.output_ids, skip_special_tokens=True), tools)
        assert calls, content
        for name, arguments in calls:
            valid(arguments, {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"])
    for seq in seqs[2:]:
        valid(tok.decode(seq.output_ids, skip_special_tokens=True), PERSON)


def test_a_schema_is_read_strictly_unless_it_allows_more():
    """Every object schema that does not say otherwise closes after its own properties (OpenAI's strict mode), in
    properties, items, anyOf and $defs; a schema that allows more keeps it; json_object stays any object."""
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "array", "items": {"properties": {}}},
                                               "d": {"anyOf": [{"type": "object"}, {"type": "null"}]},
                                               "e": {"type": "object", "additionalProperties": True}},
              "$defs": {"x": {"type": "object"}}}
    out = strict_schema(schema)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["a"]["additionalProperties"] is False and props["c"]["items"]["additionalProperties"] is False
    assert props["d"]["anyOf"][0]["additionalProperties"] is False and "additionalProperties" not in props["d"]["anyOf"][1]
    assert props["e"]["additionalProperties"] is True and out["$defs"]["x"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is left as it was


def test_the_optional_property_count_visits_each_shared_schema_once(monkeypatch):
    """A chain of ``anyOf`` pairs of one ``$ref`` has 2^n paths to its last schema: counted path by path (an attack
    on the count above: 18 links, 1.4 KB of schema, held the check 12 s, and each link doubled it) the check would
    never end; each schema is counted once, and a shared one's count is reused (here 2^n optional properties: refused
    for the bound, in a few dozen ``$ref`` lookups)."""
    from server.engine import grammar, schema_walk

    looked_up = []
    resolve = schema_walk.resolve
    monkeypatch.setattr(schema_walk, "resolve", lambda root, ref: looked_up.append(ref) or resolve(root, ref))
    links = 40
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(links)}
    defs[f"d{links}"] = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    grammar._check_optional(json.dumps({"$defs": defs, "$ref": "#/$defs/d0"}))  # nothing optional: accepted
    assert len(looked_up) <= 2 * links + 2, len(looked_up)  # + 1: the walk for a schema that requires itself
    defs[f"d{links}"]["required"] = []
    with pytest.raises(grammar.GrammarError, match=f"an object of {2 ** links} optional properties"):
        grammar._check_optional(json.dumps({"$defs": defs, "$ref": "#/$defs/d0"}))


def test_the_check_counts_optional_properties_where_an_object_opens(ref_model):
    """The matcher's row holds 4 n - 1 items for the n optional properties that may start at one position (the
    alternatives of an ``anyOf`` add up): up to 500 the schema is followed into its object; past it the check
    refuses it before the request is queued, nested, behind a ``$ref`` or an ``anyOf`` too (an attack: such a schema
    passed the check and failed mid-output)."""
    from server.engine.grammar import GrammarError, check

    model, tok = ref_model
    grammars = Grammars(tok, model.config.vocab_size, [tok.eos_token_id])

    def follows(schema: dict, text: str) -> bool:
        state = grammars.state("json_schema", schema_text(schema))
        return all(state.accept(t) and state.error is None for t in tok.encode(text, add_special_tokens=False))

    for schema, text in [(MANY(500), "{"), ({"anyOf": [MANY(250), MANY(250, "q")]}, "{"),
                         ({"type": "object", "properties": {"a": MANY(300), "b": MANY(300, "q")}}, '{"b": {')]:
        check("json_schema", schema_text(schema))
        assert follows(schema, text)
    for schema, text in [(MANY(501), "{"), ({"anyOf": [MANY(300), MANY(201, "q")]}, "{"),
                         ({"type": "object", "properties": {"y": MANY(600)}, "required": ["y"]}, '{"y": {'),
                         ({"$defs": {"o": MANY(501)}, "type": "array", "items": {"$ref": "#/$defs/o"}}, "[{")]:
        with pytest.raises(GrammarError, match="optional properties"):
            check("json_schema", schema_text(schema))
        assert not follows(schema, text)


# ---- TOOL_CALL_PARSER and CHAT_TEMPLATE (vLLM's --tool-call-parser, --chat-template) -------------------------------

@pytest.mark.parametrize("choice", ["auto", None])
def test_auto_is_refused_naming_the_setting_without_a_parser(choice):
    """With ``TOOL_CALL_PARSER=none`` nothing would parse an ``auto`` answer's calls: vLLM refuses ``auto`` without
    ``--tool-call-parser``, and so does kvserve (``auto`` is the default with ``tools``); every other choice runs."""
    from server.service import InvalidRequest

    body = {"messages": MESSAGES, "tools": [WEATHER, TIME], **({"tool_choice": choice} if choice else {})}
    with pytest.raises(InvalidRequest, match="TOOL_CALL_PARSER=none.*TOOL_CALL_PARSER=hermes") as refused:
        plan(ChatRequest.model_validate(body), constrained=False, parser="none")
    assert refused.value.param == "tool_choice"
    for other in ("none", "required", {"type": "function", "function": {"name": "get_time"}}):
        assert plan(ChatRequest.model_validate({**body, "tool_choice": other}), constrained=False,
                    parser="none").mode in ("none", "required", "named")


RAISING_TEMPLATE = ("{% for m in messages %}{% if m['content'] == 'RAISE' %}{{ raise_exception('roles must alternate') }}"
                    "{% elif m['content'] == 'IDX' %}{{ messages[99].content }}{% elif m['content'] == 'EMPTY' %}"
                    "{% else %}[{{ m['role'] }}] {{ m['content'] }}\n{% endif %}{% endfor %}"
                    "{% if messages[-1]['content'] != 'EMPTY' %}[assistant]{% endif %}")
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_a_chat_template_that_fails_or_renders_nothing_is_the_request_s_400():
    """A template's ``raise_exception`` (how templates refuse a conversation, e.g. roles that do not alternate), a
    fault in it, or an empty rendering was a 500 "internal error: TemplateError" on every chat route: now 400 (422 on
    the page's route) naming the field, with the template's message. Earlier assistant calls, which this template
    ignores, reach the prompt as ``<tool_call>`` text when the request has no ``tools``."""
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.config import Settings
    from tests.conftest import MODEL_DIR

    app = create_app(Settings(model_id=str(MODEL_DIR), kv_backends="full", engine_process=False, log_level="warning",
                              chat_template=RAISING_TEMPLATE), load_in_background=False)
    user = {"role": "user"}
    with TestClient(app) as client:
        for path, body, field in [
                ("/v1/chat/completions", {"messages": [{**user, "content": "RAISE"}], "max_tokens": 2}, "messages"),
                ("/v1/chat/completions", {"messages": [{**user, "content": "IDX"}], "max_tokens": 2, "stream": True},
                 "messages"),
                ("/v1/responses", {"input": "RAISE", "max_output_tokens": 2}, "input"),
                ("/tokenize", {"messages": [{**user, "content": "RAISE"}]}, "messages")]:
            r = client.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, r.text)
            assert r.json()["error"]["message"].startswith(f"the chat template cannot render `{field}`: "), r.text
        r = client.post("/v1/chat/completions", json={"messages": [{**user, "content": "RAISE"}], "max_tokens": 2})
        assert "roles must alternate" in r.json()["error"]["message"], r.text
        r = client.post("/ui/api/generate", json={"prompt": "RAISE", "chat": True, "kv_backend": "full"})
        assert r.status_code == 422 and r.json()["error_type"] == "validation" and "`prompt`" in r.json()["error"]
        r = client.post("/v1/chat/completions", json={"messages": [{**user, "content": "EMPTY"}], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            "the chat template rendered `messages` as an empty prompt"), r.text
        history = [{**user, "content": "a"}, {"role": "assistant", "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
        r = client.post("/tokenize", json={"messages": history, "return_token_strs": True})
        assert r.status_code == 200 and "get_weather" in "".join(r.json()["token_strs"]), r.text


def _app(template: str | None = None):
    from server.app import create_app
    from server.config import Settings
    from tests.conftest import MODEL_DIR

    return create_app(Settings(model_id=str(MODEL_DIR), kv_backends="full", engine_process=False, log_level="warning",
                               chat_template=template), load_in_background=False)


NO_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
             "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]")
TOOLS_UNGUARDED = "{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[-1]['content'] }}"
CALLS_UNGUARDED = "{{ messages[1].tool_calls[0].function.name }}|{{ messages[-1]['content'] }}"


def test_templates_that_take_no_system_turn_or_read_tools_unguarded_serve_tools():
    """The server's own renders must not fail a request a template serves: tools for a template that refuses system
    turns go in the first user turn (a Mistral-style template answered every request with tools 400 "roles must
    alternate"); the comparison renders without tools, or without earlier calls, that such templates fail on are
    read as "the template uses them" (a 400 "'NoneType' object is not iterable" before)."""
    from fastapi.testclient import TestClient

    user = {"role": "user", "content": "Paris?"}
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [CALL]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    for template, body in [(NO_SYSTEM, {"messages": [user], "tools": [WEATHER], "tool_choice": "none"}),
                           (TOOLS_UNGUARDED, {"messages": [user], "tools": [WEATHER], "tool_choice": "none"}),
                           (CALLS_UNGUARDED, {"messages": history})]:
        with TestClient(_app(template)) as client:
            r = client.post("/v1/chat/completions", json={**body, "max_tokens": 1})
        assert r.status_code == 200, (template, r.text)
    with TestClient(_app(NO_SYSTEM)) as client:
        with_tools = client.post("/v1/chat/completions", json={"messages": [user], "tools": [WEATHER],
                                                              "tool_choice": "none", "max_tokens": 1})
        without = client.post("/v1/chat/completions", json={"messages": [user], "max_tokens": 1})
    assert with_tools.json()["usage"]["prompt_tokens"] > without.json()["usage"]["prompt_tokens"] + 20


def test_text_and_arguments_are_checked_before_a_template_renders_them():
    """A lone surrogate in a message that a failing template quotes was a 500 (its message not UTF-8): the message
    is refused first, naming it; earlier call ``arguments`` nested past Python's reader (a RecursionError, 500 on
    ``/tokenize``) or holding NaN (not JSON, accepted) are refused as not JSON, on ``/tokenize`` as on chat."""
    import json as _json

    from fastapi.testclient import TestClient

    quoting = "{{ raise_exception('bad ' ~ messages[-1]['content']) }}"
    deep = {**CALL, "function": {**CALL["function"], "arguments": "[" * 3000}}
    nan = {**CALL, "function": {**CALL["function"], "arguments": '{"x": NaN}'}}
    with TestClient(_app(quoting)) as client:
        r = client.post("/v1/chat/completions", headers={"content-type": "application/json"}, content=_json.dumps(
            {"messages": [{"role": "user", "content": "\ud800 lone"}], "max_tokens": 1}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content", r.text
    with TestClient(_app()) as client:
        for call in (deep, nan):
            history = [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
            for path, extra in (("/tokenize", {}), ("/v1/chat/completions", {"max_tokens": 1})):
                r = client.post(path, json={"messages": history, **extra})
                field = "messages[1].tool_calls[0].function.arguments"
                assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, r.text)


@pytest.mark.parametrize("text", ["[" * 3000, "<tool_call>" + "[" * 3000, '{"name": "get_time", "arguments": ' * 1200])
def test_output_nested_past_python_s_reader_is_content_not_a_500(text):
    """A client can constrain an ``auto`` answer (``guided_regex``) to ``[[[[...``: Python's JSON reader raised
    RecursionError out of the parser (a 500, a stream cut without ``[DONE]``). Such output is content."""
    assert parse(text, _plan()) == (text, [])


def test_a_call_whose_arguments_hold_nan_is_no_call():
    """Python's JSON reads ``NaN``; OpenAI's ``arguments`` must be JSON text, so such an output is content."""
    text = '<tool_call>{"name": "get_time", "arguments": {"zone": NaN}}</tool_call>'
    assert parse(text, _plan()) == (text, [])


def test_a_chat_template_setting_replaces_the_tokenizer_s_and_the_parser_setting_holds():
    """``CHAT_TEMPLATE`` (template text here) renders every chat prompt in place of the tokenizer's; with
    ``TOOL_CALL_PARSER=none`` a chat with tools and no ``tool_choice`` gets 400 naming ``tool_choice``."""
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from server.app import create_app
    from server.config import Settings
    from tests.conftest import MODEL_DIR

    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    app = create_app(Settings(model_id=str(MODEL_DIR), kv_backends="full", engine_process=False, log_level="warning",
                              chat_template=template, tool_call_parser="none"), load_in_background=False)
    with TestClient(app) as client:
        got = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi there"}]})
        refused = client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 2})
    expected = AutoTokenizer.from_pretrained(str(MODEL_DIR))("[user] Hi there\n[assistant]",
                                                             add_special_tokens=False)["input_ids"]
    assert got.status_code == 200 and got.json()["tokens"] == expected, got.text
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice", refused.text
