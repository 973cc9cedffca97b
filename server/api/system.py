"""Operational routes: ``/health``, ``/info``, ``/metrics``."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from server.errors import error_response

router = APIRouter(tags=["system"])


@router.get("/health")
async def health(request: Request):
    """200 once the model is loaded and the engine runs; 503 before, and while draining for a shutdown."""
    state = request.app.state.kvserve
    if state.service is None:
        return error_response(503, state.load_error or state.loading, "unhealthy")
    if state.draining:
        return error_response(503, "server is shutting down", "unhealthy")
    return {"status": "ok"}


@router.get("/info")
async def info(request: Request):
    """Model, KV backends and their parameters, KV bytes per token (:func:`server.engine_loading.kv_sizes`),
    limits, version."""
    state = request.app.state.kvserve
    if state.service is None:
        return error_response(503, state.load_error or state.loading, "unhealthy")
    return state.info


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                             "description": "Prometheus text exposition"}})
async def metrics(request: Request) -> Response:
    """Prometheus exposition of every kvserve metric."""
    return Response(generate_latest(request.app.state.kvserve.metrics.registry), media_type=CONTENT_TYPE_LATEST)
