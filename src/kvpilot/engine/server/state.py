"""The server's shared state: what the CLI and the drain logic set (:class:`ServerState`)
and what the routes reach through ``request.app.state`` (:class:`AppState`)."""

from __future__ import annotations

import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request

from kvpilot.engine.kv_events import KVEventsConfig
from kvpilot.engine.server.async_engine import AsyncEngine
from kvpilot.engine.server.chat import ChatHandler, ChatOptions
from kvpilot.engine.server.completions import CompletionHandler
from kvpilot.engine.server.metrics import EngineMetrics
from kvpilot.engine.server.serving import ServingContext


def new_instance_id() -> str:
    """Unique per process start (a router tells a restarted engine from the old one by
    it): the host name, the start time in seconds and 8 random hex digits."""
    return f"{socket.gethostname()}-{int(time.time())}-{uuid.uuid4().hex[:8]}"


@dataclass
class ServerState:
    """Mutable server-wide state (set by the CLI and the drain logic).

    ``kv_events`` is the ``--kv-events-config`` and ``kv_publisher`` the started
    publisher (its bound addresses go into ``/kv_event_sources``); ``kv_block_size`` and
    ``model_path`` answer ``/get_server_info`` before the model has loaded.
    """

    engine: AsyncEngine
    metrics: EngineMetrics
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    draining: bool = False
    drain_expired: bool = False  # the drain deadline passed: what is left gets a 503
    inflight: int = 0  # generation requests being served
    kv_events: KVEventsConfig | None = None
    kv_publisher: Any = None
    kv_block_size: int = 16
    model_path: str | None = None
    instance_id: str = field(default_factory=new_instance_id)
    chat_options: ChatOptions = field(default_factory=ChatOptions)


@dataclass(frozen=True)
class AppState:
    """What the routes share: the server state and the request handlers on its engine."""

    server: ServerState
    ctx: ServingContext
    completions: CompletionHandler
    chat: ChatHandler

    @classmethod
    def of(cls, server: ServerState) -> AppState:
        ctx = ServingContext(server.engine, server.served_model_name, server.metrics)
        return cls(server, ctx, CompletionHandler(ctx), ChatHandler(ctx, server.chat_options))


def attach(app: FastAPI, server: ServerState) -> None:
    """Put ``server`` and its handlers on ``app.state``, for :func:`app_state`."""
    app.state.kvpilot = AppState.of(server)


def app_state(request: Request) -> AppState:
    """The AppState of the app serving ``request``."""
    state = request.app.state.kvpilot
    assert isinstance(state, AppState)
    return state
