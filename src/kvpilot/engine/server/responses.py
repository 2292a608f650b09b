"""Answering a generation request over HTTP: the whole JSON body, or server-sent events
ending with an OpenAI error event when the request fails after its stream started;
either way abandoned (the engine requests aborted) when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from kvpilot.engine.errors import (
    EngineDeadError,
    InvalidRequestError,
    RequestAbortedError,
    RequestFailedError,
)
from kvpilot.engine.server.protocol import error_body

T = TypeVar("T")
B = TypeVar("B", contravariant=True)


class Handler(Protocol[B]):
    """A generation endpoint's handler (:class:`~kvpilot.engine.server.chat.ChatHandler`,
    :class:`~kvpilot.engine.server.completions.CompletionHandler`)."""

    async def create(self, req: B, header_id: str | None) -> BaseModel | AsyncIterator[str]: ...


def wire(body: BaseModel) -> Any:
    """A response model as the JSON value it is sent as: the fields it was built with
    (``exclude_unset``: an optional field the handler did not set is absent, not null,
    as OpenAI and vLLM send them), in the model's field order."""
    return body.model_dump(exclude_unset=True)


def json_response(body: BaseModel, headers: dict[str, str] | None = None) -> JSONResponse:
    """A whole response body (compact JSON, Starlette's ``JSONResponse`` encoding)."""
    return JSONResponse(wire(body), headers=headers)


def sse_event(body: BaseModel, ensure_ascii: bool = True, event: str | None = None) -> str:
    """One server-sent event carrying a response model (``json.dumps`` spacing; chat
    chunks pass ``ensure_ascii=False`` and keep non-ASCII text as is). ``event`` adds an
    ``event:`` line (the Responses API names each event by its type, as OpenAI and vLLM)."""
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {json.dumps(wire(body), ensure_ascii=ensure_ascii)}\n\n"


async def respond(handler: Handler[B], body: B, request: Request) -> Response:
    """A streamed (SSE) or a whole JSON response; ``X-Request-Id`` names it and is echoed.

    A streamed request is watched for a disconnect from the start: until the first delta
    exists there is no StreamingResponse watching the client, and a client that leaves
    while its request queues must abort it all the same (C09)."""
    header_id = request.headers.get("x-request-id")
    headers = {"X-Request-Id": header_id} if header_id else None
    result = await until_disconnected(request, handler.create(body, header_id))
    if isinstance(result, Response):
        return result
    if isinstance(result, BaseModel):
        return json_response(result, headers)
    return StreamingResponse(with_error_event(result), media_type="text/event-stream", headers=headers)


async def with_error_event(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pass SSE events through; a request that fails after its stream started (an engine
    error, an abort at the drain deadline) ends with an OpenAI error event and
    ``data: [DONE]`` instead of a cut connection (vLLM and OpenAI do the same)."""
    try:
        async for event in events:
            yield event
    except RequestFailedError as e:
        yield sse_event(error_body(str(e), "server_error", 500))
        yield "data: [DONE]\n\n"
    except (RequestAbortedError, EngineDeadError) as e:
        yield sse_event(error_body(str(e), "service_unavailable", 503))
        yield "data: [DONE]\n\n"
    except InvalidRequestError as e:  # the engine ended a choice over what it asked (a dead-end grammar)
        yield sse_event(error_body(str(e), "invalid_request_error", "invalid_value", e.param))
        yield "data: [DONE]\n\n"


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
