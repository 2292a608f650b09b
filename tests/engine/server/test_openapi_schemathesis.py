"""The OpenAPI schema says what the server does: schemathesis generates
requests from ``/openapi.json``, valid and invalid ones, and sends them in-process to
the real app over the embedded SmolLM2. Every response must have a declared status,
content type, headers and body; no request may get a 5xx; a request the schema calls
invalid must be refused (4xx); and a body the schema calls valid must pass the request
model's own validation (else the schema promises more than the model accepts).

Schema-valid requests may still get a 400: the context length, the vocabulary and the
unsupported options are checked after validation and described in the schema only in
words, so schemathesis' ``positive_data_acceptance`` check does not apply here.
"""

from __future__ import annotations

import json

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from pydantic import ValidationError  # noqa: E402
from schemathesis.checks import positive_data_acceptance  # noqa: E402
from schemathesis.core import NotSet  # noqa: E402

from kvpilot.engine.config import EngineArgs  # noqa: E402
from kvpilot.engine.llm_engine import LLMEngine  # noqa: E402
from kvpilot.engine.server.api_server import build_app  # noqa: E402
from kvpilot.engine.server.async_engine import AsyncEngine, wait_until  # noqa: E402
from kvpilot.engine.server.metrics import EngineMetrics  # noqa: E402
from kvpilot.engine.server.protocol import (  # noqa: E402
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    ResponsesRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from kvpilot.engine.server.state import ServerState  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "smollm2"
REQUEST_MODELS = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions/render": CompletionRequest,
    "/v1/chat/completions/render": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/responses/render": ResponsesRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/load_lora_adapter": LoadLoRAAdapterRequest,
    "/v1/unload_lora_adapter": UnloadLoRAAdapterRequest,
}

# Built at import: schemathesis reads the schema when the test is collected (its
# fixture-based loader does not work with pytest 9). The engine starts in the fixture
# below, on the session's SmolLM2 weights, small enough that every request is short.
_weights: dict = {}
ENGINE = AsyncEngine(lambda: LLMEngine(
    EngineArgs(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=8,
               max_num_batched_tokens=64, kv_cache_memory=0.05),
    loaded=_weights["model"],
))
# vLLM's runtime LoRA routes mounted, so their schema is checked too (the engine runs
# without --enable-lora: a valid body is a 400 naming the flag).
APP = build_app(ServerState(ENGINE, EngineMetrics(MODEL), MODEL, allow_runtime_lora_updating=True))
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.fixture(scope="module", autouse=True)
def running_engine(smollm2):
    _weights["model"] = smollm2
    ENGINE.start()
    try:
        assert wait_until(lambda: ENGINE.is_ready, 120), ENGINE.failure
        yield ENGINE
    finally:
        ENGINE.shutdown()


def valid_bodies_pass_the_request_model(ctx, response, case) -> None:
    """A body generated as valid from the schema is valid for the pydantic model too:
    a 400 for it may come from a later check (the context, the vocabulary), never from
    request validation."""
    model = REQUEST_MODELS.get(case.path)
    if model is None or isinstance(case.body, NotSet):
        return
    if case.meta is None or not case.meta.generation.mode.is_positive:
        return
    try:
        model.model_validate_json(json.dumps(case.body))
    except ValidationError as e:
        raise AssertionError(f"the schema accepts this body but {model.__name__} refuses it: {e}") from None


def bounded(case) -> None:
    """Keep valid generation requests short (and valid): at most 2 choices of 1 token
    (one engine step). Invalid ones are refused before anything runs."""
    body = case.body
    if case.path not in ("/v1/completions", "/v1/chat/completions", "/v1/responses") or not isinstance(body, dict):
        return
    if case.meta is None or not case.meta.generation.mode.is_positive:
        return
    for key, most in (("n", 2), ("max_tokens", 1), ("max_completion_tokens", 1), ("min_tokens", 1),
                      ("max_output_tokens", 1)):
        if isinstance(body.get(key), (int, float)):  # JSON Schema integers include 2.0
            body[key] = min(int(body[key]), most)
    if case.path == "/v1/responses":
        body["max_output_tokens"] = body.get("max_output_tokens") or 1  # not the rest of the context
    elif body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 1  # not the rest of the context


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_server_does_what_its_openapi_schema_says(case):
    bounded(case)
    case.call_and_validate(excluded_checks=[positive_data_acceptance],
                           additional_checks=[valid_bodies_pass_the_request_model], timeout=60)
