"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

Timing, all client-side, in seconds (the definitions of ``vllm bench serve``):

- TTFT: from sending the request to the first chunk with non-empty text;
- ITL: the gaps between consecutive chunks with non-empty text (a server that packs
  several tokens into one chunk shows one long gap, not several short ones);
- E2E: from sending the request to ``data: [DONE]``;
- TPOT: ``(e2e - ttft) / (output_tokens - 1)`` (see ``RequestRecord.tpot_s``).

Token counts come from the final ``usage`` chunk (``stream_options.include_usage``); a
server that sends none gets its output counted as the number of text chunks.
Failures (HTTP errors, error events, broken or truncated streams, timeouts) are recorded
on the ``RequestRecord``, never raised.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
MAX_ERROR_CHARS = 300
LOOKUP_TIMEOUT_S = 30.0  # GET /v1/models and /metrics, outside the timed requests

# Lifecycle: pending -> running -> ok | failed | cancelled (a background stream stopped
# at the end of the run). A request still running when the run times out becomes failed.
PENDING, RUNNING, OK, FAILED, CANCELLED = "pending", "running", "ok", "failed", "cancelled"


class BenchError(RuntimeError):
    """The run cannot start (e.g. the server lists no model); the message says why."""


@dataclass
class RequestRecord:
    """What happened to one request; filled in while it runs. Times in seconds."""

    request_id: int
    request_class: str
    endpoint: str
    target_input_tokens: int  # the prompt length the dataset aimed for (approximate)
    max_tokens: int
    session_id: int | None = None  # multi-turn only
    turn: int | None = None  # multi-turn only, 0-based
    group: int | None = None  # shared-prefix only
    status: str = PENDING
    error: str | None = None
    send_time_s: float | None = None  # from the start of the run (negative: before it)
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None  # from usage; None if the server sent none
    output_tokens: int = 0  # usage.completion_tokens, else the number of text chunks
    usage_reported: bool = False
    text_chunks: int = 0
    finish_reason: str | None = None  # the last one the stream reported (first choice)
    reply: str = field(default="", repr=False)  # the received text (multi-turn history)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None unless ok with >= 2 tokens."""
        if self.status != OK or self.ttft_s is None or self.e2e_s is None:
            return None
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def fail(self, message: str) -> None:
        self.status = FAILED
        self.error = message[:MAX_ERROR_CHARS]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the reply text is left out; its length is kept)."""
        out = {k: v for k, v in self.__dict__.items() if k != "reply"}
        out["tpot_s"] = self.tpot_s
        out["reply_chars"] = len(self.reply)
        return out


def request_payload(model: str, max_tokens: int, *, prompt: str | None = None,
                    messages: list[dict[str, str]] | None = None, ignore_eos: bool = True,
                    temperature: float = 0.0,
                    extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON body of a streaming completions (``prompt``) or chat (``messages``) request.

    With ``ignore_eos`` the vLLM-compatible extras ``ignore_eos`` and ``min_tokens`` fix
    the output at ``max_tokens`` tokens. ``extra_body`` is merged last (it wins).
    """
    if (prompt is None) == (messages is None):
        raise ValueError("exactly one of prompt and messages must be given")
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens,
                            "temperature": temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if prompt is not None:
        body["prompt"] = prompt
    else:
        body["messages"] = messages
    if ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = max_tokens
    body.update(extra_body or {})
    return body


async def stream_request(http: httpx.AsyncClient, url: str, body: dict[str, Any],
                         record: RequestRecord, *, origin: float = 0.0,
                         timeout_s: float | None = None,
                         clock: Callable[[], float] = time.perf_counter,
                         on_first_text: Callable[[], None] | None = None) -> None:
    """POST ``body`` to ``url`` and fill ``record`` from the SSE stream.

    ``origin`` is the run's start on ``clock`` (for ``send_time_s``); ``timeout_s``
    bounds the whole request; ``on_first_text`` is called once, at the first text chunk.
    Returns when the stream ends or fails; only ``asyncio.CancelledError`` propagates
    (the record is then left ``running`` with what it had received).
    """
    start = clock()
    record.send_time_s = start - origin
    record.status = RUNNING
    try:
        await asyncio.wait_for(
            _read_stream(http, url, body, record, start, clock, on_first_text), timeout_s)
    except asyncio.TimeoutError:
        record.fail(f"request timeout after {timeout_s} s")
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as e:
        record.fail(f"{type(e).__name__}: {e}".rstrip(": "))


async def _read_stream(http: httpx.AsyncClient, url: str, body: dict[str, Any],
                       record: RequestRecord, start: float, clock: Callable[[], float],
                       on_first_text: Callable[[], None] | None) -> None:
    last_text_at: float | None = None
    done_at: float | None = None  # when "data: [DONE]" arrived
    parts: list[str] = []
    async with http.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raw = await response.aread()
            record.fail(f"HTTP {response.status_code}: {error_message(raw)}")
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, ": keep-alive" comments, "event:" lines
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done_at = clock()
                break
            event = json.loads(data)
            if event.get("error"):
                record.fail(f"error event: {error_message(data.encode())}")
                return
            usage = event.get("usage")
            if usage:
                record.usage_reported = True
                record.prompt_tokens = usage.get("prompt_tokens")
                record.output_tokens = int(usage.get("completion_tokens") or 0)
            reason = chunk_finish_reason(event)
            if reason:
                record.finish_reason = reason
            text = chunk_text(event)
            if text or chunk_reasoning(event):  # a reasoning token is output too
                now = clock()
                if last_text_at is None:
                    record.ttft_s = now - start
                    if on_first_text is not None:
                        on_first_text()
                else:
                    record.itl_s.append(now - last_text_at)
                last_text_at = now
                parts.append(text)
                record.text_chunks += 1
                if not record.usage_reported:
                    record.output_tokens = record.text_chunks
    record.reply = "".join(parts)
    if done_at is None:
        record.fail("stream ended without 'data: [DONE]'")
    elif record.ttft_s is None:
        record.fail("no output text received")
    else:
        record.e2e_s = done_at - start
        record.status = OK


def chunk_text(event: dict[str, Any]) -> str:
    """The text of one streamed completions or chat chunk ("" for role/usage chunks)."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:  # /v1/completions
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""  # /v1/chat/completions


def chunk_finish_reason(event: dict[str, Any]) -> str | None:
    """The ``finish_reason`` of one streamed chunk's first choice (None while it runs)."""
    choices = event.get("choices") or []
    reason = choices[0].get("finish_reason") if choices else None
    return str(reason) if reason else None


def chunk_reasoning(event: dict[str, Any]) -> str:
    """The reasoning text of a chat chunk (vLLM's ``reasoning_content``/``reasoning``):
    timed like content, but not part of the reply sent back in a multi-turn history."""
    choices = event.get("choices") or []
    delta = (choices[0].get("delta") or {}) if choices else {}
    return delta.get("reasoning_content") or delta.get("reasoning") or ""


def error_message(raw: bytes) -> str:
    """The ``error.message`` of an OpenAI error body, else the body's start."""
    text = raw.decode("utf-8", errors="replace")
    try:
        err = json.loads(text)
        err = err.get("error", err) if isinstance(err, dict) else err
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:MAX_ERROR_CHARS]
        if isinstance(err, str):
            return err[:MAX_ERROR_CHARS]
    except ValueError:
        pass
    return text.strip()[:MAX_ERROR_CHARS] or "(empty body)"


async def first_model_id(http: httpx.AsyncClient, base_url: str) -> str:
    """The first model id of ``GET <base_url>/v1/models``; raises ``BenchError``."""
    url = base_url + "/v1/models"
    try:
        response = await http.get(url, timeout=LOOKUP_TIMEOUT_S)
    except httpx.HTTPError as e:
        raise BenchError(f"cannot list models at {url}: {type(e).__name__}: {e}") from e
    if response.status_code != 200:
        raise BenchError(f"cannot list models at {url}: HTTP {response.status_code}: "
                         f"{error_message(response.content)}")
    try:
        models = response.json()["data"]
        return str(models[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise BenchError(f"{url} returned no model id (pass --model): "
                         f"{response.text[:MAX_ERROR_CHARS]}") from e
