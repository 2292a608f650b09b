"""The ``llama3_json`` tool-call format: the whole output is JSON call objects (Llama
3.1/3.2/4 JSON tool calling)."""

from __future__ import annotations

from kvpilot.engine.server.tool_parsers.base import (
    TOOL_PARSERS,
    ToolParser,
    _call_from_json,
    _Event,
    _json_end,
    _ScanState,
    _skip_ws,
)

__all__ = ["Llama3JsonToolParser"]


@TOOL_PARSERS.register("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """The whole output as JSON call objects, after vLLM's ``llama3_json`` parser:
    optional ``<|python_tag|>``, then ``{"name": ..., "parameters": {...}}`` (or
    ``"arguments"``), more objects after ``;`` (a trailing ``;`` is allowed). Anything
    else (text before the JSON, a JSON answer that is not a call, trailing text) makes
    the output content. Differs from vLLM in accepting whitespace before the JSON and
    arguments nested at any depth (vLLM's regex stops at two levels)."""

    name = "llama3_json"
    tag = "<|python_tag|>"

    def _scan(self, text: str, state: _ScanState, final: bool) -> tuple[list[_Event], int]:
        if state.failed:
            return [text], len(text)
        events: list[_Event] = []
        pos = 0  # start of the text not consumed (a call is consumed at its ";")
        while True:
            first = state.calls == 0
            p = _skip_ws(text, pos)
            if first and text.startswith(self.tag, p):
                p = _skip_ws(text, p + len(self.tag))
                tagged = True
            elif first and not final and p < len(text) and self.tag.startswith(text[p:]):
                return events, pos
            else:
                tagged = False
            if p == len(text):
                if not final:
                    return events, pos
                if first and tagged:
                    break  # a tag and nothing after it
                events.append(text[pos:])  # whitespace: nothing, or after a trailing ";"
                return events, len(text)
            if text[p] != "{":
                break
            end = _json_end(text, p)
            if end is None:
                if final:
                    break
                return events, pos
            call = _call_from_json(text[p:end])
            if call is None:
                break
            q = _skip_ws(text, end)
            if q == len(text):
                if not final:
                    return events, pos  # a ";" or more text may follow
                events.append(call)
                state.calls += 1
                return events, len(text)
            if text[q] != ";":
                break
            events.append(call)
            state.calls += 1
            pos = q + 1
        state.failed = True
        events.append(text[pos:])
        return events, len(text)
