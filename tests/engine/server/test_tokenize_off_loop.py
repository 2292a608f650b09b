"""Tokenization and chat-template rendering run in worker threads, not on the server's
event loop: a 15 MB prompt took 10 s to tokenize, and while it did /health (the liveness
probe) and every stream stalled (found in review)."""

from __future__ import annotations

import asyncio
import threading

from kvpilot.engine.server import chat as chat_module
from kvpilot.engine.server.chat import ChatHandler
from kvpilot.engine.server.completions import CompletionHandler
from kvpilot.engine.server.protocol import ChatCompletionRequest, CompletionRequest


class RecordingTokenizer:
    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def encode(self, text, **_):
        self.threads.append(threading.current_thread())
        return [1, 2, 3]


class Context:
    def __init__(self) -> None:
        self.tokenizer = RecordingTokenizer()

    def check_model(self, model) -> None:
        return None

    def check_prompt_size(self, chars, param) -> None:
        return None

    def resolve_max_tokens(self, prompt_len, max_tokens, param="max_tokens", prompt_param=None) -> int:
        return max_tokens or 4


def on_loop(coro_factory):
    async def main():
        await coro_factory()
        return threading.current_thread()
    return asyncio.run(main())


def test_completion_prompts_are_tokenized_off_the_event_loop():
    ctx = Context()
    handler = CompletionHandler(ctx)
    loop_thread = on_loop(lambda: handler.prepare(CompletionRequest(prompt="hi", max_tokens=4)))
    assert ctx.tokenizer.threads and all(t is not loop_thread for t in ctx.tokenizer.threads)


def test_chat_messages_are_rendered_off_the_event_loop(monkeypatch):
    threads = []

    def render(ctx, *args, **kwargs):
        threads.append(threading.current_thread())
        return [1, 2, 3]

    monkeypatch.setattr(chat_module, "render_chat", render)
    handler = ChatHandler(Context())
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    loop_thread = on_loop(lambda: handler.prepare(request))
    assert threads and threads[0] is not loop_thread
