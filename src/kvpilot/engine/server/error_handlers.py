"""The exception handlers: every error in the OpenAI body
``{"error": {"message", "type", "param", "code"}}``, with its HTTP status.

FastAPI's request validation errors (its own 422) are answered with a 400 naming the
field; unknown paths, wrong methods and unreadable bodies keep their status; the
engine's request errors (:mod:`kvpilot.engine.errors`) map to 400, 404, 500 and 503.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpilot.engine.errors import (
    EngineDeadError,
    InvalidRequestError,
    ModelNotFound,
    RequestAbortedError,
    RequestFailedError,
)
from kvpilot.engine.server.protocol import error_body
from kvpilot.engine.server.responses import wire


def error(status: int, message: str, err_type: str, code: int | str | None = None,
          param: str | None = None) -> JSONResponse:
    """An error response in the OpenAI body (``code`` defaults to the status)."""
    return JSONResponse(wire(error_body(message, err_type, code if code is not None else status, param)),
                        status_code=status)


def _field_path(loc: Sequence[Any]) -> list[str]:
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


async def on_validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errs = exc.errors()
    first: dict[str, Any] = dict(errs[0]) if errs else {"loc": (), "msg": "invalid request"}
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


async def on_http(_: Request, exc: Exception) -> JSONResponse:
    """Unknown paths (404), wrong methods (405) and bodies that are no JSON text at all
    (invalid UTF-8: 400) in the OpenAI error body, like every other error."""
    assert isinstance(exc, StarletteHTTPException)
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 400 and "parsing the body" in detail:
        detail = "the request body is not valid JSON (or not UTF-8)"
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    response = error(exc.status_code, detail, kind, exc.status_code)
    for key, value in (exc.headers or {}).items():
        response.headers[key] = value
    return response


async def on_invalid(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, InvalidRequestError)
    return error(400, str(exc), "invalid_request_error", "invalid_value", exc.param)


async def on_model(_: Request, exc: Exception) -> JSONResponse:
    """404 for a model (or a LoRA adapter: ``param`` ``lora_name``) not served."""
    param = getattr(exc, "param", "model")
    return error(404, str(exc), "invalid_request_error", "model_not_found", param)


async def on_dead(_: Request, exc: Exception) -> JSONResponse:
    return error(503, str(exc), "service_unavailable", 503)


async def on_failed(_: Request, exc: Exception) -> JSONResponse:
    return error(500, str(exc), "server_error", 500)


async def on_aborted(_: Request, exc: Exception) -> JSONResponse:
    return error(503, str(exc), "service_unavailable", 503)


def add_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on ``app``."""
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(InvalidRequestError, on_invalid)
    app.add_exception_handler(ModelNotFound, on_model)
    app.add_exception_handler(EngineDeadError, on_dead)
    app.add_exception_handler(RequestFailedError, on_failed)
    app.add_exception_handler(RequestAbortedError, on_aborted)
