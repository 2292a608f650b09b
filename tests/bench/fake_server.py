"""A fake OpenAI-compatible server with known timing, for testing the load generator.

Each streamed request sends (chat: after an immediate empty role chunk) its first text
chunk after ``ttft_s`` and each further one ``itl_s`` later, one token per chunk, exactly
``max_tokens`` of them (the last with ``finish_reason: "length"``), then a usage chunk
and ``data: [DONE]``. It records every request body and the most requests it ever had in
flight, and exposes prefix-cache counters that move by known amounts: per request,
queries += prompt words (or token ids) and hits += a fixed share.

``FakeServer`` runs it with uvicorn in a thread on 127.0.0.1 and a free port.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

MODEL = "fake-model"


@dataclass
class Behaviour:
    """What the fake does; read on every request (tests may change it between runs)."""

    ttft_s: float = 0.0
    itl_s: float = 0.0
    fail_every: int = 0  # request number k (1-based) with k % fail_every == 0 gets HTTP 500
    break_every: int = 0  # ... gets its stream cut after two text chunks
    send_usage: bool = True
    hit_share: float = 0.5  # hits += int(prompt_words * hit_share)
    metrics: str = "kvpilot"  # "kvpilot", "vllm" or "none"


@dataclass
class State:
    """What the fake saw. Written on the server thread, read by tests after a run."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)  # Authorization headers seen
    in_flight: int = 0
    max_in_flight: int = 0
    hits: int = 0
    queries: int = 0
    count: int = 0


def prompt_words(body: dict[str, Any]) -> int:
    if "prompt" in body:  # text, or token ids (benchmarks/vllm_cpu.py)
        prompt = body["prompt"]
        return len(prompt) if isinstance(prompt, list) else len(prompt.split())
    return sum(len(m["content"].split()) for m in body["messages"])


def reply_token(request_no: int, i: int) -> str:
    """The i-th token of request ``request_no``'s reply (unique across requests)."""
    return f" r{request_no}t{i}"


def make_app(server: FakeServer) -> FastAPI:
    """The app reads ``server.behaviour`` and ``server.state`` per request, so ``reset``
    takes effect at once; a stream keeps the state it started with."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(metrics_text(server.behaviour.metrics, server.state))

    async def generate(request: Request, chat: bool) -> Any:
        behaviour, state = server.behaviour, server.state
        body = await request.json()
        state.count += 1
        number = state.count
        state.bodies.append(body)
        state.auth.append(request.headers.get("authorization"))
        if behaviour.fail_every and number % behaviour.fail_every == 0:
            return JSONResponse({"error": {"message": f"injected failure {number}",
                                           "type": "server_error", "param": None,
                                           "code": 500}}, status_code=500)
        words = prompt_words(body)
        state.queries += words
        state.hits += int(words * behaviour.hit_share)
        return StreamingResponse(stream(behaviour, state, body, number, words, chat),
                                 media_type="text/event-stream")

    async def stream(behaviour: Behaviour, state: State, body: dict[str, Any], number: int,
                     words: int, chat: bool):
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            if chat:
                yield sse({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                               "content": ""}}]})
            n = body["max_tokens"]
            for i in range(n):
                await asyncio.sleep(behaviour.ttft_s if i == 0 else behaviour.itl_s)
                if behaviour.break_every and number % behaviour.break_every == 0 and i == 2:
                    raise RuntimeError("injected broken stream")
                token = reply_token(number, i)
                choice: dict[str, Any] = ({"index": 0, "delta": {"content": token}} if chat
                                          else {"index": 0, "text": token})
                if i == n - 1:
                    choice["finish_reason"] = "length"
                yield sse({"choices": [choice]})
            if behaviour.send_usage:
                yield sse({"choices": [], "usage": {"prompt_tokens": words,
                                                    "completion_tokens": n,
                                                    "total_tokens": words + n}})
            yield "data: [DONE]\n\n"
        finally:
            state.in_flight -= 1

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await generate(request, chat=True)

    return app


def sse(event: dict[str, Any]) -> str:
    return f"data: {json.dumps(event)}\n\n"


def metrics_text(flavour: str, state: State) -> str:
    """Counters split over two label sets (the load generator must sum them)."""
    if flavour == "none":
        return "# TYPE other_total counter\nother_total 1.0\n"
    lines = []
    for kind, value in (("hits", state.hits), ("queries", state.queries)):
        name = f"{flavour}:prefix_cache_{kind}_total"
        lines += [f"# HELP {name} prefix cache {kind} in tokens", f"# TYPE {name} counter",
                  f'{name}{{engine="0"}} {value - value // 3}.0',
                  f'{name}{{engine="1"}} {value // 3}.0']
    return "\n".join(lines) + "\n"


class FakeServer:
    """Context manager: the fake on 127.0.0.1:<free port>, stopped on exit."""

    def __init__(self, behaviour: Behaviour | None = None):
        self.behaviour = behaviour or Behaviour()
        self.state = State()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(make_app(self), log_level="critical",
                                lifespan="off", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> FakeServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                self.__exit__()
                raise RuntimeError("fake server did not start within 10 s")
            time.sleep(0.01)
        return self

    def reset(self, behaviour: Behaviour) -> FakeServer:
        """New behaviour and empty state, for the next test (streams still open from an
        earlier test keep writing to their old state)."""
        self.behaviour, self.state = behaviour, State()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
        assert not self._thread.is_alive(), "fake server did not stop within 10 s"
