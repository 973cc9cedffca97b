"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions`` (stream and not), ``/v1/models``.

``max_tokens`` defaults as in vLLM: 16 for completions, the rest of the context for chat. ``temperature``
defaults to 1.0 (sampling); 0 means greedy. Only ``n=1`` is supported (other values get 422).
``finish_reason`` is ``length`` or ``stop`` (end-of-text token or a stop sequence).
Chat messages become a prompt through the tokenizer's chat template or, when the model has none, the
plain template documented in the README (``System: …\\nUser: …\\nAssistant:``).
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from sse_starlette.sse import EventSourceResponse

from server.api.common import get_service
from server.api.types import sse_schema
from server.api.openai_schemas import (ChatChoice, ChatChunk, ChatChunkChoice, ChatDelta, ChatRequest,
                                       ChatResponse, ChatResponseMessage, CompletionChoice, CompletionRequest,
                                       CompletionResponse, ModelCard, ModelList, OpenAIError, Usage)
from server.engine.sequence import FinishReason
from server.service import GenerationRequest, GenerationService, InvalidRequest

router = APIRouter(prefix="/v1", tags=["OpenAI"])
ERRORS = {code: {"model": OpenAIError} for code in (401, 422, 429, 503)}
DONE = {"type": "string", "enum": ["[DONE]"]}


def _sse(*chunk_models) -> dict:
    return {**ERRORS, 200: {"content": {"text/event-stream": {"schema": sse_schema(*chunk_models, OpenAIError, DONE, all_json=False)}}}}
COMPLETION_DEFAULT_MAX_TOKENS = 16
ROLE_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}


def finish(reason: FinishReason) -> str:
    return "length" if reason == FinishReason.LENGTH else "stop"


def chat_prompt(tokenizer, messages) -> str:
    """The prompt for a chat: the tokenizer's chat template, or the plain one."""
    turns = [{"role": m.role, "content": m.content} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return "".join(f"{ROLE_NAMES[t['role']]}: {t['content']}\n" for t in turns) + "Assistant:"


def to_generation_request(body, prompt: str, service: GenerationService, default_max: int | None):
    if body.n != 1:
        raise InvalidRequest(f"n={body.n} is not supported; only n=1")
    temperature = 1.0 if body.temperature is None else body.temperature
    params = service.sampling(temperature > 0, temperature, body.top_p, None, None, body.seed)
    return GenerationRequest(prompt=prompt, max_new_tokens=body.max_tokens or default_max, params=params,
                             stop=body.stop_list(),
                             backend=body.kv_backend or service.default_backend)


def _usage(seq) -> Usage:
    return Usage(prompt_tokens=len(seq.prompt_ids), completion_tokens=len(seq.output_ids),
                 total_tokens=len(seq.prompt_ids) + len(seq.output_ids))


async def _collect(events):
    last = None
    async for ev in events:
        last = ev
    return last


def _check(last):
    """Raise for a failed or cancelled generation (the handlers turn it into an error body)."""
    if last is None or last.finish_reason == FinishReason.CANCELLED:
        raise InvalidRequest("client closed request")
    if last.finish_reason == FinishReason.ERROR:
        raise RuntimeError(last.error or "generation failed")


def _wants_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


async def _stream(events, first: list[str], piece, usage):
    """OpenAI SSE: ``first`` events, then ``piece(text, finish_reason)`` for each token that releases
    text or finishes, then the usage chunk when asked, then ``[DONE]``. A failure sends an error object;
    a cancelled request (client gone) ends silently."""
    for data in first:
        yield {"data": data}
    async for ev in events:
        if ev.finish_reason == FinishReason.CANCELLED:
            return
        if ev.finish_reason == FinishReason.ERROR:
            yield {"data": OpenAIError(error={"message": ev.error or "generation failed",
                                              "type": "server_error"}).model_dump_json()}
            return
        reason = finish(ev.finish_reason) if ev.finish_reason else None
        if ev.text or reason:
            yield {"data": piece(ev.text, reason)}
    if usage is not None:
        yield {"data": usage()}
    yield {"data": "[DONE]"}


@router.get("/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    """The served model."""
    get_service(request)  # 503 while loading
    state = request.app.state.kvserve
    return ModelList(data=[ModelCard(id=state.model_name, created=int(state.started))])


@router.post("/completions", response_model=CompletionResponse, responses=_sse(CompletionResponse))
async def completions(body: CompletionRequest, request: Request):
    """Text completion; ``stream: true`` answers SSE chunks ending with ``data: [DONE]``."""
    service = get_service(request)
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise InvalidRequest("prompt must be a string or a list of exactly one string")
        prompt = prompt[0]
    greq = to_generation_request(body, prompt, service, COMPLETION_DEFAULT_MAX_TOKENS)
    seq, events = await service.run(greq, request.receive)
    rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), request.app.state.kvserve.model_name
    echo = prompt if body.echo else ""
    if not body.stream:
        last = await _collect(events)
        _check(last)
        return CompletionResponse(id=rid, created=created, model=model, usage=_usage(seq), choices=[
            CompletionChoice(text=echo + (last.generated_text or ""), finish_reason=finish(last.finish_reason))])

    def piece(text: str, reason: str | None) -> str:
        return CompletionResponse(id=rid, created=created, model=model, choices=[
            CompletionChoice(text=text, finish_reason=reason)]).model_dump_json(exclude={"usage"})

    def usage() -> str:
        return CompletionResponse(id=rid, created=created, model=model, choices=[], usage=_usage(seq)).model_dump_json()

    first = [piece(echo, None)] if echo else []
    return EventSourceResponse(_stream(events, first, piece, usage if _wants_usage(body) else None), ping=15)


@router.post("/chat/completions", response_model=ChatResponse, responses=_sse(ChatChunk))
async def chat_completions(body: ChatRequest, request: Request):
    """Chat completion; ``stream: true`` answers ``chat.completion.chunk`` events ending with ``[DONE]``."""
    service = get_service(request)
    greq = to_generation_request(body, chat_prompt(service.tokenizer, body.messages), service, None)
    seq, events = await service.run(greq, request.receive)
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), request.app.state.kvserve.model_name
    if not body.stream:
        last = await _collect(events)
        _check(last)
        return ChatResponse(id=rid, created=created, model=model, usage=_usage(seq), choices=[
            ChatChoice(message=ChatResponseMessage(content=last.generated_text or ""),
                       finish_reason=finish(last.finish_reason))])

    def piece(text: str, reason: str | None, role: str | None = None) -> str:
        return ChatChunk(id=rid, created=created, model=model, choices=[ChatChunkChoice(
            delta=ChatDelta(role=role, content=text if text or role else None), finish_reason=reason)]
        ).model_dump_json(exclude={"usage"})

    def usage() -> str:
        return ChatChunk(id=rid, created=created, model=model, choices=[], usage=_usage(seq)).model_dump_json()

    first = [piece("", None, role="assistant")]
    return EventSourceResponse(_stream(events, first, piece, usage if _wants_usage(body) else None), ping=15)
