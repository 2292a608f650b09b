"""Tool calls out of generated text: the ``--tool-call-parser`` formats, whole and streamed.

A parser turns a model's raw output into OpenAI ``tool_calls`` plus the remaining text
(``content``). The formats, each named and behaving like the vLLM parser of that name
(``vllm/entrypoints/openai/tool_parsers``):

``hermes`` (Hermes 2 Pro, Qwen 2.5/3; vLLM's ``Hermes2ProToolParser``)::

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

  Any number of blocks; the last one may lack ``</tool_call>`` at the end of the output.

``llama3_json`` (Llama 3.1/3.2/4 JSON tool calling; vLLM's ``Llama3JsonToolParser``)::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

  The whole output is the call(s): ``<|python_tag|>`` is optional, objects are separated
  by ``;``, ``"arguments"`` is accepted for ``"parameters"``.

``mistral`` (Mistral 7B v0.3, Mistral Nemo/Small; vLLM's ``MistralToolParser``)::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather{"city": "Paris"}             (v11 tokenizer)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}       (v13 tokenizer)

  ``[TOOL_CALLS]`` is a special token: the detokenizer must keep special tokens for the
  parser to see it.

Common rules: ``arguments`` come out as the JSON object re-serialized with
``json.dumps(obj, ensure_ascii=False)`` (arguments given as a JSON string holding an
object are decoded first; missing or null arguments are ``{}``); a call whose ``name``
is not a non-empty string, whose arguments are not an object, or whose JSON does not
parse makes the whole output plain content (all or nothing, as vLLM does). ``content``
is the text outside the calls, stripped, and None when empty.

Streaming (``ToolParser.streamer``) reports OpenAI chat-completion ``delta`` dicts: plain
text as ``{"content": ...}``, a call as a header (``id``, ``type``, ``name``, empty
``arguments``) followed by its arguments, sent when the call is complete. Text that could
still become a tool-call marker is held back until it is known not to be one. The deltas
reassemble into exactly what ``extract`` returns for the same text, except when a
well-formed call has been sent and a later call turns out malformed: the sent call cannot
be taken back, so the malformed text follows as content, where ``extract`` would have
returned everything as content.
"""

from __future__ import annotations

from kvpilot.engine.server.tool_parsers.base import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    ToolCall,
    ToolCallStreamer,
    ToolParser,
    get_tool_parser,
    new_tool_call_id,
)

# Each format module registers its parser in TOOL_PARSERS when imported, in this order
# (the order the error for an unknown name lists them in).
from kvpilot.engine.server.tool_parsers.hermes import HermesToolParser
from kvpilot.engine.server.tool_parsers.llama3_json import Llama3JsonToolParser
from kvpilot.engine.server.tool_parsers.mistral import MistralToolParser

__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ToolCall",
    "ToolCallStreamer",
    "ToolParser",
    "get_tool_parser",
    "new_tool_call_id",
]
