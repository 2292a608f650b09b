"""``POST /v1/chat/completions``: messages through the model's chat template, with tool
calls, reasoning and structured outputs.

Per choice, the model's text goes through up to two parsers, in this order (as vLLM):

1. the reasoning parser (``--reasoning-parser``): ``<think>...</think>`` becomes
   ``reasoning_content``, the rest is the answer;
2. the answer's tool calls: with ``tool_choice`` ``auto`` the ``--tool-call-parser``
   finds them in free text (:mod:`kvpilot.engine.server.tool_parsers`); with
   ``required`` or a named function the answer was generated under a JSON schema
   (:mod:`kvpilot.engine.server.structured`), so it is the calls themselves.

A choice that returns tool calls has ``finish_reason: "tool_calls"``; one cut by
``max_tokens`` keeps ``length`` and its text as content (its calls are incomplete).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvpilot.engine.errors import InvalidRequestError
from kvpilot.engine.lora.request import LoRARequest
from kvpilot.engine.outputs import TokenLogprob
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    FinishReason,
    FunctionCallDelta,
    ToolCallDelta,
)
from kvpilot.engine.server.reasoning import ReasoningParser, ReasoningStreamer, get_reasoning_parser
from kvpilot.engine.server.responses import sse_event
from kvpilot.engine.server.serving import (
    Choice,
    Delta,
    ServingContext,
    new_request_id,
    started,
    usage,
)
from kvpilot.engine.server.structured import structured_outputs_of, tool_constraint
from kvpilot.engine.server.tool_parsers import (
    ToolCall,
    ToolCallStreamer,
    ToolParser,
    get_tool_parser,
    new_tool_call_id,
)
from kvpilot.engine.structured_output import StructuredOutputsParams

# A template that closed an empty reasoning block at the very end of the prompt (Qwen3
# with enable_thinking=false) wants no reasoning: the constraint applies at once.
_CLOSED_REASONING_TAIL = 32


@dataclass(frozen=True)
class ChatOptions:
    """The server's chat flags (``kvpilot serve``), as in vLLM.

    Attributes:
        enable_auto_tool_choice: ``--enable-auto-tool-choice``: ``tool_choice: auto``
            is allowed (needs ``tool_call_parser``).
        tool_call_parser: ``--tool-call-parser`` name (hermes, llama3_json, mistral).
        reasoning_parser: ``--reasoning-parser`` name (deepseek_r1, qwen3).
        chat_template: ``--chat-template``: a Jinja template used instead of the
            tokenizer's (the file's text, already read).
    """

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # ValueError naming the allowed parsers
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or mistral)")


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
        _arguments_as_objects(d)
        out.append(d)
    return out


def _arguments_as_objects(message: dict[str, Any]) -> None:
    """OpenAI sends an assistant's earlier tool calls with ``arguments`` as JSON text;
    chat templates (Hermes, Llama 3, Mistral) render them with ``tojson`` and expect an
    object. Parse them in place, as vLLM does; text that is not JSON stays text."""
    for call in message.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            with contextlib.suppress(json.JSONDecodeError):
                fn["arguments"] = json.loads(fn["arguments"])


def render_chat(ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None, chat_template: str | None = None,
                param: str = "messages") -> list[int]:
    """Token ids of the conversation rendered with the chat template (``chat_template``
    when given, else the tokenizer's). Raises InvalidRequestError naming ``param`` (the
    request field the messages came from) when the messages' text alone cannot fit the
    context (checked before rendering and tokenizing) or the template refuses them."""
    tok = ctx.tokenizer
    dicts = message_dicts(messages)
    ctx.check_prompt_size(sum(len(d["content"]) for d in dicts), param)
    if chat_template is None and not getattr(tok, "chat_template", None):
        raise InvalidRequestError("this model has no chat template; use /v1/completions or start the server "
                                  "with --chat-template", param)
    kwargs = dict(template_kwargs or {})
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    try:
        text = tok.apply_chat_template(
            dicts,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            tools=tools,
            **kwargs,
        )
    except InvalidRequestError:
        raise
    except Exception as e:  # template errors (jinja raise_exception, bad roles) are the client's
        raise InvalidRequestError(f"the chat template rejected the messages: {e}", param) from e
    ids: list[int] = tok.encode(text, add_special_tokens=False)
    return ids


def chat_logprobs(ctx: ServingContext, lps: list[TokenLogprob]) -> ChatLogprobs:
    """OpenAI's chat ``logprobs``: per token its label, logprob, bytes and top entries."""
    def top(token_id: int, logprob: float) -> ChatTopLogprob:
        return ChatTopLogprob(token=ctx.token_label(token_id), logprob=logprob, bytes=list(ctx.token_bytes(token_id)))

    return ChatLogprobs(content=[
        ChatTokenLogprob(token=ctx.token_label(lp.token_id), logprob=lp.logprob, bytes=list(ctx.token_bytes(lp.token_id)),
                         top_logprobs=[top(t, v) for t, v in lp.top])
        for lp in lps])


@dataclass
class Prepared:
    """A validated chat request, ready to run.

    Attributes:
        ids: the rendered prompt's token ids.
        max_tokens: resolved output limit.
        logprobs: top-k logprobs per token, or None.
        constraint: the structured-output constraint (response_format, structured
            outputs, guided_*, or a required/named tool choice), or None.
        grammar: its compiled grammar (compiled off the event loop), or None.
        tool_mode: ``"required"``, the forced function's name, ``"auto"`` (parse calls
            from free text) or None (no tool calls).
        reasoning: the output starts with reasoning (a reasoning parser is set and the
            prompt did not close the reasoning block): it is split off the answer.
        lora: the LoRA adapter the request names in ``model``, or None (the base model).
    """

    ids: list[int]
    max_tokens: int
    logprobs: int | None
    constraint: StructuredOutputsParams | None = None
    grammar: Any = None
    tool_mode: str | None = None
    reasoning: bool = False
    lora: LoRARequest | None = None


@dataclass
class ChoiceOutput:
    """What one finished choice answers: message fields and finish reason."""

    content: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ChatHandler:
    def __init__(self, ctx: ServingContext, options: ChatOptions | None = None) -> None:
        self.ctx = ctx
        self.options = options or ChatOptions()
        self.tool_parser: ToolParser | None = (
            get_tool_parser(self.options.tool_call_parser) if self.options.tool_call_parser else None)
        self.reasoning: ReasoningParser | None = (
            get_reasoning_parser(self.options.reasoning_parser) if self.options.reasoning_parser else None)

    # ------------------------------------------------------------ prepare
    def _tool_mode(self, req: ChatCompletionRequest) -> tuple[StructuredOutputsParams | None, str | None]:
        constraint, forced = tool_constraint(req)
        if forced is not None:
            return constraint, forced
        if not req.tools or req.tool_choice == "none":
            return None, None
        # tool_choice auto (given, or the default with tools), as vLLM: only with a parser.
        if not (self.options.enable_auto_tool_choice and self.tool_parser is not None):
            raise InvalidRequestError(
                '"auto" tool choice (the default when tools are given) needs the server started with '
                "--enable-auto-tool-choice and --tool-call-parser; or send tool_choice \"required\", "
                "a named function, or \"none\"", "tool_choice")
        return None, "auto"

    def _reasoning_open(self, ids: list[int]) -> bool:
        """Whether the model starts inside its reasoning: a reasoning parser is set and
        the prompt did not just close an empty reasoning block."""
        if self.reasoning is None:
            return False
        tail = self.ctx.tokenizer.decode(ids[-_CLOSED_REASONING_TAIL:])
        return self.reasoning.end not in tail

    async def prepare(self, req: ChatCompletionRequest, *, input_param: str = "messages",
                      max_tokens_param: str | None = None,
                      constraint: StructuredOutputsParams | None = None) -> Prepared:
        """Validate ``req`` and render its prompt. Raises InvalidRequestError (400),
        ModelNotFound (404).

        Another API that speaks through the chat path (the Responses API) names its own
        fields in the errors: ``input_param`` is the field the messages came from,
        ``max_tokens_param`` the output limit's (default: ``max_completion_tokens`` or
        ``max_tokens``, whichever ``req`` has), and ``constraint`` is its structured-output
        constraint, used when ``req`` itself asks for none."""
        lora = self.ctx.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs=true", "top_logprobs")
        req.check_prompt_logprobs()
        constraint = structured_outputs_of(req) or constraint
        tool_so, tool_mode = self._tool_mode(req)
        if tool_so is not None:
            if constraint is not None:
                raise InvalidRequestError(
                    f"tool_choice {'required' if tool_mode == 'required' else 'naming a function'} constrains the "
                    f"output, and so does {constraint.param}; give only one of them", constraint.param)
            constraint = tool_so
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        # The template and the tokenizer run in a worker thread (seconds for huge inputs).
        ids = await asyncio.to_thread(render_chat, self.ctx, req.messages, req.add_generation_prompt,
                                      req.continue_final_message, req.chat_template_kwargs, tools,
                                      self.options.chat_template, input_param)
        param = max_tokens_param or (
            "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
        max_tokens = self.ctx.resolve_max_tokens(len(ids), req.max_completion_tokens or req.max_tokens, param,
                                                 prompt_param=None if max_tokens_param is None else input_param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        reasoning = self._reasoning_open(ids)
        grammar = None
        if constraint is not None:
            if reasoning:
                assert self.reasoning is not None
                constraint = dataclasses.replace(constraint, after=self.reasoning.end)
            grammar = await asyncio.to_thread(self.ctx.llm.compile_grammar, constraint)
        return Prepared(ids, max_tokens, logprobs, constraint, grammar, tool_mode, reasoning, lora)

    def sampling_params(self, req: ChatCompletionRequest, prep: Prepared) -> SamplingParams:
        """The engine's parameters. With ``tool_choice: auto`` special tokens stay in the
        text (as vLLM's parsers ask): tool-call markers such as Mistral's
        ``[TOOL_CALLS]`` or Llama 3's ``<|python_tag|>`` are special tokens."""
        params = req.to_sampling_params(prep.max_tokens, prep.logprobs)
        if prep.tool_mode == "auto":
            params = dataclasses.replace(params, skip_special_tokens=False)
        return dataclasses.replace(params, structured_outputs=prep.constraint) if prep.constraint else params

    # ----------------------------------------------------------- parsing
    def parse_choice(self, req: ChatCompletionRequest, prep: Prepared, choice: Choice) -> ChoiceOutput:
        """The message of a finished choice: reasoning split off, tool calls parsed."""
        text = choice.text
        reasoning = None
        if self.reasoning is not None and prep.reasoning:
            reasoning, answer = self.reasoning.extract(text)
            text = answer or ""
        out = ChoiceOutput(content=text, reasoning=reasoning if req.include_reasoning else None)
        mode = prep.tool_mode
        if mode == "required" and choice.finish_reason == "length":
            # Cut mid-array: the calls completed before the cut are kept (a stream has sent
            # them already); with none complete the raw text stays the content.
            elements = ArrayElements().feed(text)
            if elements:
                out.content, out.tool_calls = None, required_calls(f"[{','.join(elements)}]", self._parser_name())
            return out
        if mode is None or choice.finish_reason != "stop":
            return out
        if mode == "auto":
            assert self.tool_parser is not None
            found = self.tool_parser.extract(text)
            out.content, out.tool_calls = found.content, list(found.tool_calls)
        elif mode == "required":
            out.content, out.tool_calls = None, required_calls(text, self._parser_name())
        else:
            out.content, out.tool_calls = None, [ToolCall(new_tool_call_id(self._parser_name()), mode, text.strip())]
        return out

    def _parser_name(self) -> str:
        return self.options.tool_call_parser or "hermes"

    # ----------------------------------------------------------- entries
    async def create(self, req: ChatCompletionRequest, header_id: str | None) -> ChatCompletionResponse | AsyncIterator[str]:
        """The one entry of ``POST /v1/chat/completions``: validation, the prompt, the
        sampling parameters, generation and the answer: the whole body, or with
        ``stream`` the SSE events (validation errors raise before the stream starts)."""
        if req.stream:
            return await self.stream(req, header_id)
        return await self.complete(req, header_id)

    async def render(self, req: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
        """The entry of ``POST /v1/chat/completions/render``: the prompt token ids and
        sampling parameters :meth:`create` would run ``req`` with; nothing is generated.
        Refuses what :meth:`create` refuses, with the same errors."""
        self.ctx.check_model(req.model)
        self.ctx.require_ready()
        prep = await self.prepare(req)
        params = self.sampling_params(req, prep)
        self.ctx.llm.check_request(prep.ids, params)
        return prep.ids, params

    # ----------------------------------------------------------- respond
    async def complete(self, req: ChatCompletionRequest, header_id: str | None) -> ChatCompletionResponse:
        prep = await self.prepare(req)
        public_id, internal_id = new_request_id("chatcmpl", header_id)
        params = self.sampling_params(req, prep)
        done: dict[int, Choice] = {}
        async for delta in self.ctx.generate(internal_id, [prep.ids], params, req.cache_salt, grammar=prep.grammar,
                                             lora=prep.lora):
            if delta.finished:
                done[delta.choice.index] = delta.choice
        choices = []
        for i in sorted(done):
            c = done[i]
            parsed = self.parse_choice(req, prep, c)
            message = ChatResponseMessage(role="assistant", content=parsed.content)
            if parsed.reasoning is not None:
                message.reasoning_content = parsed.reasoning
            message.tool_calls = [t.to_openai() for t in parsed.tool_calls]
            choices.append(ChatCompletionChoice(
                index=i,
                message=message,
                logprobs=chat_logprobs(self.ctx, c.logprobs) if req.logprobs else None,
                finish_reason=_finish_reason(bool(parsed.tool_calls), c.finish_reason),
                stop_reason=c.stop_reason,
            ))
        body = ChatCompletionResponse(
            id=public_id, object="chat.completion", created=int(time.time()), model=self.ctx.model_name(prep.lora),
            choices=choices, usage=usage([len(prep.ids)], list(done.values()), req.n))
        if req.prompt_logprobs is not None and done:
            body.prompt_logprobs = self.ctx.prompt_logprobs_block(prep.ids, done[min(done)].prompt_logprobs or [])
        return body

    async def stream(self, req: ChatCompletionRequest, header_id: str | None) -> AsyncIterator[str]:
        prep = await self.prepare(req)
        public_id, internal_id = new_request_id("chatcmpl", header_id)
        params = self.sampling_params(req, prep)
        deltas = await started(self.ctx.generate(internal_id, [prep.ids], params, req.cache_salt, grammar=prep.grammar,
                                                 lora=prep.lora))
        return self._events(req, prep, public_id, deltas)

    def choice_stream(self, req: ChatCompletionRequest, prep: Prepared) -> ChoiceStream:
        """The streaming parsers (reasoning, then tool calls) of one choice of ``req``."""
        return ChoiceStream(
            reasoning=self.reasoning.streamer() if (self.reasoning is not None and prep.reasoning) else None,
            include_reasoning=req.include_reasoning,
            tool_mode=prep.tool_mode,
            tool_streamer=self.tool_parser.streamer() if (prep.tool_mode == "auto" and self.tool_parser) else None,
            parser_name=self._parser_name(),
        )

    async def _events(
        self, req: ChatCompletionRequest, prep: Prepared, public_id: str, deltas: AsyncGenerator[Delta, None]
    ) -> AsyncIterator[str]:
        created = int(time.time())
        model = self.ctx.model_name(prep.lora)
        streams: dict[int, ChoiceStream] = {}
        finished: list[Choice] = []

        def chunk(choice: ChatCompletionStreamChoice) -> str:
            return sse_event(ChatCompletionChunk(id=public_id, object="chat.completion.chunk", created=created,
                                                 model=model, choices=[choice]), ensure_ascii=False)

        try:
            async for d in deltas:
                c = d.choice
                cs = streams.get(c.index)
                if cs is None:
                    cs = streams[c.index] = self.choice_stream(req, prep)
                    yield chunk(ChatCompletionStreamChoice(index=c.index, delta=ChatDelta(role="assistant", content=""),
                                                           logprobs=None, finish_reason=None))
                lp = chat_logprobs(self.ctx, d.logprobs) if (req.logprobs and d.logprobs) else None
                pieces = cs.feed(d.text)
                if d.finished:
                    pieces += cs.finish(c.finish_reason)
                if lp is not None and not pieces:
                    pieces = [ChatDelta(content="")]
                for k, piece in enumerate(pieces):
                    yield chunk(ChatCompletionStreamChoice(index=c.index, delta=piece, logprobs=lp if k == 0 else None,
                                                           finish_reason=None))
                if d.finished:
                    finished.append(c)
                    yield chunk(ChatCompletionStreamChoice(
                        index=c.index, delta=ChatDelta(), logprobs=None,
                        finish_reason=_finish_reason(bool(cs.tool_calls), c.finish_reason), stop_reason=c.stop_reason))
            if req.stream_options and req.stream_options.include_usage:
                yield sse_event(ChatCompletionChunk(id=public_id, object="chat.completion.chunk", created=created,
                                                    model=model, choices=[], usage=usage([len(prep.ids)], finished, req.n)))
            yield "data: [DONE]\n\n"
        finally:
            await deltas.aclose()


def _finish_reason(has_tool_calls: bool, engine_reason: FinishReason | None) -> FinishReason | None:
    """A choice that stopped on its own with tool calls finishes with ``tool_calls``; one
    cut by ``max_tokens`` keeps ``length``."""
    return "tool_calls" if has_tool_calls and engine_reason == "stop" else engine_reason


def required_calls(text: str, parser_name: str) -> list[ToolCall]:
    """The calls of a ``tool_choice: required`` answer: a JSON array of
    ``{"name", "parameters"}`` objects (the grammar guarantees the shape)."""
    calls = json.loads(text)
    return [ToolCall(new_tool_call_id(parser_name), c["name"], json.dumps(c["parameters"], ensure_ascii=False))
            for c in calls]


class ArrayElements:
    """Finds the complete top-level elements of a JSON array as its text streams in
    (tracking strings, escapes and nesting depth); used to stream the calls of a
    ``tool_choice: required`` answer one by one."""

    def __init__(self) -> None:
        self.buf = ""
        self._pos = 0
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._start: int | None = None

    def feed(self, text: str) -> list[str]:
        """Append ``text``; return the elements completed by it, as JSON text."""
        self.buf += text
        done = []
        while self._pos < len(self.buf):
            ch = self.buf[self._pos]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._start = self._pos
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1 and self._start is not None:
                    done.append(self.buf[self._start : self._pos + 1])
                    self._start = None
            self._pos += 1
        return done


class ChoiceStream:
    """One streamed choice's parsers: reasoning first, then tool calls. ``feed`` and
    ``finish`` return the chat-completion-chunk deltas to send, in order; the tool-call
    parser's delta objects (:class:`~kvpilot.engine.server.tool_parsers.ToolCallStreamer`)
    become :class:`ChatDelta` models here.

    Attributes:
        tool_calls: the header (first) delta of every call streamed so far.
    """

    def __init__(self, reasoning: ReasoningStreamer | None, include_reasoning: bool, tool_mode: str | None,
                 tool_streamer: ToolCallStreamer | None, parser_name: str) -> None:
        self.reasoning = reasoning
        self.include_reasoning = include_reasoning
        self.tool_mode = tool_mode
        self.tool_streamer = tool_streamer
        self.parser_name = parser_name
        self.tool_calls: list[ToolCallDelta] = []
        self._elements = ArrayElements() if tool_mode == "required" else None
        self._named_id: str | None = None
        self._answer = ""

    def feed(self, text: str) -> list[ChatDelta]:
        if not text:
            return []
        if self.reasoning is None:
            return self._answer_deltas(text)
        think, answer = self.reasoning.feed(text)
        return self._reasoning_delta(think) + self._answer_deltas(answer)

    def finish(self, finish_reason: str | None) -> list[ChatDelta]:
        out: list[ChatDelta] = []
        if self.reasoning is not None:
            think, answer = self.reasoning.finish()
            out += self._reasoning_delta(think) + self._answer_deltas(answer)
        if self.tool_streamer is not None:
            out += self._track(self.tool_streamer.finish())
        if self.tool_mode == "required" and not self.tool_calls and self._answer:
            # cut before any call completed: as content, like the non-streamed answer
            out.append(ChatDelta(content=self._answer))
        return out

    def _reasoning_delta(self, think: str) -> list[ChatDelta]:
        return [ChatDelta(reasoning_content=think)] if think and self.include_reasoning else []

    def _track(self, deltas: list[dict[str, Any]]) -> list[ChatDelta]:
        out = [ChatDelta.model_validate(d) for d in deltas]
        for delta in out:
            self.tool_calls.extend(call for call in delta.tool_calls or () if call.id is not None)
        return out

    def _head(self, index: int, name: str, call_id: str) -> ChatDelta:
        head = ToolCallDelta(index=index, id=call_id, type="function",
                             function=FunctionCallDelta(name=name, arguments=""))
        self.tool_calls.append(head)
        return ChatDelta(tool_calls=[head])

    @staticmethod
    def _arguments(index: int, arguments: str) -> ChatDelta:
        return ChatDelta(tool_calls=[ToolCallDelta(index=index, function=FunctionCallDelta(arguments=arguments))])

    def _answer_deltas(self, text: str) -> list[ChatDelta]:
        if not text:
            return []
        self._answer += text
        mode = self.tool_mode
        if mode is None:
            return [ChatDelta(content=text)]
        if mode == "auto":
            assert self.tool_streamer is not None
            return self._track(self.tool_streamer.feed(text))
        if mode == "required":
            assert self._elements is not None
            out = []
            for element in self._elements.feed(text):
                call = json.loads(element)
                index = len(self.tool_calls)
                out.append(self._head(index, call["name"], new_tool_call_id(self.parser_name)))
                out.append(self._arguments(index, json.dumps(call["parameters"], ensure_ascii=False)))
            return out
        # a named function: the answer is its arguments, streamed as they come
        out = []
        if self._named_id is None:
            self._named_id = new_tool_call_id(self.parser_name)
            out.append(self._head(0, mode, self._named_id))
        out.append(self._arguments(0, text))
        return out
