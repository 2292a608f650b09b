"""What a KV-aware router (the vLLM project's ``vllm-router --policy kv_aware``) calls,
in vLLM's shapes: ``/get_server_info`` (model, instance id, block size),
``/kv_event_sources`` (the ZMQ publisher of :mod:`kvpilot.engine.kv_events`),
``/get_load``, the render endpoints (chat, completions, responses), which return the
exact prompt token ids a request would run with, and ``/detokenize`` (last, so the
OpenAPI document lists the paths in the order it always has)."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvpilot import __version__
from kvpilot.engine.errors import InvalidRequestError
from kvpilot.engine.kv_events import WIRE_ENCODING, WIRE_SCHEMA_VERSION
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.error_handlers import error
from kvpilot.engine.server.openapi import errors
from kvpilot.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    KVEventSource,
    KVEventSources,
    LoadResponse,
    RenderResponse,
    RenderResponseList,
    ResponsesRequest,
    ServerInfoResponse,
    StreamOptions,
)
from kvpilot.engine.server.responses import json_response
from kvpilot.engine.server.state import ServerState, app_state

router = APIRouter()

TOKENIZE_ERRORS = errors(400, 401, 404, 413, 503)
EVENTS_OFF: dict[str, Any] = {
    "model": ErrorResponse, "description": "KV cache events are off (no `--kv-events-config` "
    "with `enable_kv_cache_events: true` and the zmq publisher)"}


def kv_event_sources_of(state: ServerState) -> KVEventSources | None:
    """``/kv_event_sources``'s body (vLLM's shape, keyed by data-parallel rank), or None
    when events are off. The addresses are the bound ones (a ``:0`` port resolved)."""
    cfg, pub = state.kv_events, state.kv_publisher
    if cfg is None or not cfg.publishes or pub is None or getattr(pub, "endpoint", None) is None:
        return None
    return KVEventSources({"0": KVEventSource(
        endpoint=pub.endpoint,
        replay_endpoint=pub.replay_endpoint,
        topic=cfg.topic,
        hwm=cfg.hwm,
        buffer_steps=cfg.buffer_steps,
        max_queue_size=cfg.max_queue_size,
        publisher="zmq",  # what `publishes` means
        enable_kv_cache_events=True,
        encoding=WIRE_ENCODING,
        schema_version=WIRE_SCHEMA_VERSION,
    )})


def rendered(prefix: str, ids: list[int], params: SamplingParams | None,
             body: ChatCompletionRequest | CompletionRequest | ResponsesRequest, served: str) -> RenderResponse:
    """One render result in vLLM's ``GenerateRequest`` shape. ``params`` None is an
    echo-only completion (``max_tokens: 0``: nothing would be sampled). A Responses
    request has no stream options (null)."""
    options = None if isinstance(body, ResponsesRequest) else body.stream_options
    return RenderResponse(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        token_ids=ids,
        features=None,
        sampling_params=dataclasses.asdict(params) if params is not None else {"max_tokens": 0},
        model=body.model or served,
        stream=body.stream,
        # every field of the request's stream options, defaults included
        stream_options=StreamOptions(**options.model_dump()) if options is not None else None,
        cache_salt=body.cache_salt,
        priority=0,
    )


@router.get("/get_server_info", responses={200: {"model": ServerInfoResponse}, **errors(401)})
async def get_server_info(request: Request) -> ServerInfoResponse:
    state = app_state(request).server
    llm = state.engine.engine if state.engine.is_ready else None
    return ServerInfoResponse(
        model_id=state.served_model_name,
        model_path=state.model_path or state.served_model_name,
        served_model_name=state.served_model_name,
        instance_id=state.instance_id,
        kv_block_size=llm.config.block_size if llm is not None else state.kv_block_size,
        max_model_len=llm.max_model_len if llm is not None else None,
        data_parallel_size=1,
        kv_events=kv_event_sources_of(state) is not None,
        version=__version__,
    )


@router.get("/kv_event_sources", response_model=None,
            responses={200: {"model": KVEventSources}, 404: EVENTS_OFF, **errors(401)})
async def kv_event_sources(request: Request) -> Response:
    sources = kv_event_sources_of(app_state(request).server)
    if sources is None:
        return error(404, "KV cache events are off on this server; start it with --kv-events-config "
                     "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\"}'",
                     "invalid_request_error", "not_found")
    return json_response(sources)


@router.get("/get_load", responses={200: {"model": LoadResponse}, **errors(401)})
async def get_load(request: Request) -> LoadResponse:
    state = app_state(request).server
    llm = state.engine.engine if state.engine.is_ready else None
    # Two len() reads of the engine thread's queues: atomic, possibly one step apart.
    running = llm.scheduler.num_running if llm is not None else 0
    waiting = llm.scheduler.num_waiting if llm is not None else 0
    return LoadResponse(load=running + waiting, num_running_requests=running, num_waiting_requests=waiting)


@router.post("/v1/chat/completions/render", response_model=None,
             responses={200: {"model": RenderResponse, "description": "the rendered request"}, **TOKENIZE_ERRORS})
async def render_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    """The prompt token ids and sampling parameters `POST /v1/chat/completions` would
    run this request with (chat template included); nothing is generated. Refuses
    what that endpoint refuses, with the same errors."""
    app = app_state(request)
    ids, params = await app.chat.render(body)
    return json_response(rendered("chatcmpl", ids, params, body, app.server.served_model_name))


@router.post("/v1/completions/render", response_model=None,
             responses={200: {"model": RenderResponseList, "description": "one rendered request per prompt"},
                        **TOKENIZE_ERRORS})
async def render_completion(body: CompletionRequest, request: Request) -> Response:
    """What `POST /v1/completions` would run: one entry per prompt, with its token ids
    and sampling parameters; nothing is generated. Refuses what that endpoint refuses."""
    app = app_state(request)
    runs = await app.completions.render(body)
    return json_response(RenderResponseList(
        [rendered("cmpl", ids, params, body, app.server.served_model_name) for ids, params in runs]))


@router.post("/v1/responses/render", response_model=None,
             responses={200: {"model": RenderResponse, "description": "the rendered request"}, **TOKENIZE_ERRORS})
async def render_response(body: ResponsesRequest, request: Request) -> Response:
    """What `POST /v1/responses` would run (vLLM's render endpoint, which
    `vllm-router --policy kv_aware` calls before routing a Responses request): the
    prompt token ids and sampling parameters; nothing is generated. Refuses what that
    endpoint refuses, with the same errors."""
    app = app_state(request)
    ids, params = await app.responses.render(body)
    return json_response(rendered("resp", ids, params, body, app.server.served_model_name))


@router.post("/detokenize", response_model=None, responses={200: {"model": DetokenizeResponse}, **TOKENIZE_ERRORS})
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    ctx = app_state(request).ctx
    ctx.check_model(body.model)
    ctx.require_ready()
    vocab = ctx.llm.model_config.vocab_size
    bad = [t for t in body.tokens if t >= vocab]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
    return json_response(DetokenizeResponse(prompt=ctx.tokenizer.decode(body.tokens)))
