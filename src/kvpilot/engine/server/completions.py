"""``POST /v1/completions``: prompts (text, token ids, or batches of either)."""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from kvpilot.engine.errors import InvalidRequestError
from kvpilot.engine.lora.request import LoRARequest
from kvpilot.engine.outputs import TokenLogprob
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    Usage,
)
from kvpilot.engine.server.responses import sse_event
from kvpilot.engine.server.serving import (
    Choice,
    Delta,
    ServingContext,
    new_request_id,
    started,
    usage,
)
from kvpilot.engine.server.structured import structured_outputs_of


def parse_prompts(ctx: ServingContext, req: CompletionRequest) -> list[list[int]]:
    """Token ids per prompt. Raises InvalidRequestError for empty input, and for text
    too long to fit the context before any of it is tokenized."""
    p = req.prompt
    if isinstance(p, str):
        texts_or_ids: list[Any] = [p]
    elif not p:
        raise InvalidRequestError("prompt must not be an empty list", "prompt")
    elif all(isinstance(x, int) for x in p):
        texts_or_ids = [p]
    else:
        texts_or_ids = list(p)
    for item in texts_or_ids:
        if isinstance(item, str):
            ctx.check_prompt_size(len(item), "prompt")
    prompts = []
    for item in texts_or_ids:
        ids = ctx.tokenizer.encode(item) if isinstance(item, str) else list(item)
        if not ids:
            raise InvalidRequestError("the prompt is empty: at least one token is required", "prompt")
        prompts.append(ids)
    if len(prompts) * req.n > 256:
        raise InvalidRequestError(f"{len(prompts)} prompts x n={req.n} is more than 256 choices", "prompt")
    return prompts


def logprobs_block(ctx: ServingContext, lps: list[TokenLogprob], text_offset: int,
                   decoder: codecs.IncrementalDecoder | None = None) -> tuple[CompletionLogprobs, int]:
    """OpenAI's completions ``logprobs``. ``text_offset`` is the character where each token
    starts in the text: tokens are fed as bytes through a UTF-8 decoder, so a token that
    is part of a character starts where that character does. Pass the same ``decoder``
    for the chunks of one stream (it holds a character split across chunks). Returns the
    block and the offset after its last token (where the next chunk's tokens start)."""
    decoder = decoder or codecs.getincrementaldecoder("utf-8")("replace")
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = text_offset
    for lp in lps:
        tokens.append(ctx.token_label(lp.token_id))
        token_lps.append(lp.logprob)
        tops.append({ctx.token_label(t): v for t, v in lp.top})
        offsets.append(pos)
        pos += len(decoder.decode(ctx.token_bytes(lp.token_id)))
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops, text_offset=offsets), pos


class CompletionHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def prepare(self, req: CompletionRequest) -> tuple[list[list[int]], int, LoRARequest | None]:
        """Validate ``req``: ``(token ids per prompt, max_tokens, the LoRA adapter it names or
        None)``. Raises InvalidRequestError (400), ModelNotFound (404)."""
        lora = self.ctx.check_model(req.model)
        if req.best_of not in (None, req.n):
            raise InvalidRequestError("best_of is not supported (use n)", "best_of")
        if req.suffix:
            raise InvalidRequestError("suffix is not supported", "suffix")
        req.check_prompt_logprobs()
        if req.echo and req.logprobs is not None:
            raise InvalidRequestError("echo with logprobs (prompt logprobs) is not supported", "echo")
        # Tokenizing a 15 MB prompt takes seconds: in a worker thread, so /health and the
        # streams of everyone else keep being served meanwhile.
        prompts = await asyncio.to_thread(parse_prompts, self.ctx, req)
        if req.max_tokens == 0 and not req.echo:
            raise InvalidRequestError("max_tokens must be >= 1 (max_tokens=0 is only allowed with echo=true)", "max_tokens")
        max_tokens = [self.ctx.resolve_max_tokens(len(ids), req.max_tokens or None) for ids in prompts]
        return prompts, min(max_tokens), lora

    async def constraint(self, req: CompletionRequest) -> tuple[Any, Any]:
        """The request's structured-output constraint and its grammar, compiled in a
        worker thread (``(None, None)`` without one). Raises InvalidRequestError."""
        so = structured_outputs_of(req)
        if so is None:
            return None, None
        if req.max_tokens == 0:
            raise InvalidRequestError("max_tokens=0 (echo only) generates nothing to constrain", "max_tokens")
        return so, await asyncio.to_thread(self.ctx.llm.compile_grammar, so)

    def sampling_params(self, req: CompletionRequest, max_tokens: int, so: Any) -> SamplingParams:
        params = req.to_sampling_params(max_tokens, req.logprobs)
        return dataclasses.replace(params, structured_outputs=so) if so is not None else params

    async def create(self, req: CompletionRequest, header_id: str | None) -> CompletionResponse | AsyncIterator[str]:
        """The one entry of ``POST /v1/completions``: the whole body, or with ``stream``
        the SSE events (validation errors raise before the stream starts)."""
        if req.stream:
            return await self.stream(req, header_id)
        return await self.complete(req, header_id)

    async def render(self, req: CompletionRequest) -> list[tuple[list[int], SamplingParams | None]]:
        """The entry of ``POST /v1/completions/render``: per prompt, its token ids and the
        sampling parameters :meth:`create` would run it with (None for an echo-only
        request, ``max_tokens: 0``: nothing would be sampled); nothing is generated.
        Refuses what :meth:`create` refuses."""
        self.ctx.check_model(req.model)
        self.ctx.require_ready()
        prompts, max_tokens, _ = await self.prepare(req)
        if req.max_tokens == 0:  # echo only: the real endpoint generates nothing
            if req.stream:
                raise InvalidRequestError("max_tokens=0 with echo is not supported when streaming", "max_tokens")
            return [(ids, None) for ids in prompts]
        so, _ = await self.constraint(req)
        params = self.sampling_params(req, max_tokens, so)
        for ids in prompts:
            self.ctx.llm.check_request(ids, params)
        return [(ids, params) for ids in prompts]

    def _echo_only(self, req: CompletionRequest, prompts: list[list[int]], public_id: str,
                   model: str) -> CompletionResponse:
        """``echo`` with ``max_tokens=0``: the prompt back, nothing generated."""
        choices = []
        for p_idx, ids in enumerate(prompts):
            text = self.ctx.tokenizer.decode(ids)
            for k in range(req.n):
                choices.append(CompletionChoice(index=p_idx * req.n + k, text=text, logprobs=None, finish_reason="length"))
        n_prompt = sum(len(ids) for ids in prompts)
        return CompletionResponse(
            id=public_id, object="text_completion", created=int(time.time()), model=model,
            choices=choices, usage=Usage(prompt_tokens=n_prompt, completion_tokens=0, total_tokens=n_prompt))

    async def complete(self, req: CompletionRequest, header_id: str | None) -> CompletionResponse:
        prompts, max_tokens, lora = await self.prepare(req)
        so, grammar = await self.constraint(req)
        public_id, internal_id = new_request_id("cmpl", header_id)
        if req.max_tokens == 0:
            return self._echo_only(req, prompts, public_id, self.ctx.model_name(lora))
        params = self.sampling_params(req, max_tokens, so)
        done: dict[int, Choice] = {}
        async for delta in self.ctx.generate(internal_id, prompts, params, req.cache_salt, grammar=grammar,
                                             lora=lora):
            if delta.finished:
                done[delta.choice.index] = delta.choice
        choices = []
        for idx in sorted(done):
            c = done[idx]
            prefix = self.ctx.tokenizer.decode(prompts[c.prompt_index]) if req.echo else ""
            choice = CompletionChoice(
                index=idx,
                text=prefix + c.text,
                logprobs=logprobs_block(self.ctx, c.logprobs, len(prefix))[0] if req.logprobs is not None else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            if req.prompt_logprobs is not None:
                choice.prompt_logprobs = self.ctx.prompt_logprobs_block(prompts[c.prompt_index], c.prompt_logprobs or [])
            choices.append(choice)
        return CompletionResponse(
            id=public_id, object="text_completion", created=int(time.time()), model=self.ctx.model_name(lora),
            choices=choices, usage=usage([len(p) for p in prompts], list(done.values()), req.n))

    async def stream(self, req: CompletionRequest, header_id: str | None) -> AsyncIterator[str]:
        """Validate first (errors raise before the stream starts), then return the SSE
        event iterator."""
        prompts, max_tokens, lora = await self.prepare(req)
        if req.max_tokens == 0:
            raise InvalidRequestError("max_tokens=0 with echo is not supported when streaming", "max_tokens")
        so, grammar = await self.constraint(req)
        public_id, internal_id = new_request_id("cmpl", header_id)
        params = self.sampling_params(req, max_tokens, so)
        deltas = await started(self.ctx.generate(internal_id, prompts, params, req.cache_salt, grammar=grammar,
                                                 lora=lora))
        return self._events(req, prompts, public_id, deltas, self.ctx.model_name(lora))

    async def _events(
        self, req: CompletionRequest, prompts: list[list[int]], public_id: str, deltas: AsyncGenerator[Delta, None],
        model: str,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        echoed: set[int] = set()
        # per choice: the logprobs' next text offset and the UTF-8 decoder of its tokens
        offsets: dict[int, tuple[int, codecs.IncrementalDecoder]] = {}
        finished: list[Choice] = []
        try:
            async for d in deltas:
                c = d.choice
                text = d.text
                start = 0
                if req.echo and c.index not in echoed:
                    echoed.add(c.index)
                    prompt_text = self.ctx.tokenizer.decode(prompts[c.prompt_index])
                    text, start = prompt_text + text, len(prompt_text)
                if not text and not d.logprobs and not d.finished:
                    continue
                lp = None
                if req.logprobs is not None and d.logprobs:
                    pos, decoder = offsets.get(c.index) or (
                        start, codecs.getincrementaldecoder("utf-8")("replace"))
                    lp, pos = logprobs_block(self.ctx, d.logprobs, pos, decoder)
                    offsets[c.index] = (pos, decoder)
                choice = CompletionChoice(index=c.index, text=text, logprobs=lp,
                                          finish_reason=c.finish_reason if d.finished else None)
                if d.finished:
                    choice.stop_reason = c.stop_reason
                    finished.append(c)
                yield sse_event(CompletionStreamResponse(
                    id=public_id, object="text_completion", created=created, model=model, choices=[choice]))
            if req.stream_options and req.stream_options.include_usage:
                yield sse_event(CompletionStreamResponse(
                    id=public_id, object="text_completion", created=created, model=model, choices=[],
                    usage=usage([len(p) for p in prompts], finished, req.n)))
            yield "data: [DONE]\n\n"
        finally:
            await deltas.aclose()
