"""Every request field the server accepts is listed in docs/server.md (everything else is
refused by name, so the list is the contract)."""

from __future__ import annotations

from pathlib import Path

from kvpilot.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    ResponsesFunctionCallItem,
    ResponsesFunctionCallOutputItem,
    ResponsesFunctionTool,
    ResponsesMessageItem,
    ResponsesReasoningItem,
    ResponsesRequest,
    ResponsesTextFormatJsonSchema,
    StructuredOutputsRequest,
    UnloadLoRAAdapterRequest,
)

DOCS = (Path(__file__).parents[3] / "docs/server.md").read_text()


def test_every_accepted_field_is_in_the_docs():
    for model in (CompletionRequest, ChatCompletionRequest, StructuredOutputsRequest, LoadLoRAAdapterRequest,
                  UnloadLoRAAdapterRequest, ResponsesRequest, ResponsesMessageItem, ResponsesFunctionCallItem,
                  ResponsesFunctionCallOutputItem, ResponsesReasoningItem, ResponsesFunctionTool,
                  ResponsesTextFormatJsonSchema):
        for name, field in model.model_fields.items():
            public = field.alias or name
            assert f"`{public}`" in DOCS, f"{model.__name__}.{public} is accepted but not listed in docs/server.md"
