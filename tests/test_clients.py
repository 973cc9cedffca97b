"""Real clients against the real server: the `openai` package and huggingface_hub's InferenceClient."""

from __future__ import annotations

import pytest
from huggingface_hub import InferenceClient
from openai import OpenAI

from tests.conftest import MODEL_DIR


@pytest.fixture(scope="module")
def oai(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf(server):
    return InferenceClient(base_url=server.url, timeout=60)


def test_openai_completions(oai):
    out = oai.completions.create(model="kjv-llama-mha", prompt="And God said", max_tokens=8, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason in ("length", "stop") and choice.text
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 8
    again = oai.completions.create(model="kjv-llama-mha", prompt="And God said", max_tokens=8, temperature=0)
    assert again.choices[0].text == choice.text


def test_openai_completions_stream_with_usage(oai):
    full = oai.completions.create(model="kjv-llama-mha", prompt="In the beginning", max_tokens=10, temperature=0).choices[0].text
    chunks = list(oai.completions.create(model="kjv-llama-mha", prompt="In the beginning", max_tokens=10, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10


def test_openai_chat_and_chat_stream(oai):
    messages = [{"role": "system", "content": "Speak as the KJV."}, {"role": "user", "content": "Who made light?"}]
    out = oai.chat.completions.create(model="kjv-llama-mha", messages=messages, max_tokens=12, temperature=0)
    assert out.choices[0].message.role == "assistant" and out.usage.completion_tokens <= 12
    stream = oai.chat.completions.create(model="kjv-llama-mha", messages=messages, max_tokens=12, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == out.choices[0].message.content


def test_openai_models_and_errors(oai):
    assert [m.id for m in oai.models.list().data] == [str(MODEL_DIR)]  # MODEL_ID as given, as vLLM
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model="kjv-llama-mha", prompt="x", suffix="y")
    assert err.value.status_code == 400 and err.value.body["param"] == "suffix"


def test_hf_text_generation(hf):
    text = hf.text_generation("And God said", max_new_tokens=8)
    assert isinstance(text, str) and text
    out = hf.text_generation("And God said", max_new_tokens=8, details=True)
    assert out.generated_text == text and out.details.generated_tokens == 8
    assert out.details.finish_reason == "length" and len(out.details.tokens) == 8


def test_hf_text_generation_stream(hf):
    text = hf.text_generation("The LORD is my shepherd", max_new_tokens=10)
    tokens = list(hf.text_generation("The LORD is my shepherd", max_new_tokens=10, stream=True))
    assert "".join(tokens) == text
    events = list(hf.text_generation("The LORD is my shepherd", max_new_tokens=10, stream=True, details=True))
    assert events[-1].generated_text == text and events[-1].details.finish_reason == "length"
