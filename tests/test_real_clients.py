"""Real client libraries, unchanged, against a real server on 127.0.0.1: langchain-openai (text, structured output
and tool calls), LiteLLM, text-generation (Client and AsyncClient) and huggingface_hub's InferenceClient. Results
checked by value.

text-generation 0.7.0 pins ``huggingface_hub<1``, which transformers 5 cannot use; it is installed
without its dependencies into ``.venv-clients/text-generation`` (once) and run in a subprocess with that
folder on ``PYTHONPATH``, where it works with the project's own huggingface_hub, pydantic and aiohttp.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL_DIR, REPO

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM would fetch a price list at import

MESSAGES = [{"role": "user", "content": "Who made light?"}]
TEXT_GENERATION = "text-generation==0.7.0"
TEXT_GENERATION_DIR = REPO / ".venv-clients" / "text-generation"


@pytest.fixture(scope="module")
def oai(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def reference_chat(oai, max_tokens: int) -> str:
    out = oai.chat.completions.create(model="kjv-llama-mha", messages=MESSAGES, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True})
    return out.choices[0].message.content


def reference_completion(oai, prompt: str, max_tokens: int) -> str:
    return oai.completions.create(model="kjv-llama-mha", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text


def test_langchain_chat_openai(server, oai):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="kjv-llama-mha", max_tokens=12,
                     temperature=0, max_retries=0, extra_body={"ignore_eos": True})
    out = llm.invoke(MESSAGES)
    assert out.content == reference_chat(oai, 12)  # max_tokens arrives (as max_completion_tokens) and is kept
    assert out.response_metadata["token_usage"]["completion_tokens"] == 12
    assert "".join(chunk.content for chunk in llm.stream(MESSAGES)) == out.content
    batch = llm.batch([MESSAGES, [{"role": "user", "content": "In the beginning"}]])
    assert batch[0].content == out.content and len(batch) == 2


def test_langchain_openai_completions(server, oai):
    from langchain_openai import OpenAI

    llm = OpenAI(base_url=server.url + "/v1", api_key="unused", model="kjv-llama-mha", max_tokens=8,
                 temperature=0, max_retries=0, extra_body={"ignore_eos": True})
    prompts = ["And God said", "In the beginning"]
    want = [reference_completion(oai, p, 8) for p in prompts]
    assert llm.invoke(prompts[0]) == want[0]
    assert "".join(llm.stream(prompts[0])) == want[0]
    assert llm.batch(prompts) == want  # one request with a list of two prompts


def test_litellm_openai_and_text_completion_providers(server, oai):
    import litellm

    base = dict(api_base=server.url + "/v1", api_key="unused", temperature=0, max_tokens=8, ignore_eos=True)
    want = reference_chat(oai, 8)
    out = litellm.completion(model="openai/kjv-llama-mha", messages=MESSAGES, **base)
    assert out.choices[0].message.content == want and out.usage.completion_tokens == 8
    stream = litellm.completion(model="openai/kjv-llama-mha", messages=MESSAGES, stream=True, **base)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want
    out = litellm.completion(model="openai/kjv-llama-mha", messages=MESSAGES, logprobs=True, top_logprobs=2, **base)
    content = out.choices[0].logprobs["content"] if isinstance(out.choices[0].logprobs, dict) else \
        out.choices[0].logprobs.content
    assert len(content) == 8

    want = reference_completion(oai, "And God said", 8)
    out = litellm.text_completion(model="text-completion-openai/kjv-llama-mha", prompt="And God said", **base)
    assert out.choices[0].text == want
    stream = litellm.text_completion(model="text-completion-openai/kjv-llama-mha", prompt="And God said",
                                     stream=True, **base)
    assert "".join(c.choices[0].text or "" for c in stream) == want


TGI_CLIENT_SCRIPT = r"""
import asyncio, json, sys
from text_generation import AsyncClient, Client
from text_generation.types import Message, Tool

url = sys.argv[1]
client, aclient = Client(url, timeout=120), AsyncClient(url, timeout=120)
out = {}
r = client.generate("And God said", max_new_tokens=8)
out["generate"] = [r.generated_text, r.details.generated_tokens, r.details.finish_reason]
out["stream"] = [s.token.text for s in client.generate_stream("And God said", max_new_tokens=8)]
s1 = client.generate("And God said", max_new_tokens=8, temperature=0.7, seed=1)
s2 = client.generate("And God said", max_new_tokens=8, temperature=0.7, seed=2)
out["sampled"] = [s1.generated_text, s1.details.seed, s2.generated_text, s2.details.seed]
t = client.generate("And God said", max_new_tokens=4, top_n_tokens=2, decoder_input_details=True)
out["top_tokens"] = [[tok.id for tok in top] for top in t.details.top_tokens]
out["prefill"] = [p.id for p in t.details.prefill]

async def run_async():
    r = await aclient.generate("And God said", max_new_tokens=8)
    pieces = [s.token.text async for s in aclient.generate_stream("And God said", max_new_tokens=8)]
    return [r.generated_text, pieces]

out["async"] = asyncio.run(run_async())

# chat() always sends model "tgi"; its ChatCompletionChunk wants role and tool_calls on every delta, and it reads
# every data line as JSON (it ends with the last chunk, as TGI 2.0's streams did, not at a `[DONE]`)
messages = [Message(role="user", content="Who made light?")]
c = client.chat(messages, max_tokens=8, temperature=0)
out["chat"] = [c.choices[0].message.content, c.choices[0].finish_reason, c.usage["completion_tokens"]]
chunks = list(client.chat(messages, max_tokens=8, temperature=0, stream=True))
out["chat_stream"] = ["".join(ch.choices[0].delta.content or "" for ch in chunks),
                      sorted({ch.choices[0].delta.role for ch in chunks}), chunks[-1].choices[0].finish_reason]

async def run_async_chat():
    pieces = [ch.choices[0].delta.content async for ch in
              await aclient.chat(messages, max_tokens=8, temperature=0, stream=True)]
    return ["".join(pieces)]

out["async_chat_stream"] = asyncio.run(run_async_chat())

# a tool call streamed: the client sends tool_choice as the function's name and parses each delta's tool_calls as
# one object (ChoiceDeltaToolCall)
weather = Tool(type="function", function={"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}})
tool_chunks = list(client.chat(messages, max_tokens=40, temperature=0, stream=True, tools=[weather],
                               tool_choice="get_weather"))
calls = [ch.choices[0].delta.tool_calls for ch in tool_chunks if ch.choices[0].delta.tool_calls]
out["tool_stream"] = [calls[0].function.name, "".join(c.function.arguments for c in calls),
                      tool_chunks[-1].choices[0].finish_reason]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def text_generation_path():
    if not (TEXT_GENERATION_DIR / "text_generation").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                        str(TEXT_GENERATION_DIR), TEXT_GENERATION], check=True, timeout=300)
    return TEXT_GENERATION_DIR


def test_text_generation_client_and_async_client(server, text_generation_path):
    import httpx

    run = subprocess.run([sys.executable, "-c", TGI_CLIENT_SCRIPT, server.url], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(text_generation_path)})
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    ref = httpx.post(server.url + "/generate", json={"inputs": "And God said", "parameters": {
        "max_new_tokens": 8, "details": True, "top_n_tokens": 2, "decoder_input_details": True}}, timeout=60).json()
    text = ref["generated_text"]
    assert out["generate"] == [text, 8, "length"]
    assert "".join(out["stream"]) == text and len(out["stream"]) == 8
    s1, seed1, s2, seed2 = out["sampled"]
    assert (seed1, seed2) == (1, 2) and s1 != s2  # temperature 0.7 samples (TGI's rule), seeded
    assert out["top_tokens"] == [[t["id"] for t in top] for top in ref["details"]["top_tokens"][:4]]
    assert out["prefill"] == [t["id"] for t in ref["details"]["prefill"]]
    assert out["async"] == [text, out["stream"]]
    want = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8, "temperature": 0},
                      timeout=60).json()
    reply = want["choices"][0]["message"]["content"]
    assert reply and out["chat"] == [reply, want["choices"][0]["finish_reason"], want["usage"]["completion_tokens"]]
    assert out["chat_stream"] == [reply, ["assistant"], want["choices"][0]["finish_reason"]]
    assert out["async_chat_stream"] == [reply]
    name, arguments, reason = out["tool_stream"]
    assert name == "get_weather" and isinstance(json.loads(arguments)["city"], str) and reason == "tool_calls"


def test_openai_stream_helper_accumulates_one_role(server, oai):
    """The ``openai`` package's ``chat.completions.stream`` adds up every string a delta carries: a ``role`` on every
    delta (TGI's shape, kept for ``model: "tgi"``) would make the final message's role ``assistantassistant...``."""
    with oai.chat.completions.stream(model="kjv-llama-mha", messages=MESSAGES, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True}) as stream:
        for _ in stream:
            pass
        snapshot = stream.current_completion_snapshot  # get_final_completion() refuses finish_reason "length"
    assert snapshot.choices[0].message.role == "assistant"
    assert snapshot.choices[0].message.content == reference_chat(oai, 6)


def test_inference_client_text_generation_and_chat(server, oai):
    from huggingface_hub import InferenceClient

    hf = InferenceClient(base_url=server.url, timeout=120)
    a = hf.text_generation("And God said", max_new_tokens=8, temperature=0.7, seed=1, details=True)
    b = hf.text_generation("And God said", max_new_tokens=8, temperature=0.7, seed=2, details=True)
    assert a.details.seed == 1 and b.details.seed == 2 and a.generated_text != b.generated_text
    again = hf.text_generation("And God said", max_new_tokens=8, temperature=0.7, seed=1)
    assert again == a.generated_text
    chat_client = InferenceClient(base_url=server.url + "/v1", timeout=120)
    out = chat_client.chat_completion(MESSAGES, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == reference_chat(oai, 8)
    pieces = chat_client.chat_completion(MESSAGES, max_tokens=8, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in pieces) == out.choices[0].message.content


def test_openai_async_client_many_prompts(server):
    from openai import AsyncOpenAI

    async def main():
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        out = await client.completions.create(model="kjv-llama-mha", prompt=["And God said", "In the beginning"], max_tokens=4,
                                              temperature=0, n=2, logprobs=1)
        return out

    out = asyncio.run(main())
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text and len(out.choices[2].logprobs.tokens) == 4


# GuideLLM 0.8.1's scheduler can drop the last request's record: its receive thread sets the shutdown event in the
# callback for the final update and only then queues that update, while the consumer loop stops at the first empty
# poll (``mp_poll_interval``, 0.1 s) after the event is set. On a loaded machine a thread switch in that window lost
# one of 4 (3 successful, 0 errored, 0 incomplete: the last never reported); a 0.5 s pause injected there loses it
# every time at 0.1 s and never at 2 s, where the poll that could see the event alone starts well after the last
# request ends. The run takes about 10 s longer.
GUIDELLM_POLL_S = 2.0


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_synchronous_run(server, route, tmp_path):
    """GuideLLM's CLI as its README runs it against vLLM (``--backend kind=openai_http,target=URL``: no model,
    no tokenizer), but for a short synchronous run: it takes the model from ``/v1/models`` (``MODEL_ID`` as
    given, the model folder's path) and loads the tokenizer from that path, offline; it streams with
    ``max_completion_tokens`` (chat) or ``max_tokens``, ``ignore_eos`` and ``continuous_usage_stats``; every
    request ends without error after exactly the requested 8 tokens."""
    served = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    out = tmp_path / "guidellm.json"
    run = subprocess.run([
        str(Path(sys.executable).with_name("guidellm")),
        "run", "--backend", f"kind=openai_http,target={server.url},request_format={route}",
        "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=4",
        "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
        "--output", f"kind=json,path={out}", "--disable-console"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "GUIDELLM__MP_POLL_INTERVAL": str(GUIDELLM_POLL_S)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    requests = json.loads(out.read_text())["benchmarks"][0]["requests"]
    assert len(requests["errored"]) == 0 and len(requests["incomplete"]) == 0, (requests["errored"],
                                                                                requests["incomplete"])
    assert len(requests["successful"]) == 4, run.stdout[-3000:] + run.stderr[-3000:]
    for r in requests["successful"]:
        body = json.loads(r["request_args"])["body"]
        assert body["model"] == served == str(MODEL_DIR)
        assert body["ignore_eos"] is True and body.get("max_completion_tokens", body.get("max_tokens")) == 8
        assert r["output_tokens"] == 8 and r["output"]


def test_langchain_structured_output_and_tool_calls(server):
    """langchain-openai's ``with_structured_output`` (a JSON schema, and a function call) and ``bind_tools`` with a
    forced tool: what agent code built on it sends, answered with valid objects (tests/test_structured_outputs.py)."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        """A person."""

        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=150)

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="kjv-llama-mha", max_tokens=150,
                     temperature=0, max_retries=0)
    for method in ("json_schema", "function_calling"):
        assert isinstance(llm.with_structured_output(Person, method=method).invoke(MESSAGES), Person)
    message = llm.bind_tools([Person], tool_choice="Person").invoke(MESSAGES)
    (call,) = message.tool_calls
    assert call["name"] == "Person" and Person(**call["args"])
    assert message.response_metadata["finish_reason"] == "tool_calls"
