"""The JSON body of every error: TGI's ``{"error", "error_type"}``, or OpenAI's error object on OpenAI's routes.

A leaf shared by the routes' exception handlers (:mod:`server.errors`) and the ASGI middleware
(:mod:`server.middleware`), which answer alike.
"""

from __future__ import annotations

OPENAI_ROOT_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")
"""vLLM's routes outside ``/v1``: they answer OpenAI's error object, as vLLM's do."""

OPENAI_TYPES = {"validation": "invalid_request_error", "overloaded": "overloaded_error",
                "unhealthy": "service_unavailable_error", "authentication": "authentication_error",
                "http": "invalid_request_error", "internal": "server_error",
                "model_not_found": "invalid_request_error", "generation": "server_error"}


def openai_path(path: str) -> bool:
    """Whether ``path`` answers errors in OpenAI's shape (``/v1/...`` and :data:`OPENAI_ROOT_PATHS`)."""
    return path.startswith("/v1/") or path in OPENAI_ROOT_PATHS


def error_body(openai: bool, message: str, error_type: str, param: str | None = None) -> dict:
    """TGI's ``{"error": message, "error_type": error_type}``, or with ``openai`` OpenAI's ``{"error": {"message",
    "type", "param", "code"}}`` (``type`` from :data:`OPENAI_TYPES`, ``code`` the TGI error type, ``param`` the
    request field at fault if one is)."""
    if openai:
        return {"error": {"message": message, "type": OPENAI_TYPES.get(error_type, error_type), "param": param,
                          "code": error_type}}
    return {"error": message, "error_type": error_type}


def error_bytes(body: dict) -> bytes:
    """``body`` written as the routes' ``JSONResponse`` writes every other answer: compact (no spaces after ``,``
    and ``:``), its text UTF-8 rather than ``\\u`` escapes, as TGI's serde_json and vLLM write theirs."""
    import json

    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
