"""What every tool-call format shares: the call and result types, tool-call ids, the
JSON scanning helpers, the ``ToolParser`` interface, the streaming state
(``ToolCallStreamer``) and the registry of formats (``TOOL_PARSERS``); the package
docstring (:mod:`kvpilot.engine.server.tool_parsers`) describes the formats and the rules.

A format is a ``ToolParser`` subclass in a module of its own, registered by name with
``@TOOL_PARSERS.register(name)`` (the package imports every format module).
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from kvpilot.engine.registry import Registry
from kvpilot.engine.server.protocol import FunctionCall, ToolCallOut

__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "ToolCall",
    "ToolCallStreamer",
    "ToolParser",
    "get_tool_parser",
    "new_tool_call_id",
]


@dataclass(frozen=True)
class ToolCall:
    """One function call: ``arguments`` is a JSON object serialized as text."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> ToolCallOut:
        """The call as an OpenAI ``message.tool_calls`` entry."""
        return ToolCallOut(id=self.id, type="function", function=FunctionCall(name=self.name, arguments=self.arguments))


@dataclass
class ExtractedToolCalls:
    """The result of parsing a whole output: the text outside the calls (stripped; None
    when empty) and the calls in the order they appear."""

    content: str | None
    tool_calls: list[ToolCall]


_ALPHANUMERIC = string.ascii_letters + string.digits


def new_tool_call_id(parser_name: str) -> str:
    """A fresh tool-call id: ``chatcmpl-tool-<32 hex>`` like vLLM's ``make_tool_call_id``,
    or for ``mistral`` 9 random alphanumerics (Mistral's chat template and
    ``mistral_common`` reject any other form, as vLLM's ``MistralToolCall`` notes)."""
    if parser_name == "mistral":
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


# --- shared pieces -------------------------------------------------------------------

# A scan produces events in text order: a str is content, a (name, arguments) pair a call.
_Event = str | tuple[str, str]

# A JSON string (complete), a bracket, or a lone quote (a string not yet closed).
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]|"', re.DOTALL)
_WS = re.compile(r"\s*")


def _json_end(text: str, start: int) -> int | None:
    """The end of the bracketed JSON value opening at ``text[start]`` (``{`` or ``[``),
    found by matching brackets outside strings; None when the text ends first. The
    value is not validated (``json.loads`` does that)."""
    depth = 0
    for m in _JSON_TOKEN.finditer(text, start):
        token = m.group()
        if token == '"':
            return None
        if token[0] == '"':
            continue
        depth += 1 if token in "[{" else -1
        if depth == 0:
            return m.end()
    return None


def _skip_ws(text: str, pos: int) -> int:
    m = _WS.match(text, pos)
    assert m is not None  # \s* always matches
    return m.end()


def _held_suffix(text: str, marker: str, lo: int = 0) -> int:
    """How many characters at the end of ``text`` (none before ``lo``) are a proper
    prefix of ``marker``: the text that must wait for the next delta."""
    for k in range(min(len(marker) - 1, len(text) - lo), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _normalize_arguments(value: Any) -> str | None:
    """Arguments as compact-normalized JSON object text; None when they are not an
    object (nor a JSON string holding one). Missing/null/empty-string arguments are
    ``{}``, unlike vLLM, which fails on missing arguments and keeps strings quoted."""
    if value is None:
        value = {}
    elif isinstance(value, str):
        if not value.strip():
            value = {}
        else:
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
                return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def _call_from_object(obj: Any) -> tuple[str, str] | None:
    """``{"name": str, "arguments"|"parameters": {...}}`` -> (name, arguments), or None
    when the object is not a call."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments = _normalize_arguments(
        obj["arguments"] if "arguments" in obj else obj.get("parameters")
    )
    if arguments is None:
        return None
    return name, arguments


def _call_from_json(text: str) -> tuple[str, str] | None:
    """A call from JSON text (whitespace around it allowed); None when it does not parse
    or is not a call."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return _call_from_object(obj)


@dataclass
class _ScanState:
    """What a parser remembers between scans of one output (its ``_scan`` mutates it):
    ``failed`` once a malformed call turned the rest into content; ``calls`` consumed so
    far (llama3_json: only the first object may follow ``<|python_tag|>``)."""

    failed: bool = False
    calls: int = 0


class _Trimmer:
    """Streams a sequence of content pieces as their concatenation stripped: leading
    whitespace is dropped, trailing whitespace waits for more text (and is dropped by
    ``finish``)."""

    def __init__(self) -> None:
        self._started = False
        self._pending = ""

    def push(self, text: str) -> str:
        """The text to send now for ``text``; updates what is held."""
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        body = text.rstrip()
        if not body:
            self._pending += text
            return ""
        out = self._pending + body
        self._pending = text[len(body) :]
        return out


# --- the parser interface ------------------------------------------------------------


class ToolParser(ABC):
    """A tool-call format. Stateless: ``extract`` parses whole outputs and ``streamer``
    makes the per-choice state for streaming.

    Subclasses implement ``_scan``: turn ``text`` (the part of the output not yet
    consumed) into events, returning them and how many characters they consumed; with
    ``final`` False it stops before anything that later text could change (a partial
    marker, an unfinished call), with ``final`` True it consumes everything. It may set
    ``state.failed``; scanning a text in pieces must give the events of scanning it whole.
    """

    name: ClassVar[str]

    @abstractmethod
    def _scan(self, text: str, state: _ScanState, final: bool) -> tuple[list[_Event], int]: ...

    def _failed_content(self, text: str) -> str:
        """The content of a whole output whose calls are malformed (here: the output)."""
        return text

    def extract(self, text: str) -> ExtractedToolCalls:
        """Parse a whole output. Never raises: malformed calls make the whole output
        content (stripped). Each call gets a fresh id (``new_tool_call_id``)."""
        state = _ScanState()
        events, _ = self._scan(text, state, final=True)
        if state.failed:
            return ExtractedToolCalls(self._failed_content(text).strip() or None, [])
        content = "".join(e for e in events if isinstance(e, str)).strip()
        calls = [
            ToolCall(new_tool_call_id(self.name), e[0], e[1])
            for e in events
            if isinstance(e, tuple)
        ]
        return ExtractedToolCalls(content or None, calls)

    def streamer(self) -> ToolCallStreamer:
        """A new streaming state for one choice."""
        return ToolCallStreamer(self)


class ToolCallStreamer:
    """Streams one choice's output through a parser, as OpenAI chat-completion deltas.

    ``feed(delta_text)`` and then ``finish()`` once at the end; both return the delta
    dicts to send, in order (possibly none): ``{"content": text}``, or for call ``i`` a
    header ``{"tool_calls": [{"index": i, "id", "type": "function", "function":
    {"name", "arguments": ""}}]}`` followed by ``{"tool_calls": [{"index": i,
    "function": {"arguments": text}}]}``. ``tool_calls`` lists the calls sent (for
    ``finish_reason: "tool_calls"``). Content is stripped as ``extract`` strips it.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.tool_calls: list[ToolCall] = []
        self._state = _ScanState()
        self._held = ""
        self._trimmer = _Trimmer()
        self._finished = False

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        """Add generated text; returns the deltas it completes. Mutates the held text and
        ``tool_calls``. Raises RuntimeError after ``finish``."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._held += delta_text
        events, used = self.parser._scan(self._held, self._state, final=False)
        self._held = self._held[used:]
        return self._deltas(events)

    def finish(self) -> list[dict[str, Any]]:
        """End of output: parse what was held (an unterminated call that is complete is
        a call; anything else is content). Raises RuntimeError when called twice."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        events, _ = self.parser._scan(self._held, self._state, final=True)
        self._held = ""
        return self._deltas(events)

    def _deltas(self, events: list[_Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, str):
                text = self._trimmer.push(event)
                if not text:
                    continue
                if out and "content" in out[-1]:
                    out[-1]["content"] += text
                else:
                    out.append({"content": text})
                continue
            name, arguments = event
            call = ToolCall(new_tool_call_id(self.parser.name), name, arguments)
            index = len(self.tool_calls)
            self.tool_calls.append(call)
            out.append(
                {
                    "tool_calls": [
                        {
                            "index": index,
                            "id": call.id,
                            "type": "function",
                            "function": {"name": name, "arguments": ""},
                        }
                    ]
                }
            )
            out.append({"tool_calls": [{"index": index, "function": {"arguments": arguments}}]})
        return out


# --- the registry --------------------------------------------------------------------

TOOL_PARSERS: Registry[type[ToolParser]] = Registry("tool call parser")


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name`` (a new instance). Raises ValueError naming the
    bad value and the allowed names."""
    return TOOL_PARSERS.get(name)()
