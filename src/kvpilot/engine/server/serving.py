"""What completions and chat completions share: prompt checks, the fan-out of ``n``
choices (and batched prompts) into engine requests, and their merged output stream."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, cast

from kvpilot.engine.errors import (
    EngineDeadError,
    InvalidRequestError,
    LoRAAdapterNotFoundError,
    ModelNotFound,
)
from kvpilot.engine.lora.manager import LoRAManager
from kvpilot.engine.lora.request import LoRARequest
from kvpilot.engine.outputs import RequestOutput, TokenLogprob
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.async_engine import AsyncEngine
from kvpilot.engine.server.protocol import FinishReason, PromptLogprob, PromptTokensDetails, Usage

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character -> byte (the inverse of bytes_to_unicode)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {ch: b for b, ch in bytes_to_unicode().items()}  # type: ignore[no-untyped-call]


@dataclass
class Choice:
    """Accumulated state of one choice (one engine request)."""

    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[Any] | None = None


@dataclass
class Delta:
    """One streamed increment of a choice."""

    choice: Choice
    text: str
    logprobs: list[TokenLogprob] | None
    finished: bool


class ServingContext:
    """The engine plus what the handlers need from it (tokenizer, limits, names).

    Args:
        engine: the running :class:`AsyncEngine`.
        served_model_name: the id clients must use (``model``) for the base model.
        metrics: the server's :class:`EngineMetrics`; fed once per prompt of a request
            when all its ``n`` choices have finished (vLLM's per-request ``n`` metrics).
        enable_lora: the server was started with ``--enable-lora``: other names in
            ``model`` may be LoRA adapters (the engine's ``lora`` manager knows them).
    """

    def __init__(self, engine: AsyncEngine, served_model_name: str, metrics: Any = None,
                 enable_lora: bool = False) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.metrics = metrics
        self.enable_lora = enable_lora

    @property
    def llm(self) -> Any:
        assert self.engine.engine is not None
        return self.engine.engine

    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        limit: int = self.llm.max_model_len
        return limit

    @property
    def max_chars_per_token(self) -> int:
        """The most characters one token of this vocabulary stands for (its longest
        piece; byte-level and SentencePiece pieces are never shorter than the text they
        cover). Computed once."""
        if not hasattr(self, "_max_chars_per_token"):
            vocab = self.tokenizer.get_vocab()
            self._max_chars_per_token = max((len(piece) for piece in vocab), default=1) or 1
        return self._max_chars_per_token

    def check_prompt_size(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing, a text of ``chars`` characters that cannot fit in
        the context: it has at least ``chars / max_chars_per_token`` tokens. A factor of
        2 covers normalizers that shorten text. Raises InvalidRequestError (400)."""
        limit = self.max_model_len
        most = 2 * limit * self.max_chars_per_token
        if chars > most:
            raise InvalidRequestError(
                f"{param}: {chars} characters cannot fit in this model's maximum context length of {limit} "
                f"tokens (a token covers at most {self.max_chars_per_token} characters here, so at most "
                f"{most} characters are tokenized); send a shorter {param}",
                param,
            )

    def require_ready(self) -> None:
        """Raise EngineDeadError (503) unless the model has loaded and the engine runs."""
        if not self.engine.is_ready:
            raise EngineDeadError("the model is still loading" if self.engine.is_alive else "the engine is not running")

    @property
    def lora(self) -> LoRAManager | None:
        """The engine's LoRA manager, or None: LoRA is off, or the model is still loading."""
        manager: LoRAManager | None = getattr(self.engine.engine, "lora", None)  # None while loading
        return manager

    def model_not_found(self, model: str) -> ModelNotFound:
        """The 404 for a ``model`` this server does not serve (vLLM's message, and the
        name it does serve)."""
        return ModelNotFound(f"The model `{model}` does not exist; this server serves `{self.served_model_name}`"
                             + (" and the LoRA adapters `GET /v1/models` lists" if self.enable_lora else ""))

    def check_model(self, model: str | None) -> LoRARequest | None:
        """Resolve a request's ``model``: None (or the served model name) is the base
        model (None); a registered LoRA adapter's name is that adapter.

        Raises:
            ModelNotFound: any other name (404).
            EngineDeadError: with ``--enable-lora``, a name other than the base model's
                while the model is still loading (503: adapters are not registered yet).
        """
        if model is None or model == self.served_model_name:
            return None
        if self.enable_lora:
            manager = self.lora
            if manager is None:
                self.require_ready()
            else:
                found = manager.get(model)
                if found is not None:
                    return found
        raise self.model_not_found(model)

    def model_name(self, lora: LoRARequest | None) -> str:
        """The ``model`` a response reports: the adapter's name, else the served model
        name (as vLLM)."""
        return self.served_model_name if lora is None else lora.lora_name

    def resolve_max_tokens(self, prompt_len: int, max_tokens: int | None, param: str = "max_tokens",
                           prompt_param: str | None = None) -> int:
        """``None`` -> the rest of the context. Raises InvalidRequestError (400) when the
        prompt alone, or prompt + max_tokens, exceeds ``max_model_len``, naming both
        numbers; the error's ``param`` is ``param`` (the output limit's field) or, for a
        prompt too long by itself, ``prompt_param`` (default: ``messages`` for
        ``max_completion_tokens``, else ``prompt``)."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens, but the prompt has "
                f"{prompt_len} tokens (at least one output token must fit)",
                prompt_param or ("messages" if param == "max_completion_tokens" else "prompt"),
            )
        if max_tokens is None:
            return limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens, but {prompt_len + max_tokens} "
                f"were requested ({prompt_len} in the prompt + {max_tokens} for the completion); "
                f"lower {param} to at most {limit - prompt_len}",
                param,
            )
        return max_tokens

    @lru_cache(maxsize=65536)  # noqa: B019 - one context per server, bounded cache
    def token_text(self, token_id: int) -> str:
        text: str = self.tokenizer.decode([token_id])
        return text

    @lru_cache(maxsize=65536)  # noqa: B019 - one context per server, bounded cache
    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes. A token holding part of a multi-byte character decodes
        to U+FFFD alone; its bytes come from the vocabulary piece instead: GPT-2 byte-level
        pieces map back through the byte-to-unicode table, SentencePiece byte fallbacks
        are ``<0xNN>``."""
        text = self.token_text(token_id)
        if "\ufffd" not in text:
            return text.encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if m := _BYTE_PIECE.fullmatch(piece):
                return bytes([int(m.group(1), 16)])
            decoder = _byte_level_decoder()
            if piece and all(ch in decoder for ch in piece):
                return bytes(decoder[ch] for ch in piece)
        return text.encode()

    def prompt_logprobs_block(self, prompt: Sequence[int], entries: list[Any]) -> list[dict[str, PromptLogprob] | None]:
        """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token a
        map token id (as a string) -> :class:`PromptLogprob` holding the prompt's own
        token and the top alternatives (ranks 1..k)."""
        out: list[dict[str, PromptLogprob] | None] = [None]
        for pos, (logprob, rank, top) in enumerate(entries, start=1):
            d = {str(t): PromptLogprob(logprob=v, rank=r, decoded_token=self.token_text(t))
                 for r, (t, v) in enumerate(top, start=1)}
            tok = prompt[pos]
            d[str(tok)] = PromptLogprob(logprob=logprob, rank=rank, decoded_token=self.token_text(tok))
            out.append(d)
        return out

    def token_label(self, token_id: int) -> str:
        """The token as logprobs name it: its text, or ``bytes:\\xNN...`` (OpenAI's form)
        when it is only part of a character, so distinct byte tokens stay distinct."""
        text = self.token_text(token_id)
        if "\ufffd" not in text:
            return text
        return "bytes:" + "".join(f"\\x{b:02x}" for b in self.token_bytes(token_id))

    # ------------------------------------------------------------- fan-out
    async def generate(
        self,
        request_id: str,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        cache_salt: str | None,
        grammar: Any = None,
        lora: LoRARequest | None = None,
    ) -> AsyncGenerator[Delta, None]:
        """Run ``len(prompts) x params.n`` engine requests and yield their deltas as they
        come. Choice ``k`` of prompt ``p`` has index ``p * n + k`` and seed ``seed + k``.
        ``grammar`` is the compiled grammar of ``params.structured_outputs`` (one per
        request: every choice gets its own matcher over it). ``lora`` is the adapter every
        choice runs with (:meth:`check_model`'s answer): its host weights are fetched once,
        in a worker thread (they may be read from disk), before any request is added.
        Leaving early (disconnect, cancellation) or any failure aborts all of them.

        Raises (from the first ``anext``, before any delta):
            ModelNotFound: ``lora`` was unloaded after :meth:`check_model` resolved it.
            InvalidRequestError, EngineDeadError: the engine refused a request.
        """
        n = params.n
        out: asyncio.Queue[Any] = asyncio.Queue()
        choices: dict[str, Choice] = {}
        added: list[str] = []
        weights = None
        if lora is not None:
            manager = self.lora
            if manager is None:  # pragma: no cover - check_model resolved lora through it
                raise EngineDeadError("the engine is not running")
            try:
                weights = await asyncio.to_thread(manager.acquire, lora)
            except LoRAAdapterNotFoundError:
                raise self.model_not_found(lora.lora_name) from None
        try:
            for p_idx, ids in enumerate(prompts):
                for k in range(n):
                    sub = replace(params, n=1, seed=None if params.seed is None else params.seed + k)
                    rid = f"{request_id}-{p_idx}-{k}"
                    await self.engine.add_request(rid, ids, sub, cache_salt, out=out, grammar=grammar,
                                                  lora_request=lora, lora_weights=weights)
                    added.append(rid)
                    choices[rid] = Choice(index=p_idx * n + k, prompt_index=p_idx)
            remaining = len(choices)
            while remaining:
                item = await out.get()
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, RequestOutput)
                choice = choices[item.request_id]
                choice.text = item.output_text
                choice.token_ids = list(item.output_token_ids)
                choice.num_cached_tokens = item.num_cached_tokens
                if item.prompt_logprobs is not None:
                    choice.prompt_logprobs = item.prompt_logprobs
                if item.new_logprobs:
                    choice.logprobs.extend(item.new_logprobs)
                if item.finished:
                    # the engine's stop, length or abort (RequestOutput.finish_reason)
                    choice.finish_reason = cast(FinishReason, item.finish_reason)
                    choice.stop_reason = item.stop_reason
                    remaining -= 1
                    self._observe_parent(choice.prompt_index, choices, n)
                yield Delta(choice, item.new_text, item.new_logprobs, item.finished)
        finally:
            unfinished = [rid for rid in added if choices[rid].finish_reason is None]
            self.engine.abort(unfinished)


    def _observe_parent(self, prompt_index: int, choices: dict[str, Choice], n: int) -> None:
        """When every choice of prompt ``prompt_index`` has finished, report the parent
        request (``n`` and its longest output) to the metrics."""
        if self.metrics is None:
            return
        siblings = [c for c in choices.values() if c.prompt_index == prompt_index]
        if len(siblings) == n and all(c.finish_reason is not None for c in siblings):
            self.metrics.observe_finished_parent(n, max(len(c.token_ids) for c in siblings))


async def started(deltas: AsyncGenerator[Delta, None]) -> AsyncGenerator[Delta, None]:
    """Pull the first delta now, so that errors at add time (a refused prompt) raise
    before any byte of a stream is sent; return an iterator over all the deltas."""
    first = await anext(deltas)

    async def chain() -> AsyncGenerator[Delta, None]:
        try:
            yield first
            async for d in deltas:
                yield d
        finally:
            await deltas.aclose()

    return chain()


def new_request_id(prefix: str, header_id: str | None, sep: str = "-") -> tuple[str, str]:
    """(public id for the response, unique internal id for the engine): ``prefix``,
    ``sep`` and the ``X-Request-Id`` header's value, or 32 random hex digits."""
    public = f"{prefix}{sep}{header_id}" if header_id else f"{prefix}{sep}{uuid.uuid4().hex}"
    return public, f"{public}-{uuid.uuid4().hex[:8]}"


def usage(prompt_lens: Sequence[int], choices: Sequence[Choice], n: int) -> Usage:
    """The ``usage`` of a request: its prompts' tokens, every choice's output tokens, and
    per prompt the most tokens any of its choices found in the prefix cache."""
    prompt_tokens = sum(prompt_lens)
    completion = sum(len(c.token_ids) for c in choices)
    cached = sum(max((c.num_cached_tokens for c in choices if c.prompt_index == p), default=0) for p in range(len(prompt_lens)))
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )
