"""The FastAPI application: routes, authentication, body limits, errors, readiness.

Errors use the OpenAI body ``{"error": {"message", "type", "param", "code"}}``.
``/health`` is liveness (200 while the engine thread is alive, also while loading);
``/ready`` is readiness (503 while loading or draining). ``/health``, ``/ready`` and
``/metrics`` are never behind the API key (probes and Prometheus must reach them).

The OpenAPI schema (``/openapi.json``, ``/docs``) declares, per route, the statuses the
server really answers with and their bodies (:data:`ERRORS`); FastAPI's own 422 is left
out of it, since request validation errors are answered with a 400 in the OpenAI body.

What a KV-aware router (the vLLM project's ``vllm-router --policy kv_aware``) calls, in
vLLM's shapes: ``/get_server_info`` (model, instance id, block size), ``/kv_event_sources``
(the ZMQ publisher of :mod:`kvpilot.engine.kv_events`), ``/get_load`` and the two render
endpoints, which return the exact prompt token ids a request would run with.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpilot import __version__
from kvpilot.engine.errors import (
    EngineDeadError,
    InvalidRequestError,
    ModelNotFound,
    RequestAbortedError,
    RequestFailedError,
)
from kvpilot.engine.kv_events import WIRE_ENCODING, WIRE_SCHEMA_VERSION, KVEventsConfig
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.async_engine import AsyncEngine
from kvpilot.engine.server.chat import ChatHandler, ChatOptions, render_chat
from kvpilot.engine.server.completions import CompletionHandler
from kvpilot.engine.server.metrics import EngineMetrics
from kvpilot.engine.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    KVEventSources,
    LoadResponse,
    ModelCard,
    ModelList,
    ReadyResponse,
    RenderResponse,
    RenderResponseList,
    ServerInfoResponse,
    TokenizeRequest,
    TokenizeResponse,
    error_body,
)
from kvpilot.engine.server.serving import ServingContext

T = TypeVar("T")

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/ready", "/metrics", "/docs", "/openapi.json")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")

# When each error status is answered (all in the OpenAI body, ErrorResponse).
ERRORS: dict[int, str] = {
    400: "invalid request: malformed JSON, a wrong type, a value out of range, an unsupported option, "
         "or a prompt that does not fit the context (`param` names the field)",
    401: "missing or wrong `Authorization: Bearer` key (when the server has an API key)",
    404: "`model` is not the served model name",
    413: "request body over the server's limit",
    500: "the engine failed while running the request",
    503: "the model is still loading, the server is draining, or the engine stopped",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for these error statuses."""
    return {status: {"model": ErrorResponse, "description": ERRORS[status]} for status in statuses}


# Models that only events of a stream reference (added to the document's components).
STREAM_MODELS: tuple[type[BaseModel], ...] = (CompletionStreamResponse, ChatCompletionChunk)


def generated(model: type[BaseModel], chunk: type[BaseModel]) -> dict[str, Any]:
    """The 200 of a generation route: the whole answer as JSON, or with ``stream: true``
    server-sent events. The event schema describes one event (OpenAPI 3.1 has no
    ``itemSchema``): its ``data`` is a ``chunk`` in JSON, an ErrorResponse in JSON (a
    failure after the stream started) or ``[DONE]``, the last one."""
    ref = "#/components/schemas/"
    payload = {"anyOf": [{"$ref": ref + chunk.__name__}, {"$ref": ref + ErrorResponse.__name__}]}
    return {
        "model": model,
        "description": f"the answer; with `stream: true` an event stream of `{chunk.__name__}` chunks",
        "headers": {"X-Request-Id": {"description": "the request's `X-Request-Id`, when it sent one",
                                     "schema": {"type": "string"}}},
        "content": {"text/event-stream": {"schema": {
            "type": "object",
            "required": ["data"],
            "properties": {"data": {"anyOf": [
                {"const": "[DONE]"},
                {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
            ]}},
        }}},
    }


def as_served(schema: dict[str, Any], extra_models: tuple[type[BaseModel], ...] = ()) -> dict[str, Any]:
    """FastAPI's OpenAPI document, corrected to what the server does: FastAPI documents a
    422 ``HTTPValidationError`` for every route with a body, but this server answers
    validation errors with a 400 in the OpenAI body; FastAPI writes numeric bounds as
    floats, which are written back as the integers they are (``2**63`` stays exact); and
    ``extra_models`` (referenced only from hand-written schemas) join the components."""
    if extra_models:
        _, top = models_json_schema([(m, "serialization") for m in extra_models],
                                    ref_template="#/components/schemas/{model}")
        for name, definition in top.get("$defs", {}).items():
            schema.setdefault("components", {}).setdefault("schemas", {}).setdefault(name, definition)
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            if isinstance(operation, dict):
                operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    _integral_bounds(schema)
    return schema


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _integral_bounds(node: Any) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _BOUNDS and isinstance(value, float) and value.is_integer():
                node[key] = int(value)
            else:
                _integral_bounds(value)
    elif isinstance(node, list):
        for item in node:
            _integral_bounds(item)


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


def _field_path(loc: Any) -> list[str]:
    """A pydantic error location as the request's field path: without ``body``, the
    member tags pydantic adds inside unions (``literal['none','auto']``,
    ``function-after[...]``) and the repeated tag of a discriminated union
    (``response_format.json_schema.json_schema.schema`` is ``response_format.json_schema.schema``)."""
    parts: list[str] = []
    for x in loc:
        text = str(x)
        if text == "body" or "[" in text:
            continue
        if parts and parts[-1] == text:
            continue
        parts.append(text)
    return parts


def error(status: int, message: str, err_type: str, code: int | str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, code if code is not None else status, param), status_code=status)


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """413 for request bodies over ``limit`` bytes: by Content-Length before reading, and
    for chunked bodies (no Content-Length) by reading them here, up to the limit, before
    the app sees them (FastAPI turns any error raised while it reads a body into a 400)."""

    def __init__(self, app: Any, limit: Callable[[], int]) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit()
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await self._reject(scope, receive, send, limit)
            return
        if length is None and scope.get("method") in ("POST", "PUT", "PATCH"):
            body, more = await self._read_chunked(receive, limit)
            if more:
                await self._reject(scope, receive, send, limit)
                return
            receive = self._replay(body, receive)
        seen = 0
        started = False

        async def limited_receive() -> dict:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge
            return msg

        async def tracking_send(msg: dict) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._reject(scope, receive, send, limit)

    @staticmethod
    async def _read_chunked(receive: Callable, limit: int) -> tuple[bytes, bool]:
        """The body, and True when it went over ``limit`` (reading stops there)."""
        parts, seen = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return b"".join(parts), False  # the client left; the app will see no body
            parts.append(msg.get("body", b""))
            seen += len(parts[-1])
            if seen > limit:
                return b"", True
            if not msg.get("more_body", False):
                return b"".join(parts), False

    @staticmethod
    def _replay(body: bytes, receive: Callable) -> Callable:
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later: http.disconnect, for the disconnect watchers

        return replay

    @staticmethod
    async def _reject(scope: dict, receive: Callable, send: Callable, limit: int) -> None:
        resp = error(413, f"request body is larger than the limit of {limit} bytes", "request_too_large", 413)
        await resp(scope, receive, send)


class GuardMiddleware:
    """API key check, draining/loading refusal and the in-flight count of generation
    requests (until their response, streamed or not, is complete)."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = self.state
        path = scope["path"]
        if state.api_key is not None and not path.startswith(OPEN_PATHS):
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), state.api_key.encode()):
                resp = error(401, "missing or invalid API key (send Authorization: Bearer <key>)", "authentication_error", 401)
                await resp(scope, receive, send)
                return
        if path not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        if state.draining:
            resp = error(503, "the server is draining and takes no new requests", "service_unavailable", 503)
        elif not state.engine.is_ready:
            resp = error(503, "the model is still loading", "service_unavailable", 503)
        else:
            state.inflight += 1
            try:
                await self.app(scope, self._body_until_drain_deadline(receive), send)
            finally:
                state.inflight -= 1
            return
        await resp(scope, receive, send)

    def _body_until_drain_deadline(self, receive: Callable) -> Callable:
        """``receive`` that gives up waiting for a body that has not arrived by the drain
        deadline: a client that sent headers and stalls would otherwise hold its handler
        until uvicorn cancels it at shutdown (a traceback and a cut connection). The
        503 it raises reaches the client through the HTTP error handler. Once the body is
        in, later calls (disconnect watchers) go straight to ``receive``."""
        state = self.state
        body_done = False

        async def receive_body() -> dict:
            nonlocal body_done
            if body_done:
                return await receive()
            pending = asyncio.ensure_future(receive())
            try:
                while not (await asyncio.wait({pending}, timeout=0.1))[0]:
                    if state.drain_expired:
                        raise StarletteHTTPException(
                            503, "the server is shutting down: the drain timeout passed before the request "
                                 "body arrived")
                msg = pending.result()
            finally:
                if not pending.done():
                    pending.cancel()
            if msg["type"] != "http.request" or not msg.get("more_body", False):
                body_done = True
            return msg

        return receive_body


def build_app(state: ServerState) -> FastAPI:
    """The ASGI app for one engine."""
    app = FastAPI(title="kvpilot", version="0.1.0")
    app.state.kv = state
    fastapi_openapi = app.openapi
    app.openapi = lambda: as_served(fastapi_openapi(), STREAM_MODELS)  # type: ignore[method-assign]
    ctx = ServingContext(state.engine, state.served_model_name, state.metrics)
    completions = CompletionHandler(ctx)
    chat = ChatHandler(ctx, state.chat_options)

    app.add_middleware(GuardMiddleware, state=state)
    app.add_middleware(BodyLimitMiddleware, limit=lambda: state.max_body_bytes)

    # ------------------------------------------------------------ errors
    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        loc = _field_path(first.get("loc", ()))
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        if first.get("type") == "extra_forbidden":
            # A field kvpilot does not implement: refused by name, never ignored.
            msg = (f"{param}: unknown or unsupported field; kvpilot does not implement it, so the request is "
                   "refused rather than answered without it (docs/server.md lists the accepted fields)")
        elif first.get("type") == "json_invalid":
            # loc holds a character offset there, not a field: the whole body is at fault.
            at = loc[0] if loc else "?"
            param = "body"
            msg = f"the request body is not valid JSON (at character {at}): {first.get('ctx', {}).get('error', msg)}"
        elif param:
            msg = f"{param}: {msg} (got {first.get('input')!r:.200})" if "input" in first else f"{param}: {msg}"
        return error(400, msg, "invalid_request_error", "invalid_value", param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown paths (404), wrong methods (405) and bodies that are no JSON text at all
        (invalid UTF-8: 400) in the OpenAI error body, like every other error."""
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in detail:
            detail = "the request body is not valid JSON (or not UTF-8)"
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        response = error(exc.status_code, detail, kind, exc.status_code)
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        return response

    @app.exception_handler(InvalidRequestError)
    async def on_invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error(400, str(exc), "invalid_request_error", "invalid_value", exc.param)

    @app.exception_handler(ModelNotFound)
    async def on_model(_: Request, exc: ModelNotFound) -> JSONResponse:
        return error(404, str(exc), "invalid_request_error", "model_not_found", "model")

    @app.exception_handler(EngineDeadError)
    async def on_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error(503, str(exc), "service_unavailable", 503)

    @app.exception_handler(RequestFailedError)
    async def on_failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        return error(500, str(exc), "server_error", 500)

    @app.exception_handler(RequestAbortedError)
    async def on_aborted(_: Request, exc: RequestAbortedError) -> JSONResponse:
        return error(503, str(exc), "service_unavailable", 503)

    # ------------------------------------------------------------ probes
    @app.get("/health", response_model=None, responses={200: {"model": HealthResponse}, **errors(503)})
    async def health() -> Response:
        if state.engine.is_alive:
            return JSONResponse({"status": "ok"})
        return error(503, f"the engine is not running: {state.engine.failure}", "service_unavailable", 503)

    @app.get("/ready", response_model=None, responses={200: {"model": ReadyResponse}, **errors(503)})
    async def ready() -> Response:
        if state.draining:
            return error(503, "draining", "service_unavailable", 503)
        if not state.engine.is_ready:
            return error(503, "loading" if state.engine.is_alive else "engine failed", "service_unavailable", 503)
        return JSONResponse({"status": "ready"})

    prometheus_text = {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: prometheus_text})
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------- API
    @app.get("/v1/models", responses=errors(401))
    async def models() -> ModelList:
        max_len = state.engine.engine.max_model_len if state.engine.engine is not None else None
        return ModelList(data=[ModelCard(id=state.served_model_name, root=state.served_model_name, max_model_len=max_len)])

    generation_errors = errors(400, 401, 404, 413, 500, 503)

    @app.post("/v1/completions", response_model=None,
              responses={200: generated(CompletionResponse, CompletionStreamResponse), **generation_errors})
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await respond(completions, body, request)

    @app.post("/v1/chat/completions", response_model=None,
              responses={200: generated(ChatCompletionResponse, ChatCompletionChunk), **generation_errors})
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await respond(chat, body, request)

    tokenize_errors = errors(400, 401, 404, 413, 503)

    @app.post("/tokenize", response_model=None, responses={200: {"model": TokenizeResponse}, **tokenize_errors})
    async def tokenize(body: TokenizeRequest) -> Response:
        ctx.check_model(body.model)
        require_ready(state)
        if body.messages is not None:
            ids = await asyncio.to_thread(render_chat, ctx, body.messages, body.add_generation_prompt,
                                          chat_template=state.chat_options.chat_template)
        else:
            ids = await asyncio.to_thread(ctx.tokenizer.encode, body.prompt,
                                          add_special_tokens=body.add_special_tokens)
        return JSONResponse({"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids})

    # -------------------------------------------------- KV-aware routers
    @app.get("/get_server_info", responses={200: {"model": ServerInfoResponse}, **errors(401)})
    async def get_server_info() -> ServerInfoResponse:
        llm = state.engine.engine if state.engine.is_ready else None
        return ServerInfoResponse(
            model_id=state.served_model_name,
            model_path=state.model_path or state.served_model_name,
            served_model_name=state.served_model_name,
            instance_id=state.instance_id,
            kv_block_size=llm.config.block_size if llm is not None else state.kv_block_size,
            max_model_len=llm.max_model_len if llm is not None else None,
            kv_events=kv_event_sources_of(state) is not None,
            version=__version__,
        )

    events_off = {"model": ErrorResponse, "description": "KV cache events are off (no `--kv-events-config` "
                  "with `enable_kv_cache_events: true` and the zmq publisher)"}

    @app.get("/kv_event_sources", response_model=None,
             responses={200: {"model": KVEventSources}, 404: events_off, **errors(401)})
    async def kv_event_sources() -> Response:
        sources = kv_event_sources_of(state)
        if sources is None:
            return error(404, "KV cache events are off on this server; start it with --kv-events-config "
                         "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\"}'",
                         "invalid_request_error", "not_found")
        return JSONResponse(sources)

    @app.get("/get_load", responses={200: {"model": LoadResponse}, **errors(401)})
    async def get_load() -> LoadResponse:
        llm = state.engine.engine if state.engine.is_ready else None
        # Two len() reads of the engine thread's queues: atomic, possibly one step apart.
        running = llm.scheduler.num_running if llm is not None else 0
        waiting = llm.scheduler.num_waiting if llm is not None else 0
        return LoadResponse(load=running + waiting, num_running_requests=running, num_waiting_requests=waiting)

    @app.post("/v1/chat/completions/render", response_model=None,
              responses={200: {"model": RenderResponse, "description": "the rendered request"}, **tokenize_errors})
    async def render_chat_completion(body: ChatCompletionRequest) -> Response:
        """The prompt token ids and sampling parameters `POST /v1/chat/completions` would
        run this request with (chat template included); nothing is generated. Refuses
        what that endpoint refuses, with the same errors."""
        ctx.check_model(body.model)
        require_ready(state)
        prep = await chat.prepare(body)
        params = chat.sampling_params(body, prep)
        ctx.llm.check_request(prep.ids, params)
        return JSONResponse(rendered("chatcmpl", prep.ids, params, body, state.served_model_name))

    @app.post("/v1/completions/render", response_model=None,
              responses={200: {"model": RenderResponseList, "description": "one rendered request per prompt"},
                         **tokenize_errors})
    async def render_completion(body: CompletionRequest) -> Response:
        """What `POST /v1/completions` would run: one entry per prompt, with its token ids
        and sampling parameters; nothing is generated. Refuses what that endpoint refuses."""
        ctx.check_model(body.model)
        require_ready(state)
        prompts, max_tokens = await completions.prepare(body)
        if body.max_tokens == 0:  # echo only: the real endpoint generates nothing
            if body.stream:
                raise InvalidRequestError("max_tokens=0 with echo is not supported when streaming", "max_tokens")
            params = None
        else:
            so, _ = await completions.constraint(body)
            params = completions.sampling_params(body, max_tokens, so)
            for ids in prompts:
                ctx.llm.check_request(ids, params)
        return JSONResponse([rendered("cmpl", ids, params, body, state.served_model_name) for ids in prompts])

    @app.post("/detokenize", response_model=None, responses={200: {"model": DetokenizeResponse}, **tokenize_errors})
    async def detokenize(body: DetokenizeRequest) -> Response:
        ctx.check_model(body.model)
        require_ready(state)
        vocab = ctx.llm.model_config.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        return JSONResponse({"prompt": ctx.tokenizer.decode(body.tokens)})

    return app


def kv_event_sources_of(state: ServerState) -> dict[str, dict[str, Any]] | None:
    """``/kv_event_sources``'s body (vLLM's shape, keyed by data-parallel rank), or None
    when events are off. The addresses are the bound ones (a ``:0`` port resolved)."""
    cfg, pub = state.kv_events, state.kv_publisher
    if cfg is None or not cfg.publishes or pub is None or getattr(pub, "endpoint", None) is None:
        return None
    return {"0": {
        "endpoint": pub.endpoint,
        "replay_endpoint": pub.replay_endpoint,
        "topic": cfg.topic,
        "hwm": cfg.hwm,
        "buffer_steps": cfg.buffer_steps,
        "max_queue_size": cfg.max_queue_size,
        "publisher": cfg.publisher,
        "enable_kv_cache_events": True,
        "encoding": WIRE_ENCODING,
        "schema_version": WIRE_SCHEMA_VERSION,
    }}


def rendered(prefix: str, ids: list[int], params: SamplingParams | None, body: Any, served: str) -> dict[str, Any]:
    """One render result in vLLM's ``GenerateRequest`` shape. ``params`` None is an
    echo-only completion (``max_tokens: 0``: nothing would be sampled)."""
    return {
        "request_id": f"{prefix}-{uuid.uuid4().hex}",
        "token_ids": ids,
        "features": None,
        "sampling_params": dataclasses.asdict(params) if params is not None else {"max_tokens": 0},
        "model": body.model or served,
        "stream": body.stream,
        "stream_options": body.stream_options.model_dump() if body.stream_options is not None else None,
        "cache_salt": body.cache_salt,
        "priority": 0,
    }


async def respond(handler: CompletionHandler | ChatHandler, body: Any, request: Request) -> Response:
    """A streamed (SSE) or a whole JSON response; ``X-Request-Id`` names it and is echoed."""
    header_id = request.headers.get("x-request-id")
    headers = {"X-Request-Id": header_id} if header_id else None
    if body.stream:
        # Until the first delta exists there is no StreamingResponse watching the client:
        # a client that leaves while its request queues must abort it all the same (C09).
        events = await until_disconnected(request, handler.stream(body, header_id))
        if isinstance(events, Response):
            return events
        return StreamingResponse(with_error_event(events), media_type="text/event-stream", headers=headers)
    result = await until_disconnected(request, handler.complete(body, header_id))
    return result if isinstance(result, Response) else JSONResponse(result, headers=headers)


async def with_error_event(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pass SSE events through; a request that fails after its stream started (an engine
    error, an abort at the drain deadline) ends with an OpenAI error event and
    ``data: [DONE]`` instead of a cut connection (vLLM and OpenAI do the same)."""
    try:
        async for event in events:
            yield event
    except RequestFailedError as e:
        yield f"data: {json.dumps(error_body(str(e), 'server_error', 500))}\n\n"
        yield "data: [DONE]\n\n"
    except (RequestAbortedError, EngineDeadError) as e:
        yield f"data: {json.dumps(error_body(str(e), 'service_unavailable', 503))}\n\n"
        yield "data: [DONE]\n\n"
    except InvalidRequestError as e:  # the engine ended a choice over what it asked (a dead-end grammar)
        yield f"data: {json.dumps(error_body(str(e), 'invalid_request_error', 'invalid_value', e.param))}\n\n"
        yield "data: [DONE]\n\n"


def require_ready(state: ServerState) -> None:
    if not state.engine.is_ready:
        raise EngineDeadError("the model is still loading" if state.engine.is_alive else "the engine is not running")


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """Run ``work`` unless the client goes away first; then cancel it (which aborts the
    engine requests and frees their blocks) and answer nobody."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Response(status_code=499)
