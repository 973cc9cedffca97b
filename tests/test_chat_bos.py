"""Special tokens: a chat template that writes BOS itself gets one BOS, not two; completions keep the tokenizer's."""

from __future__ import annotations

import asyncio

import pytest
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer

from server.api.openai_convert import chat_requests, completion_requests
from server.api.openai_schemas import ChatRequest, CompletionRequest
from server.service import GenerationService, Limits
from tests.conftest import MODEL_DIR
from tests.test_service_disconnect import FakeEngine

BOS = "<|endoftext|>"
LLAMA_STYLE = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture()
def bos_tokenizer():
    """The shipped tokenizer made to add BOS as Llama's does (a post-processor), with a Llama-style chat
    template that writes BOS itself."""
    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    bos_id = tok.convert_tokens_to_ids(BOS)
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                              special_tokens=[(BOS, bos_id)])
    tok.chat_template = LLAMA_STYLE
    assert tok.encode("And God said")[:1] == [bos_id]  # the tokenizer really adds BOS
    return tok, bos_id


def service_of(tok) -> GenerationService:
    return GenerationService(FakeEngine(), tok, Limits(1023, 1024, 4), "full")


def submitted_ids(service: GenerationService, reqs) -> list[int]:
    """The prompt ids the engine receives for the first request."""

    async def submit():
        await service.engine.submit(service.build_request(reqs[0]))

    asyncio.run(submit())
    return service.engine.submitted[0].prompt_ids


def leading_bos(ids: list[int], bos_id: int) -> int:
    return next((i for i, t in enumerate(ids) if t != bos_id), len(ids))


def test_chat_template_with_bos_gives_one_bos(bos_tokenizer):
    tok, bos_id = bos_tokenizer
    body = ChatRequest(model="m", messages=[{"role": "user", "content": "Who made the light?"}], max_tokens=4)
    service = service_of(tok)
    ids = submitted_ids(service, chat_requests(body, service)[0])
    assert leading_bos(ids, bos_id) == 1, ids
    rendered = tok.apply_chat_template([{"role": "user", "content": "Who made the light?"}], tokenize=False,
                                       add_generation_prompt=True)
    assert ids == tok.encode(rendered, add_special_tokens=False)


def test_completion_keeps_the_tokenizers_bos(bos_tokenizer):
    tok, bos_id = bos_tokenizer
    body = CompletionRequest(model="m", prompt="And God said", max_tokens=4)
    service = service_of(tok)
    _, reqs, _ = completion_requests(body, service)
    ids = submitted_ids(service, reqs)
    assert ids == tok.encode("And God said") and leading_bos(ids, bos_id) == 1


def test_plain_chat_template_is_encoded_as_a_completion(bos_tokenizer):
    """Without a chat template the plain one writes no special tokens, so the tokenizer's BOS is added."""
    tok, bos_id = bos_tokenizer
    tok.chat_template = None
    body = ChatRequest(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    service = service_of(tok)
    ids = submitted_ids(service, chat_requests(body, service)[0])
    assert ids == tok.encode("User: Hi\nAssistant:") and leading_bos(ids, bos_id) == 1
