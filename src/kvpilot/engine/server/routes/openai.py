"""The OpenAI API: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
``/v1/responses`` and vLLM's ``/tokenize``. A generation request enters its handler once
(:meth:`~kvpilot.engine.server.chat.ChatHandler.create`), which validates, renders the
prompt, builds the sampling parameters, generates and answers."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvpilot.engine.server.chat import render_chat
from kvpilot.engine.server.openapi import errors, generated, generated_events
from kvpilot.engine.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    ModelCard,
    ModelList,
    ResponsesRequest,
    ResponsesResponse,
    ResponsesStreamEvent,
    TokenizeRequest,
    TokenizeResponse,
)
from kvpilot.engine.server.responses import json_response, respond
from kvpilot.engine.server.state import app_state

router = APIRouter()

GENERATION_ERRORS = errors(400, 401, 404, 413, 500, 503)
TOKENIZE_ERRORS = errors(400, 401, 404, 413, 503)


@router.get("/v1/models", response_model=None, responses={200: {"model": ModelList}, **errors(401)})
async def models(request: Request) -> Response:
    """The base model's card, then one per LoRA adapter loaded (vLLM's order): `id` the
    adapter's name, `root` its folder, `parent` its base model."""
    app = app_state(request)
    state = app.server
    max_len = state.engine.engine.max_model_len if state.engine.engine is not None else None
    base = ModelCard(id=state.served_model_name, root=state.served_model_name, max_model_len=max_len)
    # Every field of each card, as FastAPI's serialization of ModelList wrote them; the base
    # card has no parent (absent, not null).
    cards = [base.model_dump(exclude={"parent"})]
    manager = app.ctx.lora
    for lora in manager.list() if manager is not None else ():
        cards.append(ModelCard(id=lora.lora_name, root=lora.lora_path,
                               parent=lora.base_model_name or state.served_model_name).model_dump())
    return JSONResponse({"object": "list", "data": cards})


@router.post("/v1/completions", response_model=None,
             responses={200: generated(CompletionResponse, CompletionStreamResponse), **GENERATION_ERRORS})
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    return await respond(app_state(request).completions, body, request)


@router.post("/v1/chat/completions", response_model=None,
             responses={200: generated(ChatCompletionResponse, ChatCompletionChunk), **GENERATION_ERRORS})
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    return await respond(app_state(request).chat, body, request)


@router.post("/v1/responses", response_model=None,
             responses={200: generated_events(ResponsesResponse, ResponsesStreamEvent), **GENERATION_ERRORS})
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    """OpenAI's Responses API, stateless: nothing is stored (`store` is answered false;
    `background` and `previous_response_id` are a 400)."""
    return await respond(app_state(request).responses, body, request)


@router.post("/tokenize", response_model=None, responses={200: {"model": TokenizeResponse}, **TOKENIZE_ERRORS})
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    app = app_state(request)
    ctx = app.ctx
    ctx.check_model(body.model)
    ctx.require_ready()
    ids: list[int]
    if body.messages is not None:
        ids = await asyncio.to_thread(render_chat, ctx, body.messages, body.add_generation_prompt,
                                      chat_template=app.server.chat_options.chat_template)
    else:
        ids = await asyncio.to_thread(ctx.tokenizer.encode, body.prompt,
                                      add_special_tokens=body.add_special_tokens)
    return json_response(TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids))
