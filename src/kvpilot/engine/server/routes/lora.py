"""vLLM's runtime LoRA routes: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``, with vLLM's bodies, status codes and messages.

They exist only when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is ``1`` or ``true`` at start-up
(:func:`kvpilot.engine.server.state.runtime_lora_updating`); otherwise both paths are a
404, as in vLLM, which does not mount them either. Loading reads and validates the
adapter folder in a worker thread (``LoRAManager.register``): the event loop, and the
requests running meanwhile, never wait for the disk; a folder that fails leaves every
adapter loaded before, and every request, as it was.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from kvpilot.engine.errors import (
    InvalidRequestError,
    LoRAAdapterExistsError,
    LoRAAdapterNotFoundError,
)
from kvpilot.engine.lora.manager import LoRAManager
from kvpilot.engine.lora.request import LoRARequest
from kvpilot.engine.server.openapi import errors
from kvpilot.engine.server.protocol import (
    LORA_ADAPTER_OK,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from kvpilot.engine.server.serving import ServingContext
from kvpilot.engine.server.state import app_state

logger = logging.getLogger("kvpilot.serve")
router = APIRouter()



def _json_error(description: str) -> dict[str, Any]:
    """An error entry in JSON (the route's own response class is plain text, its 200's)."""
    return {"description": description, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{ErrorResponse.__name__}"}}}}


_BAD = _json_error(
    "a missing or empty `lora_name`/`lora_path`, an adapter already loaded under that name, a folder "
    "that is not a PEFT adapter for this model (`param` names the field), or a server started "
    "without `--enable-lora`")
_MISSING = _json_error("no adapter of that name is loaded (`param`: `lora_name`)")
_OTHER = {status: _json_error(entry["description"]) for status, entry in errors(401, 503).items()}
LOAD_RESPONSES: dict[int | str, dict[str, Any]] = {200: LORA_ADAPTER_OK, 400: _BAD, **_OTHER}
UNLOAD_RESPONSES: dict[int | str, dict[str, Any]] = {200: LORA_ADAPTER_OK, 400: _BAD, 404: _MISSING, **_OTHER}
LORA_OFF = "LoRA adapters are off on this server: start it with --enable-lora"


def lora_manager(ctx: ServingContext) -> LoRAManager:
    """The engine's LoRA manager. Raises EngineDeadError (503) while the model loads,
    InvalidRequestError (400) when the server runs without ``--enable-lora``."""
    ctx.require_ready()
    manager = ctx.lora
    if manager is None:
        raise InvalidRequestError(LORA_OFF)
    return manager


async def register(ctx: ServingContext, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
    """Register the adapter folder ``path`` as ``name`` (read and validated in a worker
    thread); returns its ``LoRARequest``. Mutates the engine's LoRA manager only on success.

    Raises:
        InvalidRequestError: an empty name or path, the served model's own name, or a
            folder the manager refuses (``param`` names the field, ``lora_path`` or the
            adapter config's key).
        LoRAAdapterExistsError: ``name`` is loaded already (vLLM's message).
        EngineDeadError: the model is still loading.
    """
    manager = lora_manager(ctx)
    if not name or not path:
        raise InvalidRequestError("Both 'lora_name' and 'lora_path' must be provided.",
                                  "lora_name" if not name else "lora_path")
    if name == ctx.served_model_name:
        raise InvalidRequestError(f"lora_name: '{name}' is the served model's name; give the adapter "
                                  "another name", "lora_name")
    if manager.get(name) is not None:
        raise LoRAAdapterExistsError.named(name)
    try:
        lora = await asyncio.to_thread(manager.register, name, path, base_model_name)
    except LoRAAdapterExistsError:  # registered meanwhile, by a concurrent load
        raise LoRAAdapterExistsError.named(name) from None
    logger.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)
    return lora


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=LOAD_RESPONSES)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """Load a PEFT adapter folder under `lora_name`; requests then run with it by giving
    that name as `model`. vLLM's route: only served with
    `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`."""
    await register(app_state(request).ctx, body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=UNLOAD_RESPONSES)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """Unload the adapter `lora_name`: requests running with it finish; new ones naming it
    get a 404. vLLM's route: only served with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`."""
    manager = lora_manager(app_state(request).ctx)
    name = body.lora_name
    if not name:
        raise InvalidRequestError("'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
    lora = manager.get(name)
    if lora is None or (body.lora_int_id is not None and body.lora_int_id != lora.lora_int_id):
        raise LoRAAdapterNotFoundError.named(name)
    try:
        manager.unregister(name)
    except LoRAAdapterNotFoundError:  # unloaded meanwhile, by a concurrent unload
        raise LoRAAdapterNotFoundError.named(name) from None
    logger.info("Removed LoRA adapter: name '%s'", name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
