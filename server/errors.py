"""Error responses: TGI's ``{"error", "error_type"}`` body with the right status, for every failure."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.engine.engine import Overloaded
from server.service import InvalidRequest


OPENAI_TYPES = {"validation": "invalid_request_error", "overloaded": "overloaded_error",
                "unhealthy": "service_unavailable_error", "authentication": "authentication_error",
                "http": "invalid_request_error", "internal": "server_error"}


def error_response(status: int, message: str, error_type: str, request: Request | None = None) -> JSONResponse:
    """TGI's ``{"error", "error_type"}``, or OpenAI's error object on ``/v1`` routes."""
    if request is not None and request.url.path.startswith("/v1/"):
        body = {"error": {"message": message, "type": OPENAI_TYPES.get(error_type, error_type), "param": None,
                          "code": error_type}}
        return JSONResponse(status_code=status, content=body)
    return JSONResponse(status_code=status, content={"error": message, "error_type": error_type})


def _describe(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            parts.append(f"invalid JSON at character {err['loc'][-1]}" + (f": {detail}" if detail else ""))
            continue
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        parts.append(f"{loc}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request"


class NotReady(Exception):
    """The model is still loading (503)."""


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception a route can raise to a JSON error (never a bare 500 page)."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_response(422, _describe(exc), "validation", request)

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, exc: InvalidRequest):
        return error_response(422, str(exc), "validation", request)

    @app.exception_handler(Overloaded)
    async def _overloaded(request: Request, exc: Overloaded):
        response = error_response(429, f"Model is overloaded: {exc}", "overloaded", request)
        response.headers["Retry-After"] = "1"  # seconds (RFC 9110 section 10.2.3)
        return response

    @app.exception_handler(NotReady)
    async def _not_ready(request: Request, exc: NotReady):
        return error_response(503, str(exc) or "model is loading", "unhealthy", request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400:  # FastAPI could not decode the body (e.g. invalid UTF-8)
            return error_response(422, f"invalid request body: {exc.detail} (expected UTF-8 JSON)", "validation",
                                  request)
        return error_response(exc.status_code, str(exc.detail), "http", request)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}", "internal", request)
