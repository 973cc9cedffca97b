"""Helpers shared by the route modules."""

from __future__ import annotations

from fastapi import Request

from server.errors import NotReady
from server.service import GenerationService


def get_service(request: Request) -> GenerationService:
    """The generation service, once the model is loaded.

    Raises:
        NotReady: while the model is loading (or failed to load).
    """
    state = request.app.state.kvserve
    if state.service is None:
        raise NotReady(state.load_error or "model is loading")
    return state.service
