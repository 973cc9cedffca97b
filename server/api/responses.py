"""OpenAI's Responses API, text in and text out: ``POST /v1/responses`` (stream and not).

``input`` is a string (one user message) or a list of message items (``role`` user, system, developer or
assistant; ``content`` a string or ``input_text``/``output_text`` parts); ``instructions`` becomes a system message
first. The conversation is then served as ``/v1/chat/completions`` serves it (same chat template, same tokens,
greedy with ``temperature: 0``), with ``max_output_tokens``, ``temperature`` and ``top_p``. Nothing is stored:
``previous_response_id``, tools, reasoning, structured output and other item types are refused with 400 naming
the field (unless unset: ``null``, ``false``, ``[]``, ``{}``); ``store``, ``metadata`` and ``user`` are
informational (``metadata`` is echoed back).

A stream is OpenAI's event sequence (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, one ``response.output_text.delta`` per piece of
text, then the ``.done`` events), ending with ``response.completed`` carrying the whole response, whose
``status`` is ``incomplete`` (``incomplete_details.reason: max_output_tokens``) when the token limit ended it
(vLLM ends every stream with ``response.completed`` too, so that clients waiting for it, like the openai-agents
SDK, always get the final response).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_serializer

from server.api.common import check_model, event_stream, finished, get_service
from server.api.fanout import collect_all, merged, submit_all
from server.api.openai_convert import chat_requests
from server.api.openai_schemas import CACHE_SALT, ChatRequest, OpenAIError
from server.api.request_model import RequestModel
from server.api.threaded_body import ThreadedBodyRoute
from server.api.types import KV_COMPRESSED_FRACTION, Int, drop_unset_extensions, sse_schema
from server.api.validation import refuse_unimplemented
from server.engine.sequence import FinishReason
from server.service import MAX_CACHE_SALT_CHARS, InvalidRequest, utf8_error

router = APIRouter(prefix="/v1", tags=["OpenAI"], route_class=ThreadedBodyRoute)
ERRORS = {code: {"model": OpenAIError} for code in (400, 401, 404, 422, 429, 503)}
FIELDS = {"inputs": "input", "max_new_tokens": "max_output_tokens", "stop": "stop", "kv_backend": "kv_backend"}
ROLES = ("user", "system", "developer", "assistant")


class InputPart(RequestModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: str = Field(description="`input_text` (or `output_text` in an assistant message); others are refused.")
    text: str | None = None


class InputMessage(RequestModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: str = Field("message", description="Only `message` items are supported.")
    role: str | None = None
    content: str | list[InputPart] | None = None
    id: str | None = None
    status: str | None = None


class TextFormat(RequestModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["text"] = "text"


class TextConfig(RequestModel):
    model_config = ConfigDict(strict=True, extra="allow")

    format: TextFormat | None = None


class ResponsesRequest(RequestModel):
    """A key this server does not implement is refused (400, naming it) unless it is unset."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: Int | None = Field(None, ge=1, description="Default: 100, capped by the context.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="Default 1.0; 0 means greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = Field(None, description="Informational: nothing is stored.")
    metadata: dict[str, str] | None = Field(None, description="Echoed back.")
    user: str | None = None
    text: TextConfig | None = Field(None, description="Only the `text` format.")
    truncation: Literal["disabled"] | None = None
    tool_choice: Literal["none", "auto"] | None = Field(None, description="No tools are served: `none` or `auto`.")
    kv_backend: str | None = Field(None, min_length=1, description="KV backend for this request (one of KV_BACKENDS).")
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS, description=CACHE_SALT)


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int
    kv_compressed_fraction: float | None = Field(None, description=KV_COMPRESSED_FRACTION)

    @model_serializer(mode="wrap")
    def _drop_extensions(self, handler):
        return drop_unset_extensions(handler(self), ("kv_compressed_fraction",))


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class Response(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputMessage]
    parallel_tool_calls: bool = False
    previous_response_id: None = None
    reasoning: None = None
    store: bool = False
    temperature: float
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str = "none"
    tools: list = Field(default_factory=list)
    top_p: float
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class StreamEvent(BaseModel):
    """One event of a response stream (its other keys depend on ``type``)."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int


def _check_item_types(body: ResponsesRequest) -> None:
    """Refuse an ``input`` item that is not a message naming its type, before any of its fields: a
    ``function_call`` item's ``call_id`` is not what the server lacks.

    Raises:
        InvalidRequest: naming ``input[i].type``.
    """
    for i, item in enumerate(body.input if isinstance(body.input, list) else []):
        if item.type != "message":
            raise InvalidRequest(f"`input[{i}].type` {item.type!r} is not supported; only 'message'", f"input[{i}].type")


def _messages(body: ResponsesRequest) -> list[dict]:
    """``instructions`` and ``input`` as chat messages.

    Raises:
        InvalidRequest: an item that is not a message, a role or part type not served, text that is not valid
            Unicode (a lone surrogate), naming it.
    """
    if body.instructions is not None and (err := utf8_error(body.instructions, "instructions")) is not None:
        raise err
    out = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    if isinstance(body.input, str):
        if (err := utf8_error(body.input, "input")) is not None:
            raise err
        return out + [{"role": "user", "content": body.input}]
    if not body.input:
        raise InvalidRequest("`input` must not be empty", "input")
    for i, item in enumerate(body.input):
        refuse_unimplemented(item, f"input[{i}].")
        if item.role not in ROLES:
            raise InvalidRequest(f"`input[{i}].role` must be one of {', '.join(ROLES)}", f"input[{i}].role")
        if item.content is None:
            raise InvalidRequest(f"`input[{i}].content` is required", f"input[{i}].content")
        content = item.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type not in ("input_text", "output_text"):
                    raise InvalidRequest(f"`input[{i}].content[{j}].type` {part.type!r} is not supported; only "
                                         "'input_text' and 'output_text'", f"input[{i}].content[{j}].type")
                if part.text is None:
                    raise InvalidRequest(f"`input[{i}].content[{j}].text` is required in an {part.type!r} part",
                                         f"input[{i}].content[{j}].text")
            content = "".join(part.text or "" for part in content)
        if (err := utf8_error(content, f"input[{i}].content")) is not None:
            raise err
        out.append({"role": item.role, "content": content})
    return out


@router.post("/responses", response_model=Response, responses={
    **ERRORS, 200: {"content": {"text/event-stream": {"schema": sse_schema(StreamEvent, OpenAIError)}}}})
async def responses(body: ResponsesRequest, request: Request):
    """Text in, text out (OpenAI's Responses API); ``stream: true`` answers its event stream."""
    service = get_service(request)
    check_model(request, body.model)
    _check_item_types(body)
    refuse_unimplemented(body)
    chat = ChatRequest(messages=_messages(body), max_tokens=body.max_output_tokens, temperature=body.temperature,
                       top_p=body.top_p, user=body.user, kv_backend=body.kv_backend, cache_salt=body.cache_salt)
    reqs, _ = chat_requests(chat, service, messages_field="input")
    for req in reqs:
        req.fields = FIELDS
    started = await submit_all(service, reqs, request.receive)
    (seq, _), = started
    rid, msg_id, created = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}", int(time.time())
    state = request.app.state.kvserve

    def response(status: str, text: str | None, usage: bool = True, by_length: bool = True) -> Response:
        output = [] if text is None else [OutputMessage(id=msg_id, status=status, content=[OutputText(text=text)])]
        prompt, generated = len(seq.prompt_ids), len(seq.output_ids)
        return Response(
            id=rid, created_at=created, status=status, model=state.model_name, output=output,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" and by_length
            else None,
            instructions=body.instructions, max_output_tokens=body.max_output_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, user=body.user, metadata=body.metadata or {},
            usage=ResponseUsage(input_tokens=prompt, output_tokens=generated, total_tokens=prompt + generated,
                                input_tokens_details=InputTokensDetails(cached_tokens=seq.cached_tokens),
                                kv_compressed_fraction=seq.kv_stats.get("compressed_fraction"))
            if usage else None)

    def status_of(reason: FinishReason) -> str:
        return "incomplete" if reason == FinishReason.LENGTH else "completed"

    if not body.stream:
        (events,) = await collect_all(started)
        last = finished(events, service)
        return response(status_of(last.finish_reason), last.generated_text or "")

    async def stream():
        number = 0

        def event(kind: str, **fields: Any) -> dict:
            nonlocal number
            number += 1
            payload = {"type": kind, "sequence_number": number - 1, **fields}
            return {"event": kind, "data": StreamEvent(**payload).model_dump_json()}

        where = {"item_id": msg_id, "output_index": 0, "content_index": 0}
        yield event("response.created", response=response("in_progress", None, usage=False).model_dump())
        yield event("response.in_progress", response=response("in_progress", None, usage=False).model_dump())
        item = OutputMessage(id=msg_id, status="in_progress", content=[])
        yield event("response.output_item.added", output_index=0, item=item.model_dump())
        yield event("response.content_part.added", **where, part=OutputText(text="").model_dump())
        text = ""
        async for _, ev in merged(started):
            if ev.finish_reason == FinishReason.ERROR:
                yield event("error", code="unhealthy" if service.core_end(ev) is not None else "server_error",
                            message=ev.error or "generation failed", param=None)
                return
            if ev.finish_reason == FinishReason.CANCELLED and not service.is_shutdown_end(ev):
                return
            if ev.text:
                text += ev.text
                yield event("response.output_text.delta", **where, delta=ev.text, logprobs=[])
            if ev.finish_reason is not None:
                shutdown = service.is_shutdown_end(ev)  # the shutdown's grace period ended it: incomplete
                final = response("incomplete" if shutdown else status_of(ev.finish_reason), text, by_length=not shutdown)
                yield event("response.output_text.done", **where, text=text, logprobs=[])
                yield event("response.content_part.done", **where, part=OutputText(text=text).model_dump())
                yield event("response.output_item.done", output_index=0, item=final.output[0].model_dump())
                yield event("response.completed", response=final.model_dump())

    return event_stream(stream())
