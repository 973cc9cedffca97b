"""TGI-compatible routes: ``POST /generate`` and ``POST /generate_stream`` (Server-Sent Events)."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from server.api.common import get_service
from server.api.types import sse_schema
from server.api.tgi_schemas import (ErrorBody, TGIDetails, TGIPrefillToken, TGIRequest, TGIResponse,
                                    TGIStreamDetails, TGIStreamEvent, TGIToken)
from server.engine.sequence import FinishReason, Sequence, TokenEvent
from server.errors import error_response
from server.service import GenerationRequest, GenerationService

router = APIRouter(tags=["TGI"])

ERRORS = {code: {"model": ErrorBody} for code in (401, 422, 429, 499, 503)}
SSE = {"text/event-stream": {"schema": sse_schema(TGIStreamEvent, ErrorBody)}}


def to_generation_request(body: TGIRequest, service: GenerationService) -> GenerationRequest:
    p = body.parameters
    params = service.sampling(p.do_sample, p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.seed)
    return GenerationRequest(prompt=body.inputs, max_new_tokens=p.max_new_tokens, params=params, stop=p.stop,
                             backend=p.kv_backend or service.default_backend,
                             want_prompt_logprobs=p.decoder_input_details)


def _token(ev: TokenEvent) -> TGIToken:
    return TGIToken(id=ev.token_id, text=ev.text, logprob=ev.logprob, special=ev.special)


def _reported_seed(seq: Sequence) -> int | None:
    return seq.params.seed if seq.params.do_sample else None


def _failure(ev: TokenEvent) -> dict | None:
    if ev.finish_reason == FinishReason.ERROR:
        return {"error": ev.error or "generation failed", "error_type": "generation"}
    return None


@router.post("/", response_model=TGIResponse, responses={**ERRORS, 200: {"content": SSE}})
@router.post("/generate", response_model=TGIResponse, responses={**ERRORS, 200: {"content": SSE}})
async def generate(body: TGIRequest, request: Request):
    """Generate text; with ``"stream": true`` the answer is the same event stream as ``/generate_stream``.

    ``POST /`` is TGI's compatibility route (what huggingface_hub's ``InferenceClient`` calls)."""
    if body.stream:
        return await generate_stream(body, request)
    service = get_service(request)
    seq, events = await service.run(to_generation_request(body, service), request.receive)
    collected = [ev async for ev in events]
    if not collected or collected[-1].finish_reason == FinishReason.CANCELLED:
        return error_response(499, "client closed request", "cancelled")
    last = collected[-1]
    if (failure := _failure(last)) is not None:
        return error_response(500, failure["error"], failure["error_type"])
    text = (body.inputs if body.parameters.return_full_text else "") + (last.generated_text or "")
    details = None
    if body.parameters.details:
        prefill = []
        if seq.prompt_logprobs is not None:
            prefill = [TGIPrefillToken(id=i, text=service.tokenizer.decode([i]), logprob=lp)
                       for i, lp in zip(seq.prompt_ids, seq.prompt_logprobs)]
        details = TGIDetails(finish_reason=last.finish_reason.value, generated_tokens=len(seq.output_ids),
                             seed=_reported_seed(seq), prefill=prefill,
                             tokens=[_token(ev) for ev in collected if ev.token_id >= 0])
    out = TGIResponse(generated_text=text, details=details)
    return JSONResponse(out.model_dump(exclude={"details"} if details is None else None))


@router.post("/generate_stream", response_class=EventSourceResponse, responses={**ERRORS, 200: {"content": SSE}})
async def generate_stream(body: TGIRequest, request: Request):
    """Stream one SSE ``data:`` event per token; the last carries ``generated_text`` and ``details``."""
    service = get_service(request)
    seq, events = await service.run(to_generation_request(body, service), request.receive)
    prefix = body.inputs if body.parameters.return_full_text else ""

    async def sse():
        async for ev in events:
            if ev.finish_reason == FinishReason.CANCELLED:
                return
            if (failure := _failure(ev)) is not None:
                yield {"data": json.dumps(failure)}
                return
            out = TGIStreamEvent(index=ev.index, token=_token(ev))
            if ev.finish_reason is not None:
                out.generated_text = prefix + (ev.generated_text or "")
                out.details = TGIStreamDetails(finish_reason=ev.finish_reason.value,
                                               generated_tokens=len(seq.output_ids), seed=_reported_seed(seq),
                                               input_length=len(seq.prompt_ids))
            yield {"data": out.model_dump_json()}

    return EventSourceResponse(sse(), ping=15)
