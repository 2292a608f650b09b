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

import json
import re
import secrets
import string
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

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


@dataclass(frozen=True)
class ToolCall:
    """One function call: ``arguments`` is a JSON object serialized as text."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The call as an OpenAI ``message.tool_calls`` entry (a new dict)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


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


# --- the formats ---------------------------------------------------------------------


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


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name`` (a new instance). Raises ValueError naming the
    bad value and the allowed names."""
    try:
        cls = TOOL_PARSERS[name]
    except KeyError:
        allowed = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool call parser {name!r}; expected one of: {allowed}") from None
    return cls()
