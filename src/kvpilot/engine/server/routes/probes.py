"""Kubernetes probes and Prometheus: ``/health`` is liveness (200 while the engine thread
is alive, also while loading); ``/ready`` is readiness (503 while loading or draining);
``/metrics`` the Prometheus text. None of them is behind the API key."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvpilot.engine.server.error_handlers import error
from kvpilot.engine.server.openapi import errors
from kvpilot.engine.server.protocol import HealthResponse, ReadyResponse
from kvpilot.engine.server.responses import json_response
from kvpilot.engine.server.state import app_state

router = APIRouter()

PROMETHEUS_TEXT: dict[str, Any] = {
    "description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}


@router.get("/health", response_model=None, responses={200: {"model": HealthResponse}, **errors(503)})
async def health(request: Request) -> Response:
    engine = app_state(request).server.engine
    if engine.is_alive:
        return json_response(HealthResponse(status="ok"))
    return error(503, f"the engine is not running: {engine.failure}", "service_unavailable", 503)


@router.get("/ready", response_model=None, responses={200: {"model": ReadyResponse}, **errors(503)})
async def ready(request: Request) -> Response:
    state = app_state(request).server
    if state.draining:
        return error(503, "draining", "service_unavailable", 503)
    if not state.engine.is_ready:
        return error(503, "loading" if state.engine.is_alive else "engine failed", "service_unavailable", 503)
    return json_response(ReadyResponse(status="ready"))


@router.get("/metrics", response_class=PlainTextResponse, responses={200: PROMETHEUS_TEXT})
async def metrics(request: Request) -> Response:
    return Response(generate_latest(app_state(request).server.metrics.registry), media_type=CONTENT_TYPE_LATEST)
