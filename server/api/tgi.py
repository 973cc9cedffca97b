"""TGI-compatible routes: ``POST /generate``, ``POST /generate_stream`` (Server-Sent Events) and ``POST /``.

Sampling follows TGI's rule: it is on when ``do_sample`` is true or when ``temperature`` != 1,
``top_k`` > 0, ``top_p`` < 1 or ``typical_p`` < 1; ``temperature: 0`` is greedy (TGI refuses 0).
``POST /`` answers a one-element list when not streaming, as TGI does.
"""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from server.api.common import SHUTDOWN_MESSAGE, event_stream, get_service
from server.api.fanout import collect_all, submit_all
from server.api.structured import NO_GRAMMAR, tgi_grammar
from server.api.tgi_schemas import (ErrorBody, TGIBestOfSequence, TGIDetails, TGIParameters, TGIPrefillToken,
                                    TGIRequest, TGIResponse, TGIStreamDetails, TGIStreamEvent, TGIToken)
from server.api.threaded_body import ThreadedBodyRoute
from server.api.types import sse_schema
from server.api.validation import refuse_unimplemented
from server.engine.grammar import GRAMMAR_FAILED
from server.engine.sampling import SamplingParams
from server.engine.request_state import RequestState
from server.engine.sequence import FinishReason, TokenEvent
from server.errors import NotReady, error_response
from server.service import SHUTDOWN_FINISH_REASON, GenerationRequest, GenerationService, InvalidRequest

router = APIRouter(tags=["TGI"], route_class=ThreadedBodyRoute)

ERRORS = {code: {"model": ErrorBody} for code in (401, 422, 429, 499, 503)}
SSE = {"text/event-stream": {"schema": sse_schema(TGIStreamEvent, ErrorBody)}}


def samples(p: TGIParameters) -> bool:
    """TGI's rule: sample when asked, or when any warper is set away from its neutral value."""
    if p.temperature == 0:
        return False
    return (p.do_sample or (p.temperature is not None and p.temperature != 1.0) or bool(p.top_k)
            or (p.top_p is not None and p.top_p < 1.0) or (p.typical_p is not None and p.typical_p < 1.0))


def sampling_params(p: TGIParameters, seed: int | None, grammar: tuple[str, str] = NO_GRAMMAR) -> SamplingParams:
    do_sample = samples(p)
    return SamplingParams(
        do_sample=do_sample, temperature=p.temperature if do_sample and p.temperature else 1.0,
        top_k=p.top_k or 0, top_p=1.0 if p.top_p is None else p.top_p,
        typical_p=1.0 if p.typical_p is None else p.typical_p,
        repetition_penalty=1.0 if p.repetition_penalty is None else p.repetition_penalty,
        frequency_penalty=p.frequency_penalty or 0.0, frequency_over_all=True, top_n=p.top_n_tokens or 0,
        seed=seed if seed is not None else secrets.randbits(63), grammar_kind=grammar[0], grammar=grammar[1])


def to_generation_requests(body: TGIRequest, service: GenerationService) -> list[GenerationRequest]:
    """One engine request, or ``best_of`` of them.

    Raises:
        InvalidRequest: an unimplemented field, or ``best_of`` > 1 without sampling, with a seed, or streamed.
    """
    refuse_unimplemented(body)
    p = body.parameters
    best_of = p.best_of or 1
    if best_of > 1:
        if body.stream:
            raise InvalidRequest("`best_of` > 1 is not supported when streaming tokens", "best_of")
        if not samples(p):
            raise InvalidRequest("`best_of` > 1 needs sampling (do_sample, or temperature, top_k, top_p or "
                                 "typical_p set)", "best_of")
        if p.seed is not None:
            raise InvalidRequest("`seed` must not be set when `best_of` > 1", "seed")
    grammar = tgi_grammar(p.grammar)
    return [GenerationRequest(prompt=body.inputs, max_new_tokens=p.max_new_tokens,
                              params=sampling_params(p, p.seed, grammar),
                              stop=p.stop, backend=p.kv_backend or service.default_backend,
                              want_prompt_logprobs=p.decoder_input_details, truncate=p.truncate,
                              cache_salt=p.cache_salt)
            for _ in range(best_of)]


def _token(ev: TokenEvent) -> TGIToken:
    return TGIToken(id=ev.token_id, text=ev.text, logprob=ev.logprob, special=ev.special)


class _TopTokens:
    def __init__(self, tokenizer, special_ids: set[int]):
        self.tokenizer, self.special_ids = tokenizer, special_ids

    def __call__(self, ev: TokenEvent) -> list[TGIToken]:
        return [TGIToken(id=t, text=self.tokenizer.decode([t]), logprob=lp, special=t in self.special_ids)
                for t, lp in ev.top]


def _reported_seed(seq: RequestState) -> int | None:
    return seq.params.seed if seq.params.do_sample else None


def _failure(ev: TokenEvent, service) -> dict | None:
    if ev.finish_reason == FinishReason.ERROR:
        error = ev.error or "generation failed"  # a grammar with no way on is the request's: TGI's validation
        kind = ("unhealthy" if service.core_end(ev) is not None else  # the engine core died or hung: the server's
                "validation" if GRAMMAR_FAILED in error else "generation")
        return {"error": error, "error_type": kind}
    return None


async def _generate(body: TGIRequest, request: Request):
    """The non-streaming answer as a dict, or an error response."""
    service = get_service(request)
    started = await submit_all(service, to_generation_requests(body, service), request.receive)
    results = await collect_all(started)
    for events in results:
        if events and service.is_shutdown_end(events[-1]):
            raise NotReady(SHUTDOWN_MESSAGE)
        if events and (died := service.core_end(events[-1])) is not None:
            raise NotReady(died)
        if not events or events[-1].finish_reason == FinishReason.CANCELLED:
            return error_response(499, "client closed request", "cancelled")
        if (failure := _failure(events[-1], service)) is not None:
            # as TGI: 422 for the request's input, 424 Failed Dependency for a generation that failed
            return error_response(422 if failure["error_type"] == "validation" else 424, failure["error"],
                                  failure["error_type"])
    p = body.parameters
    top = _TopTokens(service.tokenizer, service.engine.special_ids)

    def logprob(events):
        return sum(ev.logprob for ev in events if ev.token_id >= 0)

    order = sorted(range(len(results)), key=lambda k: -logprob(results[k]))  # best_of: the most likely first
    prefix = body.inputs if p.return_full_text else ""

    def sequence(k: int) -> TGIBestOfSequence:
        seq, events = started[k][0], results[k]
        prefill = []
        if seq.prompt_logprobs is not None:
            prefill = [TGIPrefillToken(id=i, text=service.tokenizer.decode([i]), logprob=lp)
                       for i, lp in zip(seq.prompt_ids, seq.prompt_logprobs)]
        tokens = [ev for ev in events if ev.token_id >= 0]
        return TGIBestOfSequence(generated_text=prefix + (events[-1].generated_text or ""),
                                 finish_reason=events[-1].finish_reason.value, generated_tokens=len(seq.output_ids),
                                 seed=_reported_seed(seq), prefill=prefill, tokens=[_token(ev) for ev in tokens],
                                 top_tokens=[top(ev) for ev in tokens] if p.top_n_tokens else None,
                                 kv_compressed_fraction=seq.kv_stats.get("compressed_fraction"))

    best = sequence(order[0])
    out = {"generated_text": best.generated_text}
    if p.details:
        details = TGIDetails(**best.model_dump(exclude={"generated_text"}))
        if len(order) > 1:
            details.best_of_sequences = [sequence(k) for k in order[1:]]
        out["details"] = details.model_dump(exclude_none=False, exclude={
            k for k in ("top_tokens", "best_of_sequences") if getattr(details, k) is None})
    return out


@router.post("/generate", response_model=TGIResponse, responses={**ERRORS, 200: {"content": SSE}})
async def generate(body: TGIRequest, request: Request):
    """Generate text; with ``"stream": true`` the answer is the same event stream as ``/generate_stream``."""
    if body.stream:
        return await generate_stream(body, request)
    out = await _generate(body, request)
    return out if isinstance(out, JSONResponse) else JSONResponse(out)


@router.post("/", response_model=list[TGIResponse], responses={**ERRORS, 200: {"content": SSE}})
async def compat_generate(body: TGIRequest, request: Request):
    """TGI's compatibility route: ``[response]`` (a one-element list), or the event stream with
    ``"stream": true``."""
    if body.stream:
        return await generate_stream(body, request)
    out = await _generate(body, request)
    return out if isinstance(out, JSONResponse) else JSONResponse([out])


@router.post("/generate_stream", response_class=EventSourceResponse, responses={**ERRORS, 200: {"content": SSE}})
async def generate_stream(body: TGIRequest, request: Request):
    """Stream one SSE ``data:`` event per token; the last carries ``generated_text`` and ``details``."""
    service = get_service(request)
    body.stream = True
    (req,) = to_generation_requests(body, service)
    seq, events = await service.run(req, request.receive)
    prefix = body.inputs if body.parameters.return_full_text else ""
    top = _TopTokens(service.tokenizer, service.engine.special_ids) if body.parameters.top_n_tokens else None

    async def sse():
        async for ev in events:
            shutdown = service.is_shutdown_end(ev)
            if ev.finish_reason == FinishReason.CANCELLED and not shutdown:
                return
            if (failure := _failure(ev, service)) is not None:  # as TGI's router writes it (serde_json): compact, UTF-8
                yield {"data": ErrorBody(**failure).model_dump_json()}
                return
            out = TGIStreamEvent(index=ev.index, token=_token(ev), top_tokens=top(ev) if top else None)
            if ev.finish_reason is not None:
                out.generated_text = prefix + (ev.generated_text or "")
                out.details = TGIStreamDetails(finish_reason=SHUTDOWN_FINISH_REASON if shutdown else ev.finish_reason.value,
                                               generated_tokens=len(seq.output_ids), seed=_reported_seed(seq),
                                               input_length=len(seq.prompt_ids),
                                               kv_compressed_fraction=seq.kv_stats.get("compressed_fraction"))
            yield {"data": out.model_dump_json(exclude={"top_tokens"} if top is None else None)}

    return event_stream(sse())
