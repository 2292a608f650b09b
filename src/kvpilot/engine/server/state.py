"""The server's shared state: what the CLI and the drain logic set (:class:`ServerState`)
and what the routes reach through ``request.app.state`` (:class:`AppState`)."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request

from kvpilot.engine.kv_events import KVEventsConfig
from kvpilot.engine.server.async_engine import AsyncEngine
from kvpilot.engine.server.chat import ChatHandler, ChatOptions
from kvpilot.engine.server.completions import CompletionHandler
from kvpilot.engine.server.metrics import EngineMetrics
from kvpilot.engine.server.responses_api import ResponsesHandler
from kvpilot.engine.server.serving import ServingContext

# vLLM's switch for POST /v1/load_lora_adapter and /v1/unload_lora_adapter: the routes
# exist only when it is "1" or "true" (any case, spaces around ignored), as in vLLM.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating(environ: Mapping[str, str] | None = None) -> bool:
    """Whether :data:`RUNTIME_LORA_ENV` allows loading and unloading LoRA adapters at
    runtime (``environ``: ``os.environ`` by default)."""
    env = os.environ if environ is None else environ
    return env.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")


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
    ``enable_lora`` is ``--enable-lora`` (requests may name adapters);
    ``allow_runtime_lora_updating`` mounts ``POST /v1/load_lora_adapter`` and
    ``/v1/unload_lora_adapter`` (:func:`runtime_lora_updating`, read when the state is made).
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
    enable_lora: bool = False
    allow_runtime_lora_updating: bool = field(default_factory=runtime_lora_updating)


@dataclass(frozen=True)
class AppState:
    """What the routes share: the server state and the request handlers on its engine."""

    server: ServerState
    ctx: ServingContext
    completions: CompletionHandler
    chat: ChatHandler
    responses: ResponsesHandler

    @classmethod
    def of(cls, server: ServerState) -> AppState:
        ctx = ServingContext(server.engine, server.served_model_name, server.metrics, server.enable_lora)
        chat = ChatHandler(ctx, server.chat_options)
        return cls(server, ctx, CompletionHandler(ctx), chat, ResponsesHandler(chat))


def attach(app: FastAPI, server: ServerState) -> None:
    """Put ``server`` and its handlers on ``app.state``, for :func:`app_state`."""
    app.state.kvpilot = AppState.of(server)


def app_state(request: Request) -> AppState:
    """The AppState of the app serving ``request``."""
    state = request.app.state.kvpilot
    assert isinstance(state, AppState)
    return state
