"""``POST /v1/chat/completions``: messages through the model's chat template."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from kvpilot.engine.outputs import TokenLogprob
from kvpilot.engine.sampling_params import InvalidRequestError
from kvpilot.engine.server.protocol import ChatCompletionRequest, ChatMessage
from kvpilot.engine.server.serving import (
    Choice,
    Delta,
    ServingContext,
    new_request_id,
    started,
    usage,
)


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them; text parts are joined. Raises
    InvalidRequestError for non-text content."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(
                        f"messages[{i}].content: only text parts are supported, got type {part.type!r}", "messages"
                    )
                parts.append(part.text)
            content = "".join(parts)
        d = m.model_dump(exclude_none=True)
        d["content"] = content if content is not None else ""
        out.append(d)
    return out


def render_chat(ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of the conversation rendered with the tokenizer's chat template. Raises
    InvalidRequestError when the messages' text alone cannot fit the context (checked
    before rendering and tokenizing) or the template refuses them."""
    tok = ctx.tokenizer
    dicts = message_dicts(messages)
    ctx.check_prompt_size(sum(len(d["content"]) for d in dicts), "messages")
    if not getattr(tok, "chat_template", None):
        raise InvalidRequestError("this model has no chat template; use /v1/completions", "messages")
    try:
        text = tok.apply_chat_template(
            dicts,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            tools=tools,
            **(template_kwargs or {}),
        )
    except InvalidRequestError:
        raise
    except Exception as e:  # template errors (jinja raise_exception, bad roles) are the client's
        raise InvalidRequestError(f"the chat template rejected the messages: {e}", "messages") from e
    return tok.encode(text, add_special_tokens=False)


def chat_logprobs(ctx: ServingContext, lps: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": ctx.token_label(token_id), "logprob": logprob,
                "bytes": list(ctx.token_bytes(token_id))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}


class ChatHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def prepare(self, req: ChatCompletionRequest) -> tuple[list[int], int, int | None]:
        self.ctx.check_model(req.model)
        if req.logit_bias:
            raise InvalidRequestError("logit_bias is not supported", "logit_bias")
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs=true", "top_logprobs")
        # The template and the tokenizer run in a worker thread (seconds for huge inputs).
        ids = await asyncio.to_thread(render_chat, self.ctx, req.messages, req.add_generation_prompt,
                                      req.continue_final_message, req.chat_template_kwargs, req.tools)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.ctx.resolve_max_tokens(len(ids), req.max_completion_tokens or req.max_tokens, param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return ids, max_tokens, logprobs

    def _base(self, public_id: str, created: int, obj: str) -> dict[str, Any]:
        return {"id": public_id, "object": obj, "created": created, "model": self.ctx.served_model_name}

    async def complete(self, req: ChatCompletionRequest, header_id: str | None) -> dict[str, Any]:
        ids, max_tokens, logprobs = await self.prepare(req)
        public_id, internal_id = new_request_id("chatcmpl", header_id)
        params = req.to_sampling_params(max_tokens, logprobs)
        done: dict[int, Choice] = {}
        async for delta in self.ctx.generate(internal_id, [ids], params, req.cache_salt):
            if delta.finished:
                done[delta.choice.index] = delta.choice
        body = self._base(public_id, int(time.time()), "chat.completion")
        body["choices"] = [
            {
                "index": i,
                "message": {"role": "assistant", "content": done[i].text},
                "logprobs": chat_logprobs(self.ctx, done[i].logprobs) if req.logprobs else None,
                "finish_reason": done[i].finish_reason,
                "stop_reason": done[i].stop_reason,
            }
            for i in sorted(done)
        ]
        body["usage"] = usage([len(ids)], list(done.values()), req.n)
        return body

    async def stream(self, req: ChatCompletionRequest, header_id: str | None) -> AsyncIterator[str]:
        ids, max_tokens, logprobs = await self.prepare(req)
        public_id, internal_id = new_request_id("chatcmpl", header_id)
        params = req.to_sampling_params(max_tokens, logprobs)
        deltas = await started(self.ctx.generate(internal_id, [ids], params, req.cache_salt))
        return self._events(req, ids, public_id, deltas)

    async def _events(
        self, req: ChatCompletionRequest, ids: list[int], public_id: str, deltas: AsyncIterator[Delta]
    ) -> AsyncIterator[str]:
        created = int(time.time())
        opened: set[int] = set()
        finished: list[Choice] = []

        def chunk(index: int, delta: dict[str, Any], finish: str | None = None, lp: Any = None, extra: dict | None = None) -> str:
            body = self._base(public_id, created, "chat.completion.chunk")
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            if extra:
                choice.update(extra)
            body["choices"] = [choice]
            return f"data: {json.dumps(body)}\n\n"

        try:
            async for d in deltas:
                c = d.choice
                if c.index not in opened:
                    opened.add(c.index)
                    yield chunk(c.index, {"role": "assistant", "content": ""})
                lp = chat_logprobs(self.ctx, d.logprobs) if (req.logprobs and d.logprobs) else None
                if d.text or lp:
                    yield chunk(c.index, {"content": d.text}, lp=lp)
                if d.finished:
                    finished.append(c)
                    yield chunk(c.index, {}, c.finish_reason, extra={"stop_reason": c.stop_reason})
            if req.stream_options and req.stream_options.include_usage:
                body = self._base(public_id, created, "chat.completion.chunk")
                body["choices"] = []
                body["usage"] = usage([len(ids)], finished, req.n)
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await deltas.aclose()
