"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``, with vLLM's shapes.

``/tokenize`` takes a completion prompt (``prompt``, ``add_special_tokens`` default true) or chat ``messages``
(``add_generation_prompt`` default true; ``add_special_tokens`` default: what the chat route does, false with a
chat template) and answers ``{"count", "max_model_len", "tokens", "token_strs"}``: the ids the generation routes
would feed the model for the same input. ``/detokenize`` answers ``{"prompt"}`` for ``tokens``.
``/tokenizer_info`` answers the tokenizer's configuration as ``tokenizer_config.json`` holds it (plus
``tokenizer_class``, ``chat_template`` and ``model_max_length`` as served): what lm-eval's ``local-completions``
reads to tokenize client-side without a ``tokenizer`` argument. Errors are OpenAI's error object (400), as
vLLM's; the tokenizer runs in the tokenizer threads, off the event loop.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from server.api.common import check_model, get_service
from server.api.openai_convert import chat_prompt, check_parts
from server.api.tools import check_turns
from server.api.openai_schemas import ChatMessage, OpenAIError
from server.api.request_model import RequestModel
from server.api.threaded_body import ThreadedBodyRoute
from server.api.types import Int
from server.api.validation import refuse_unimplemented
from server.service import InvalidRequest

router = APIRouter(tags=["tokenizer"], route_class=ThreadedBodyRoute)
ERRORS = {code: {"model": OpenAIError} for code in (400, 401, 404, 503)}


class TokenizeRequest(RequestModel):
    """vLLM's ``TokenizeCompletionRequest`` (``prompt``) or ``TokenizeChatRequest`` (``messages``): exactly one."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(None, description="Default: true for `prompt`; for `messages` what the "
                                            "chat route does (false when the model has a chat template).")
    add_generation_prompt: bool = Field(True, description="`messages`: end with the assistant's turn opening.")
    return_token_strs: bool = Field(False, description="Also answer each token's string (`token_strs`).")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    tokens: list[Int]


class DetokenizeResponse(BaseModel):
    prompt: str


def _tokenize(service, body: TokenizeRequest) -> TokenizeResponse:
    """Blocking: runs in the tokenizer threads."""
    tok, limit = service.tokenizer, service.limits.max_total_tokens
    if body.messages is not None:
        check_parts(body.messages)
        check_turns(body.messages)
        text, special = chat_prompt(tok, body.messages, body.add_generation_prompt)
        field = "messages"
    else:
        text, special, field = body.prompt, True, "prompt"
    service.check_length(text, field, limit)
    ids = tok.encode(text, add_special_tokens=special if body.add_special_tokens is None else body.add_special_tokens)
    return TokenizeResponse(count=len(ids), max_model_len=limit, tokens=ids,
                            token_strs=tok.convert_ids_to_tokens(ids) if body.return_token_strs else None)


@router.post("/tokenize", response_model=TokenizeResponse, response_model_exclude_none=True, responses=ERRORS)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """Token ids of a prompt or a chat, as the generation routes tokenize it (vLLM's ``/tokenize``)."""
    service = get_service(request)
    check_model(request, body.model)
    refuse_unimplemented(body)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("give exactly one of `prompt` and `messages`", "prompt")
    if body.messages is not None and not body.messages:
        raise InvalidRequest("`messages` must not be empty", "messages")
    return await service.off_loop(_tokenize, service, body)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """The text of token ids (vLLM's ``/detokenize``)."""
    service = get_service(request)
    check_model(request, body.model)
    refuse_unimplemented(body)
    vocab = len(service.tokenizer)
    if any(not 0 <= t < vocab for t in body.tokens):
        raise InvalidRequest(f"`tokens` must be token ids in [0, {vocab})", "tokens")
    text = await service.off_loop(service.tokenizer.decode, body.tokens)
    return DetokenizeResponse(prompt=text)


def tokenizer_info(tokenizer, max_model_len: int) -> dict:
    """The tokenizer's configuration as ``tokenizer_config.json`` holds it (its JSON-encodable init arguments),
    with ``tokenizer_class``, ``chat_template`` and ``model_max_length`` (the served context) set."""
    import json

    info = {}
    for key, value in tokenizer.init_kwargs.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            value = str(value) if key.endswith("_token") else None
        if value is not None:
            info[key] = value
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if getattr(tokenizer, name, None) is not None:
            info[name] = str(getattr(tokenizer, name))
    info.update(tokenizer_class=type(tokenizer).__name__, chat_template=getattr(tokenizer, "chat_template", None),
                model_max_length=max_model_len)
    return info


@router.get("/tokenizer_info", responses=ERRORS)
async def get_tokenizer_info(request: Request) -> dict:
    """The tokenizer's configuration (vLLM's ``/tokenizer_info``: ``tokenizer_class`` and ``tokenizer_config.json``'s
    fields)."""
    service = get_service(request)
    return tokenizer_info(service.tokenizer, service.limits.max_total_tokens)
