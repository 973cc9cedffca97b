"""Helpers shared by the route modules: the service, `model` checks, event streams."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from sse_starlette.sse import EventSourceResponse

from server.engine.sequence import FinishReason, TokenEvent
from server.errors import GenerationFailed, ModelNotFound, NotReady
from server.service import GenerationService, InvalidRequest

SHUTDOWN_MESSAGE = "the server shut down before the request finished (SHUTDOWN_GRACE_SECONDS)"
PLACEHOLDER_MODELS = ("tgi", "dummy")
"""``model`` values accepted besides the served names: huggingface_hub's InferenceClient, given an endpoint URL
rather than a model, sends a placeholder (``"dummy"`` in huggingface_hub 1.x, ``"tgi"`` before) since TGI ignores
``model``, and kvserve serves TGI's clients as well."""
TGI_CLIENT_MODEL = "tgi"
"""The ``model`` TGI's own Python client (``text-generation``) always sends: a chat stream asked for with it is sent in
TGI's chunk shape (:func:`server.api.openai.chat_completions`)."""


def event_stream(events: AsyncIterator[dict]) -> EventSourceResponse:
    """Server-Sent Events framed with ``\\n`` line ends (``data: ...\\n\\n``), as vLLM, SGLang and OpenAI send
    them: clients that split events on ``\\n\\n`` (inference-perf) see every event (sse-starlette's default is
    ``\\r\\n``). A comment line (``: ping``) every 15 s keeps idle connections open."""
    return EventSourceResponse(events, ping=15, sep="\n")


def check_model(request: Request, model: str | None) -> None:
    """Accept ``model`` when it is unset, a served name (``SERVED_MODEL_NAME``) or a placeholder of
    :data:`PLACEHOLDER_MODELS`.

    Raises:
        ModelNotFound: otherwise (404 ``model_not_found``, as vLLM and OpenAI answer).
    """
    names = request.app.state.kvserve.model_names
    if model and model not in names and model not in PLACEHOLDER_MODELS:
        raise ModelNotFound(f"The model {model!r} does not exist; served: {', '.join(names)}")


def get_service(request: Request) -> GenerationService:
    """The generation service, once the model is loaded.

    Raises:
        NotReady: while the model is loading (or failed to load).
    """
    state = request.app.state.kvserve
    if state.service is None:
        raise NotReady(state.load_error or state.loading)
    return state.service


def finished(events: list[TokenEvent], service: GenerationService) -> TokenEvent:
    """The last event of a non-streamed generation on the OpenAI routes; raise for one that did not finish.

    Raises:
        NotReady: the shutdown ended it, or the engine core died or hung under it (503: another replica can answer).
        InvalidRequest: the client closed the request.
        GenerationFailed: the generation failed while the core went on.
    """
    last = events[-1] if events else None
    if last is not None and service.is_shutdown_end(last):
        raise NotReady(SHUTDOWN_MESSAGE)
    if last is None or last.finish_reason == FinishReason.CANCELLED:
        raise InvalidRequest("client closed request")
    if (died := service.core_end(last)) is not None:
        raise NotReady(died)
    if last.finish_reason == FinishReason.ERROR:
        raise GenerationFailed(last.error or "generation failed")
    return last

