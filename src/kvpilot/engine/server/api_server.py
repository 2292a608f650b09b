"""The FastAPI application: routes, authentication, body limits, errors, readiness.

Errors use the OpenAI body ``{"error": {"message", "type", "param", "code"}}``.
``/health`` is liveness (200 while the engine thread is alive, also while loading);
``/ready`` is readiness (503 while loading or draining). ``/health``, ``/ready`` and
``/metrics`` are never behind the API key (probes and Prometheus must reach them).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpilot.engine.sampling_params import InvalidRequestError
from kvpilot.engine.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    RequestAbortedError,
    RequestFailedError,
)
from kvpilot.engine.server.chat import ChatHandler, render_chat
from kvpilot.engine.server.completions import CompletionHandler
from kvpilot.engine.server.metrics import EngineMetrics
from kvpilot.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    error_body,
)
from kvpilot.engine.server.serving import ModelNotFound, ServingContext

T = TypeVar("T")

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/ready", "/metrics", "/docs", "/openapi.json")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class ServerState:
    """Mutable server-wide state (set by the CLI and the drain logic)."""

    engine: AsyncEngine
    metrics: EngineMetrics
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    draining: bool = False
    inflight: int = 0  # generation requests being served


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
                await self.app(scope, receive, send)
            finally:
                state.inflight -= 1
            return
        await resp(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    """The ASGI app for one engine."""
    app = FastAPI(title="kvpilot", version="0.1.0")
    app.state.kv = state
    ctx = ServingContext(state.engine, state.served_model_name)
    completions = CompletionHandler(ctx)
    chat = ChatHandler(ctx)

    app.add_middleware(GuardMiddleware, state=state)
    app.add_middleware(BodyLimitMiddleware, limit=lambda: state.max_body_bytes)

    # ------------------------------------------------------------ errors
    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
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
    @app.get("/health")
    async def health() -> Response:
        if state.engine.is_alive:
            return JSONResponse({"status": "ok"})
        return error(503, f"the engine is not running: {state.engine.failure}", "service_unavailable", 503)

    @app.get("/ready")
    async def ready() -> Response:
        if state.draining:
            return error(503, "draining", "service_unavailable", 503)
        if not state.engine.is_ready:
            return error(503, "loading" if state.engine.is_alive else "engine failed", "service_unavailable", 503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------- API
    @app.get("/v1/models")
    async def models() -> ModelList:
        max_len = state.engine.engine.max_model_len if state.engine.engine is not None else None
        return ModelList(data=[ModelCard(id=state.served_model_name, root=state.served_model_name, max_model_len=max_len)])

    @app.post("/v1/completions", response_model=None)
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await respond(completions, body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await respond(chat, body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        ctx.check_model(body.model)
        require_ready(state)
        if body.messages is not None:
            ids = await asyncio.to_thread(render_chat, ctx, body.messages, body.add_generation_prompt)
        else:
            ids = await asyncio.to_thread(ctx.tokenizer.encode, body.prompt,
                                          add_special_tokens=body.add_special_tokens)
        return JSONResponse({"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        ctx.check_model(body.model)
        require_ready(state)
        vocab = ctx.llm.model_config.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        return JSONResponse({"prompt": ctx.tokenizer.decode(body.tokens)})

    return app


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
