"""The OpenAPI document (``/openapi.json``, ``/docs``) as the server really answers.

Per route it declares the statuses the server answers with and their bodies
(:data:`ERRORS`); FastAPI's own 422 is left out, since request validation errors are
answered with a 400 in the OpenAI body.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvpilot.engine.server.protocol import (
    ChatCompletionChunk,
    CompletionStreamResponse,
    ErrorResponse,
    ResponsesStreamEvent,
)

# When each error status is answered (all in the OpenAI body, ErrorResponse).
ERRORS: dict[int, str] = {
    400: "invalid request: malformed JSON, a wrong type, a value out of range, an unsupported option, "
         "or a prompt that does not fit the context (`param` names the field)",
    401: "missing or wrong `Authorization: Bearer` key (when the server has an API key)",
    404: "`model` is neither the served model name nor a loaded LoRA adapter",
    413: "request body over the server's limit",
    500: "the engine failed while running the request",
    503: "the model is still loading, the server is draining, or the engine stopped",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for these error statuses."""
    return {status: {"model": ErrorResponse, "description": ERRORS[status]} for status in statuses}


# Models that only events of a stream reference (added to the document's components).
STREAM_MODELS: tuple[type[BaseModel], ...] = (CompletionStreamResponse, ChatCompletionChunk, ResponsesStreamEvent)
REQUEST_ID_HEADER: dict[str, Any] = {"X-Request-Id": {
    "description": "the request's `X-Request-Id`, when it sent one", "schema": {"type": "string"}}}


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
        "headers": REQUEST_ID_HEADER,
        "content": {"text/event-stream": {"schema": {
            "type": "object",
            "required": ["data"],
            "properties": {"data": {"anyOf": [
                {"const": "[DONE]"},
                {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
            ]}},
        }}},
    }


def generated_events(model: type[BaseModel], event: type[BaseModel]) -> dict[str, Any]:
    """The 200 of ``POST /v1/responses``: the whole answer as JSON, or with ``stream:
    true`` server-sent events in the Responses API's form: each names its ``event`` (the
    type) and carries one ``event`` model as its ``data`` (a failure after the stream
    started is its ``error`` event); no ``[DONE]`` follows the last."""
    return {
        "model": model,
        "description": f"the answer; with `stream: true` an event stream of `{event.__name__}` events",
        "headers": REQUEST_ID_HEADER,
        "content": {"text/event-stream": {"schema": {
            "type": "object",
            "required": ["event", "data"],
            "properties": {
                "event": {"type": "string", "description": "the event's `type`"},
                "data": {"type": "string", "contentMediaType": "application/json",
                         "contentSchema": {"$ref": "#/components/schemas/" + event.__name__}},
            },
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


def document_as_served(app: FastAPI) -> None:
    """Make ``app`` serve :func:`as_served`'s document (stream models included)."""
    fastapi_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        return as_served(fastapi_openapi(), STREAM_MODELS)

    app.openapi = openapi  # type: ignore[method-assign]
