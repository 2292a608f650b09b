"""The ``mistral`` tool-call format: ``[TOOL_CALLS]`` then the calls (Mistral 7B v0.3,
Mistral Nemo/Small)."""

from __future__ import annotations

import json
import re

from kvpilot.engine.server.tool_parsers.base import (
    TOOL_PARSERS,
    ToolParser,
    _call_from_object,
    _Event,
    _held_suffix,
    _json_end,
    _normalize_arguments,
    _ScanState,
    _skip_ws,
)

__all__ = ["MistralToolParser"]


@TOOL_PARSERS.register("mistral")
class MistralToolParser(ToolParser):
    """``[TOOL_CALLS]`` then the calls, after vLLM's ``mistral`` parser: a JSON array of
    ``{"name": ..., "arguments": {...}}`` (a single object is accepted too), or
    ``name{...}`` / ``name[ARGS]{...}``, each call after its own ``[TOOL_CALLS]``. Text
    before the first marker is content; so is text after the calls (vLLM drops it). When
    a call is malformed the content is the output with the ``[TOOL_CALLS]`` markers
    removed, as in vLLM."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    args_marker = "[ARGS]"
    _NAME = re.compile(r"[A-Za-z0-9_.-]+")

    def _failed_content(self, text: str) -> str:
        return text.replace(self.marker, "")

    def _scan(self, text: str, state: _ScanState, final: bool) -> tuple[list[_Event], int]:
        events: list[_Event] = []
        pos = 0
        while True:
            mark = text.find(self.marker, pos)
            if mark < 0:
                keep = 0 if final else _held_suffix(text, self.marker, pos)
                events.append(text[pos : len(text) - keep])
                return events, len(text) - keep
            events.append(text[pos:mark])
            pos = mark + len(self.marker)
            if state.failed:
                continue  # content from here on, markers dropped
            parsed = self._calls_at(text, pos, final)
            if parsed is None:
                return events, mark  # unfinished: wait for more text
            if not parsed:
                state.failed = True
                continue
            calls, pos = parsed
            events.extend(calls)

    def _calls_at(
        self, text: str, p: int, final: bool
    ) -> tuple[list[_Event], int] | tuple[()] | None:
        """The calls after a marker ending at ``p``: (calls, end), ``()`` when malformed,
        None when later text could still complete them."""
        more = () if final else None
        p = _skip_ws(text, p)
        if p == len(text):
            return more
        if text[p] in "[{":
            end = _json_end(text, p)
            if end is None:
                return more
            try:
                value = json.loads(text[p:end])
            except (ValueError, RecursionError):
                return ()
            items = value if isinstance(value, list) else [value]
            calls: list[_Event] = []
            for item in items:
                call = _call_from_object(item)
                if call is None:
                    return ()
                calls.append(call)
            return calls, end
        m = self._NAME.match(text, p)
        if m is None:
            return ()
        q = _skip_ws(text, m.end())
        if q == len(text):
            return more  # the name, or the space before "{", may go on
        if text.startswith(self.args_marker, q):
            q = _skip_ws(text, q + len(self.args_marker))
        elif self.args_marker.startswith(text[q:]):
            return more
        if q == len(text):
            return more
        if text[q] != "{":
            return ()
        end = _json_end(text, q)
        if end is None:
            return more
        try:
            value = json.loads(text[q:end])
        except (ValueError, RecursionError):
            return ()
        arguments = _normalize_arguments(value) if isinstance(value, dict) else None
        if arguments is None:
            return ()
        return [(m.group(), arguments)], end
