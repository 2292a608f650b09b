"""The ASGI middleware: request body limits (413) and the guard in front of the routes
(the API key, refusal while loading or draining, the in-flight count of generation
requests). ``/health``, ``/ready`` and ``/metrics`` are never behind the API key (probes
and Prometheus must reach them)."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpilot.engine.server.error_handlers import error
from kvpilot.engine.server.state import ServerState

OPEN_PATHS = ("/health", "/ready", "/metrics", "/docs", "/openapi.json")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """413 for request bodies over ``limit`` bytes: by Content-Length before reading, and
    for chunked bodies (no Content-Length) by reading them here, up to the limit, before
    the app sees them (FastAPI turns any error raised while it reads a body into a 400)."""

    def __init__(self, app: ASGIApp, limit: Callable[[], int]) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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

        async def limited_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge
            return msg

        async def tracking_send(msg: Message) -> None:
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
    async def _read_chunked(receive: Receive, limit: int) -> tuple[bytes, bool]:
        """The body, and True when it went over ``limit`` (reading stops there)."""
        parts: list[bytes] = []
        seen = 0
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
    def _replay(body: bytes, receive: Receive) -> Receive:
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later: http.disconnect, for the disconnect watchers

        return replay

    @staticmethod
    async def _reject(scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        resp = error(413, f"request body is larger than the limit of {limit} bytes", "request_too_large", 413)
        await resp(scope, receive, send)


class GuardMiddleware:
    """API key check, draining/loading refusal and the in-flight count of generation
    requests (until their response, streamed or not, is complete)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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

    def _body_until_drain_deadline(self, receive: Receive) -> Receive:
        """``receive`` that gives up waiting for a body that has not arrived by the drain
        deadline: a client that sent headers and stalls would otherwise hold its handler
        until uvicorn cancels it at shutdown (a traceback and a cut connection). The
        503 it raises reaches the client through the HTTP error handler. Once the body is
        in, later calls (disconnect watchers) go straight to ``receive``."""
        state = self.state
        body_done = False

        async def receive_body() -> Message:
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
