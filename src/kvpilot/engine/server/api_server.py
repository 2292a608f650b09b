"""The FastAPI application for one engine, put together from its parts.

Errors use the OpenAI body ``{"error": {"message", "type", "param", "code"}}``
(:mod:`~kvpilot.engine.server.error_handlers`); authentication, body limits and the
refusal while loading or draining are middleware (:mod:`~kvpilot.engine.server.middleware`);
the routes are ``APIRouter`` modules under :mod:`kvpilot.engine.server.routes`: the
probes, the OpenAI API and what a KV-aware router calls; the state they share is in
:mod:`~kvpilot.engine.server.state`. The OpenAPI schema (``/openapi.json``, ``/docs``)
declares, per route, the statuses the server really answers with
(:mod:`~kvpilot.engine.server.openapi`).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI

from kvpilot.engine.server.error_handlers import add_error_handlers
from kvpilot.engine.server.middleware import BodyLimitMiddleware, GuardMiddleware
from kvpilot.engine.server.openapi import document_as_served
from kvpilot.engine.server.routes import lora, openai, probes, router_api
from kvpilot.engine.server.state import ServerState, attach

logger = logging.getLogger("kvpilot.serve")


def build_app(state: ServerState) -> FastAPI:
    """The ASGI app for one engine. vLLM's runtime LoRA routes
    (:mod:`~kvpilot.engine.server.routes.lora`) are mounted only when
    ``state.allow_runtime_lora_updating``."""
    app = FastAPI(title="kvpilot", version="0.1.0")
    attach(app, state)
    document_as_served(app)
    # The last added is the outermost: the body limit sees a request before the guard.
    app.add_middleware(GuardMiddleware, state=state)
    app.add_middleware(BodyLimitMiddleware, limit=lambda: state.max_body_bytes)
    add_error_handlers(app)
    # In this order the OpenAPI document lists the paths as it always has.
    for routes in (probes, openai, router_api):
        app.include_router(routes.router)
    if state.allow_runtime_lora_updating:
        logger.warning("LoRA dynamic loading & unloading is enabled in the API server "
                       "(VLLM_ALLOW_RUNTIME_LORA_UPDATING): anyone who can reach the API can load "
                       "adapters from this server's disk")
        app.include_router(lora.router)
    return app
