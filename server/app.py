"""The FastAPI application: routes, error handlers, and model loading in the background at start-up.

``/health`` answers 503 while the model loads and 200 once the engine runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI

from server import __version__
from server.api import openai, responses, system, tgi, tokenize, ui
from server.api.request_model import json_schema_keywords
from server.config import Settings
from server.errors import install_error_handlers
from server.middleware import (BearerAuth, BodyBounds, BodyTimeout, HeadAsGet, HeaderLimit, InFlight,
                               JsonContentType, PayloadLimit)
from server.state import ServerState

log = logging.getLogger("kvserve")


def create_app(settings: Settings, load_in_background: bool = True, exit_on_load_error: bool = False) -> FastAPI:
    """Build the app for ``settings``.

    Args:
        settings: validated settings.
        load_in_background: load the model in a thread after start-up (``/health`` is 503 until
            done); ``False`` loads it before the app starts serving.
        exit_on_load_error: when loading fails (model, backend, calibration), stop the server (SIGINT to
            this process) instead of answering 503 forever; ``kvserve serve`` then exits with status 1 and
            one line naming the cause (``state.load_error``).
    """
    state = ServerState(settings, exit_on_fatal=exit_on_load_error)

    def load(loop: asyncio.AbstractEventLoop) -> None:
        from server.engine.core_client import StartStopped

        try:
            state.load(loop)
        except StartStopped:  # SIGTERM or Ctrl-C while loading: the stop ended the core, no failure to report
            log.info("stopped before the engine core was ready")
        except Exception as exc:  # noqa: BLE001 - reported through /health, and logged
            state.load_error = f"model failed to load: {' '.join(str(exc).split()) or type(exc).__name__}"
            if isinstance(exc, ValueError):  # a setting this model cannot take (e.g. a KV budget under 2 blocks)
                log.error("%s", state.load_error)
            else:
                log.exception("model failed to load")
            if exit_on_load_error:
                os.kill(os.getpid(), signal.SIGINT)  # uvicorn's graceful shutdown; the CLI exits 1

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        loop = asyncio.get_running_loop()  # the engine core's outputs are read by a task on it
        if load_in_background:
            threading.Thread(target=load, args=(loop,), name="kvserve-load", daemon=True).start()
        else:
            load(loop)
        yield
        await asyncio.to_thread(state.shutdown)  # the loop reads the core's last outputs while it drains

    # A body without Content-Type is read as JSON (as vLLM does); one of another type gets 415 (JsonContentType).
    app = FastAPI(title="kvserve", version=__version__, lifespan=lifespan, strict_content_type=False,
                  description="LLM inference server with pluggable KV-cache backends.")
    app.state.kvserve = state
    install_error_handlers(app)
    app.add_middleware(InFlight, limit=settings.max_concurrent_requests, state=state)
    app.add_middleware(BodyBounds, state=state)
    app.add_middleware(PayloadLimit, limit=settings.payload_limit)
    app.add_middleware(BodyTimeout, timeout=settings.request_body_timeout)  # outside every read of the body
    app.add_middleware(JsonContentType)  # outside the in-flight count: a body refused is never counted
    app.add_middleware(HeaderLimit, max_headers=settings.max_headers)
    if settings.api_key:
        app.add_middleware(BearerAuth, api_key=settings.api_key, static_paths=ui.PUBLIC_PATHS)
    app.add_middleware(HeadAsGet)  # outermost: every check within sees the GET it answers as
    app.include_router(system.router)
    app.include_router(ui.router)
    app.include_router(tgi.router)
    app.include_router(openai.router)
    app.include_router(responses.router)
    app.include_router(tokenize.router)
    plain_openapi = app.openapi

    def openapi() -> dict:  # JSON Schema's bound names where pydantic left its own (``ge`` on ``Int | None``)
        return json_schema_keywords(plain_openapi())

    app.openapi = openapi
    return app
