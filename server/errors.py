"""Error responses: TGI's ``{"error", "error_type"}`` body with the right status, for every failure."""

from __future__ import annotations

import re
import sys

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.engine.core_client import CoreDied
from server.engine.engine import Overloaded
from server.engine.grammar import GRAMMAR_FAILED
from server.error_body import error_body, openai_path
from server.service import ClientGone, InvalidRequest


def is_openai(request: Request | None) -> bool:
    return request is not None and openai_path(request.url.path)


def error_response(status: int, message: str, error_type: str, request: Request | None = None,
                   param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """TGI's ``{"error", "error_type"}``, or on ``/v1`` routes OpenAI's ``{"error": {"message", "type",
    "param", "code"}}`` (``param``: the request field at fault, if one is), with ``headers`` (a 405's ``Allow``)."""
    return JSONResponse(status_code=status, content=error_body(is_openai(request), message, error_type, param),
                        headers=headers)


def validation_error(request: Request, message: str, param: str | None) -> JSONResponse:
    """Invalid input: 422 with TGI's body, or 400 with OpenAI's on ``/v1`` routes (as OpenAI and vLLM)."""
    return error_response(400 if is_openai(request) else 422, message, "validation", request, param)


def _is_branch(x) -> bool:
    """Whether a location part is a union branch's type name ("str", "list[int]"), not a field name."""
    return isinstance(x, str) and ("[" in x or x in ("str", "int", "float", "bool", "list", "dict", "none"))


def _first_field(exc: RequestValidationError) -> str | None:
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _is_branch(x)]
        if loc and err.get("type") != "json_invalid":
            return ".".join(loc)
    return None


def _type_name(branch: str) -> str:
    """A union branch as a client reads it: pydantic's validator wrappers dropped
    (``list[function-before[_integral_float_to_int(), int]]`` → ``list[int]``)."""
    return re.sub(r"function-(?:before|after|wrap|plain)\[[^,\]]*, ([^\]]+)\]", r"\1", branch)


def _describe(exc: RequestValidationError) -> str:
    """The errors in one line; a field that matches none of its union's types is said once, naming the types it
    takes and the JSON type it got, not once per type with pydantic's internal names."""
    parts, branches = [], {}
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            parts.append(f"invalid JSON at character {err['loc'][-1]}" + (f": {detail}" if detail else ""))
            continue
        loc = [x for x in err.get("loc", ()) if x != "body"]
        cut = next((i for i, x in enumerate(loc) if _is_branch(x)), None)
        if cut is not None and cut > 0:  # one branch of a union field
            field = ".".join(str(x) for x in loc[:cut])
            if field not in branches:
                parts.append(field)  # its place in the message, filled below
                branches[field] = ([], err.get("input"))
            name = _type_name(str(loc[cut]))
            if name not in branches[field][0]:
                branches[field][0].append(name)
            continue
        parts.append(f"{'.'.join(str(x) for x in loc) or 'body'}: {err.get('msg')}")
    for i, part in enumerate(parts):
        if part in branches:
            names, got = branches[part]
            kinds = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
            parts[i] = f"{part}: expected {kinds}; got {_json_type(got)}"
    return "; ".join(parts) or "invalid request"


def _json_type(value) -> str:
    """The JSON type of a value a client sent."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


class NotReady(Exception):
    """The model is still loading, or the server is shutting down (503)."""


class GenerationFailed(Exception):
    """A generation ended with an error (its forward failed, or the engine core died): 500 with its cause, in the
    route's error form (TGI's answers say it in their own body)."""


class ModelNotFound(Exception):
    """``model`` names no served model (404 ``model_not_found``, OpenAI's error object)."""


def _parse_failure(exc: StarletteHTTPException) -> str:
    """Why FastAPI could not parse a body, from the exception behind its 400: JSON nested past Python's recursion
    limit, an integer over Python's digit limit (``sys.get_int_max_str_digits``), or (anything else) not UTF-8
    JSON."""
    cause = exc.__cause__
    if isinstance(cause, RecursionError):
        return "JSON nested too deeply to parse"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return f"an integer has more than {sys.get_int_max_str_digits()} digits"
    return f"{exc.detail} (expected UTF-8 JSON)"


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception a route can raise to a JSON error (never a bare 500 page)."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return validation_error(request, _describe(exc), _first_field(exc))

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, exc: InvalidRequest):
        return validation_error(request, str(exc), getattr(exc, "param", None))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone):
        return error_response(499, str(exc), "cancelled", request)

    @app.exception_handler(Overloaded)
    async def _overloaded(request: Request, exc: Overloaded):
        response = error_response(429, f"Model is overloaded: {exc}", "overloaded", request)
        response.headers["Retry-After"] = "1"  # seconds (RFC 9110 section 10.2.3)
        return response

    @app.exception_handler(NotReady)
    async def _not_ready(request: Request, exc: NotReady):
        return error_response(503, str(exc) or "model is loading", "unhealthy", request)

    @app.exception_handler(CoreDied)
    async def _core_died(request: Request, exc: CoreDied):  # the engine core ended: the server is stopping
        return error_response(503, str(exc), "unhealthy", request)

    @app.exception_handler(GenerationFailed)
    async def _failed(request: Request, exc: GenerationFailed):
        if GRAMMAR_FAILED in str(exc):  # the request's grammar has no way on in this vocabulary: the client's input
            return validation_error(request, str(exc), None)
        return error_response(500, str(exc), "generation", request)

    @app.exception_handler(ModelNotFound)
    async def _model_not_found(request: Request, exc: ModelNotFound):
        return error_response(404, str(exc), "model_not_found", request, "model")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400:  # FastAPI could not decode the body (e.g. invalid UTF-8)
            return validation_error(request, f"invalid request body: {_parse_failure(exc)}", None)
        # the exception's headers kept: a 405 names the methods the path takes in Allow (RFC 9110 section 15.5.6),
        # HEAD beside GET (every GET route answers it, server.middleware)
        headers = dict(exc.headers or {})
        allow = [m.strip() for m in headers.get("Allow", "").split(",") if m.strip()]
        if "GET" in allow and "HEAD" not in allow:
            headers["Allow"] = ", ".join([*allow, "HEAD"])
        return error_response(exc.status_code, str(exc.detail), "http", request, headers=headers or None)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}", "internal", request)
