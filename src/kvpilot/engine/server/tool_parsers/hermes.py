"""The ``hermes`` tool-call format: ``<tool_call>{...}</tool_call>`` blocks (Hermes 2 Pro,
Qwen 2.5/3)."""

from __future__ import annotations

from kvpilot.engine.server.tool_parsers.base import (
    TOOL_PARSERS,
    ToolParser,
    _call_from_json,
    _Event,
    _held_suffix,
    _ScanState,
)

__all__ = ["HermesToolParser"]


@TOOL_PARSERS.register("hermes")
class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, after vLLM's
    ``hermes`` parser: several blocks allowed; the JSON may have whitespace around it; a
    final block without ``</tool_call>`` is parsed when its JSON is complete; any block
    that is not a call makes the whole output content (markers included). Differs from
    vLLM in keeping text between and after the blocks as content (vLLM's non-streaming
    path keeps only the text before the first block; its streaming path keeps all)."""

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def _scan(self, text: str, state: _ScanState, final: bool) -> tuple[list[_Event], int]:
        if state.failed:
            return [text], len(text)
        events: list[_Event] = []
        pos = 0
        while True:
            start = text.find(self.start, pos)
            if start < 0:
                keep = 0 if final else _held_suffix(text, self.start, pos)
                events.append(text[pos : len(text) - keep])
                return events, len(text) - keep
            events.append(text[pos:start])
            pos = start
            body = start + len(self.start)
            end = text.find(self.end, body)
            if end < 0 and not final:
                return events, pos
            call = _call_from_json(text[body:] if end < 0 else text[body:end])
            if call is None:
                state.failed = True
                events.append(text[pos:])
                return events, len(text)
            events.append(call)
            pos = len(text) if end < 0 else end + len(self.end)
