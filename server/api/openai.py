"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions`` (stream and not), ``/v1/models``.

``max_tokens`` (or its alias ``max_completion_tokens``) defaults to 16 for completions (OpenAI's
default) and, for chat, to 100 capped by the context (as ``/generate``). ``temperature`` defaults to 1.0
(sampling); 0 means greedy. A completion ``prompt`` may be a string, strings, token ids or token-id lists;
each prompt gets ``n`` choices (index ``prompt * n + j``, seed ``seed + j``). ``finish_reason`` is
``length``, ``stop`` (end-of-text token, a stop sequence, or the end of a ``response_format`` grammar) or, on chat,
``tool_calls`` (:mod:`server.api.tools`). Validation errors are 400 with OpenAI's
error object, its ``param`` naming the field. Chat messages become a prompt through the tokenizer's chat
template (encoded without adding special tokens again: the template writes its own BOS) or, when the model
has none, the plain template documented in the README (``System: …\nUser: …\nAssistant:``).
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from server import __version__
from server.api.common import TGI_CLIENT_MODEL, check_model, event_stream, finished, get_service
from server.api.fanout import collect_all, merged, submit_all
from server.api.openai_convert import (TokenText, chat_logprobs, chat_requests, completion_logprobs,
                                       completion_requests, finish, prompt_entries, token_entries)
from server.api.openai_schemas import (ChatChoice, ChatChunk, ChatChunkChoice, ChatDelta, ChatRequest,
                                       ChatResponse, ChatResponseMessage, CompletionChoice, CompletionRequest,
                                       CompletionResponse, ModelCard, ModelList, OpenAIError, PromptTokensDetails,
                                       TgiDeltaToolCall, Usage)
from server.api.threaded_body import ThreadedBodyRoute
from server.api.tools import ToolStream, finish_reason as tool_finish, parse as parse_tool_calls, response_calls
from server.api.types import sse_schema
from server.engine.sequence import FinishReason, TokenEvent
from server.service import SHUTDOWN_FINISH_REASON

router = APIRouter(prefix="/v1", tags=["OpenAI"], route_class=ThreadedBodyRoute)
ERRORS = {code: {"model": OpenAIError} for code in (400, 401, 404, 422, 429, 503)}
DONE = {"type": "string", "enum": ["[DONE]"]}


def _sse(*chunk_models) -> dict:
    return {**ERRORS, 200: {"content": {"text/event-stream": {"schema": sse_schema(*chunk_models, OpenAIError, DONE,
                                                                                   all_json=False)}}}}


def compressed_fraction(seqs) -> float | None:
    """``elastic``: the share of the sequences' cached tokens held as int8 codes when they finished (each weighted by
    its tokens), or ``None`` for other backends."""
    shares = [(s.kv_stats["compressed_fraction"], s.total_tokens) for s in seqs if "compressed_fraction" in s.kv_stats]
    if not shares:
        return None
    return sum(f * n for f, n in shares) / max(1, sum(n for _, n in shares))


def _usage(seqs, counted_prompts, echo_only: bool = False) -> Usage:
    """``usage`` of a request: the prompts counted once each (``counted_prompts``: one sequence per prompt), with
    their tokens served from the prefix cache (``prompt_tokens_details.cached_tokens``, as OpenAI and vLLM
    report it), and every choice's generated tokens."""
    prompt = sum(len(s.prompt_ids) for s in counted_prompts)
    completion = 0 if echo_only else sum(len(s.output_ids) for s in seqs)
    cached = PromptTokensDetails(cached_tokens=sum(s.cached_tokens for s in counted_prompts))
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=cached, kv_compressed_fraction=compressed_fraction(seqs))


def system_fingerprint(seqs) -> str:
    """``system_fingerprint`` of a chat answer: ``kvserve-<version>-<backend>`` (the backend its sequences ran on)."""
    return f"kvserve-{__version__}-{seqs[0].backend_name}"


def _wants_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _continuous_usage(body) -> bool:
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk carries the usage so far."""
    return bool(body.stream_options and body.stream_options.continuous_usage_stats)


def _error_event(ev: TokenEvent, service) -> dict:
    """A failed stream's error chunk; the engine core's end (it died or hung) as the non-streamed 503 says it."""
    died = service.core_end(ev) is not None
    return {"data": OpenAIError(error={"message": ev.error or "generation failed",
                                       "type": "service_unavailable_error" if died else "server_error",
                                       "code": "unhealthy" if died else None}).model_dump_json()}


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
    check_model(request, body.model)
    prompts, reqs, echo_only = completion_requests(body, service)
    per_prompt = len(reqs) // len(prompts)
    started = await submit_all(service, reqs, request.receive)
    seqs = [seq for seq, _ in started]
    firsts = seqs[::per_prompt]  # one sequence per prompt, for the prompt's tokens
    rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), request.app.state.kvserve.model_name
    text = TokenText(service.tokenizer)
    want_logprobs = body.logprobs is not None

    def echo_of(k: int) -> str:
        prompt = prompts[k // per_prompt]
        return (prompt if isinstance(prompt, str) else service.tokenizer.decode(
            seqs[k].prompt_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)) if body.echo else ""

    def echo_entries(k: int):
        return prompt_entries(seqs[k]) if body.echo else []

    if not body.stream:
        results = await collect_all(started)
        lasts = [finished(events, service) for events in results]
        choices = []
        for i in range(len(prompts)):
            ks = list(range(i * per_prompt, (i + 1) * per_prompt))
            if per_prompt > body.n:  # best_of: the n candidates with the highest log-probability
                ks = sorted(ks, key=lambda k: -sum(e[1] for e in token_entries(results[k])))[: body.n]
            for j, k in enumerate(ks):
                gen = [] if echo_only else results[k]
                logprobs = None
                if want_logprobs:
                    logprobs = completion_logprobs(echo_entries(k) + token_entries(gen), text)
                choices.append(CompletionChoice(index=i * body.n + j, logprobs=logprobs,
                                                text=echo_of(k) + ("" if echo_only else lasts[k].generated_text or ""),
                                                finish_reason=finish(lasts[k].finish_reason)))
        return CompletionResponse(id=rid, created=created, model=model, choices=choices,
                                  usage=_usage(seqs, firsts, echo_only))

    def chunk(k: int, piece: str, reason: str | None, entries, offset: int) -> dict:
        logprobs = completion_logprobs(entries, text, offset) if want_logprobs else None
        usage = _usage(seqs, firsts, echo_only) if _continuous_usage(body) else None
        return {"data": CompletionResponse(id=rid, created=created, model=model, usage=usage, choices=[CompletionChoice(
            index=k, text=piece, finish_reason=reason, logprobs=logprobs)]).model_dump_json(
                exclude=None if usage else {"usage"})}

    async def stream():
        offsets = [0] * len(seqs)
        pending = [[] for _ in seqs]  # token entries not sent yet (their text is held back)
        echoed = [not body.echo] * len(seqs)
        async for k, ev in merged(started):
            if service.is_shutdown_end(ev):
                yield chunk(k, "", SHUTDOWN_FINISH_REASON, [], offsets[k])
                continue
            if ev.finish_reason == FinishReason.CANCELLED:
                return
            if ev.finish_reason == FinishReason.ERROR:  # then [DONE], as vLLM ends a failed stream
                yield _error_event(ev, service)
                yield {"data": "[DONE]"}
                return
            if not echoed[k]:  # after the prefill, which computed the prompt's log-probabilities
                echoed[k] = True
                yield chunk(k, echo_of(k), None, echo_entries(k), 0)
                offsets[k] = sum(len(text(e[0])) for e in echo_entries(k))
            reason = finish(ev.finish_reason)
            if echo_only:
                if reason:
                    yield chunk(k, "", reason, [], offsets[k])
                continue
            pending[k] += token_entries([ev])
            if ev.text or reason:
                yield chunk(k, ev.text, reason, pending[k], offsets[k])
                offsets[k] += sum(len(text(e[0])) for e in pending[k])
                pending[k] = []
        if _wants_usage(body):
            yield {"data": CompletionResponse(id=rid, created=created, model=model, choices=[],
                                              usage=_usage(seqs, firsts, echo_only)).model_dump_json()}
        yield {"data": "[DONE]"}

    return event_stream(stream())


@router.post("/chat/completions", response_model=ChatResponse, responses=_sse(ChatChunk))
async def chat_completions(body: ChatRequest, request: Request):
    """Chat completion; ``stream: true`` answers ``chat.completion.chunk`` events ending with ``[DONE]``.

    The stream's deltas are OpenAI's and vLLM's: ``role`` on each choice's first delta only (a client that
    accumulates deltas, as the ``openai`` package's ``chat.completions.stream``, adds up every string it gets, and
    would read ``assistantassistant...``), ``content`` where there is text, ``{}`` with the finish reason. A request
    whose ``model`` is ``"tgi"`` (what TGI's own client, ``text-generation``, always sends) gets TGI's shape, which
    that client needs: every delta carries ``role``, ``content`` (a string) and ``tool_calls`` (null, or one call
    object per delta, not a list), and the stream
    ends with its last chunk, without ``[DONE]`` (text-generation 0.7 reads every ``data:`` line as JSON; TGI 2.0
    sent none).
    """
    service = get_service(request)
    check_model(request, body.model)
    reqs, tools = chat_requests(body, service)
    started = await submit_all(service, reqs, request.receive)
    seqs = [seq for seq, _ in started]
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), request.app.state.kvserve.model_name
    fingerprint = system_fingerprint(seqs)
    text = TokenText(service.tokenizer)
    if not body.stream:
        results = await collect_all(started)
        choices = []
        for k, events in enumerate(results):
            last = finished(events, service)
            logprobs = chat_logprobs(token_entries(events), text) if body.logprobs else None
            content, calls = parse_tool_calls(last.generated_text or "", tools)
            reason = tool_finish(finish(last.finish_reason), bool(calls))
            message = ChatResponseMessage(content=content)
            if calls:
                message = ChatResponseMessage(content=content, tool_calls=response_calls(calls))
            choices.append(ChatChoice(index=k, message=message, finish_reason=reason, logprobs=logprobs))
        return ChatResponse(id=rid, created=created, model=model, system_fingerprint=fingerprint,
                            usage=_usage(seqs, seqs[:1]), choices=choices)

    tgi_shape = body.model == TGI_CLIENT_MODEL

    def chunk(k: int, delta: ChatDelta, reason: str | None = None, entries=None) -> dict:
        if tgi_shape:  # one call per delta (the stream sends them one by one), as an object
            calls = TgiDeltaToolCall.of(delta.tool_calls[0]) if delta.tool_calls else None
            delta = ChatDelta(role="assistant", content=delta.content or "", tool_calls=calls)
        logprobs = chat_logprobs(entries, text) if body.logprobs and entries else None
        usage = _usage(seqs, seqs[:1]) if _continuous_usage(body) else None
        choice = ChatChunkChoice(index=k, delta=delta, finish_reason=reason, logprobs=logprobs)
        return {"data": ChatChunk(id=rid, created=created, model=model, system_fingerprint=fingerprint, usage=usage,
                                  choices=[choice]).model_dump_json(exclude=None if usage else {"usage"})}

    async def stream():
        pending = [[] for _ in seqs]
        streams = [ToolStream(tools) for _ in seqs]
        for k in range(len(seqs)):
            yield chunk(k, ChatDelta(role="assistant", content=""))
        async for k, ev in merged(started):
            if service.is_shutdown_end(ev):
                yield chunk(k, ChatDelta(), SHUTDOWN_FINISH_REASON)
                continue
            if ev.finish_reason == FinishReason.CANCELLED:
                return
            if ev.finish_reason == FinishReason.ERROR:  # then [DONE], as vLLM ends a failed stream (not TGI's shape)
                yield _error_event(ev, service)
                if not tgi_shape:
                    yield {"data": "[DONE]"}
                return
            pending[k] += token_entries([ev])
            pieces = [streams[k].feed(ev.text)]
            if ev.finish_reason is not None:
                pieces.append(streams[k].end())
            for content, calls in pieces:
                if content:
                    yield chunk(k, ChatDelta(content=content), entries=pending[k])
                    pending[k] = []
                for part in ([[c] for c in calls] if tgi_shape else [calls] if calls else []):
                    yield chunk(k, ChatDelta(tool_calls=part), entries=pending[k])
                    pending[k] = []
            if ev.finish_reason is not None:
                yield chunk(k, ChatDelta(), tool_finish(finish(ev.finish_reason), streams[k].called),
                            entries=pending[k])
        if _wants_usage(body):
            yield {"data": ChatChunk(id=rid, created=created, model=model, system_fingerprint=fingerprint, choices=[],
                                     usage=_usage(seqs, seqs[:1])).model_dump_json()}
        if not tgi_shape:
            yield {"data": "[DONE]"}

    return event_stream(stream())
