"""``POST /v1/responses``: OpenAI's Responses API, stateless, as vLLM serves it (not to be
confused with :mod:`~kvpilot.engine.server.responses`, which answers any generation
request over HTTP).

A Responses request is a chat request in other words, so it runs through the chat path
(:class:`~kvpilot.engine.server.chat.ChatHandler`): its ``instructions``,
``previous_input_messages`` and ``input`` items become chat messages (vLLM's mapping:
``function_call`` items become an assistant message's ``tool_calls``,
``function_call_output`` items ``tool`` messages, ``reasoning`` items the next assistant
message's ``reasoning_content``), its flat function tools and ``tool_choice`` the chat
ones, ``text.format`` the structured-output constraint and ``max_output_tokens`` the
output limit; the chat template, the tool-call and reasoning parsers, xgrammar, the
engine and the errors are the chat path's, with this API's field names in the errors
(``input``, ``max_output_tokens``, ``text.format``).

The answer is a response object whose ``output`` holds, in order, a ``reasoning`` item
(with ``--reasoning-parser``), a ``message`` item with the text and one
``function_call`` item per call. A stream sends vLLM's events (:class:`OutputEvents`),
each numbered by ``sequence_number`` from 0, and ends with ``response.completed``, whose
response is the one a non-streamed request gets (its output being the items streamed).

Nothing is stored: ``store`` is accepted and answered false; ``background`` and
``previous_response_id``, which need stored responses, are refused with a 400 naming them.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from kvpilot.engine.errors import (
    EngineDeadError,
    InvalidRequestError,
    RequestAbortedError,
    RequestFailedError,
)
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.chat import ChatHandler, ChoiceOutput, Prepared
from kvpilot.engine.server.protocol import (
    ChatCompletionRequest,
    ChatDelta,
    ChatMessage,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ResponsesCompletedEvent,
    ResponsesContentPartAddedEvent,
    ResponsesContentPartDoneEvent,
    ResponsesCreatedEvent,
    ResponsesErrorEvent,
    ResponsesFunctionCallArgumentsDeltaEvent,
    ResponsesFunctionCallArgumentsDoneEvent,
    ResponsesFunctionCallItem,
    ResponsesFunctionCallOutputItem,
    ResponsesFunctionChoice,
    ResponsesIncompleteDetails,
    ResponsesInProgressEvent,
    ResponsesInputTokensDetails,
    ResponsesMessageItem,
    ResponsesOutputFunctionCall,
    ResponsesOutputItemAddedEvent,
    ResponsesOutputItemDoneEvent,
    ResponsesOutputMessage,
    ResponsesOutputReasoning,
    ResponsesOutputText,
    ResponsesOutputTokensDetails,
    ResponsesReasoningItem,
    ResponsesReasoningText,
    ResponsesReasoningTextDeltaEvent,
    ResponsesReasoningTextDoneEvent,
    ResponsesRequest,
    ResponsesResponse,
    ResponsesTextDeltaEvent,
    ResponsesTextDoneEvent,
    ResponsesTextFormatJsonObject,
    ResponsesTextFormatJsonSchema,
    ResponsesTextPart,
    ResponsesUsage,
    Tool,
)
from kvpilot.engine.server.responses import sse_event
from kvpilot.engine.server.serving import Choice, Delta, new_request_id, started, usage
from kvpilot.engine.structured_output import StructuredOutputsParams

OutputItem = ResponsesOutputMessage | ResponsesOutputReasoning | ResponsesOutputFunctionCall
Event = (ResponsesCreatedEvent | ResponsesInProgressEvent | ResponsesCompletedEvent | ResponsesOutputItemAddedEvent
         | ResponsesOutputItemDoneEvent | ResponsesContentPartAddedEvent | ResponsesContentPartDoneEvent
         | ResponsesTextDeltaEvent | ResponsesTextDoneEvent | ResponsesReasoningTextDeltaEvent
         | ResponsesReasoningTextDoneEvent | ResponsesFunctionCallArgumentsDeltaEvent
         | ResponsesFunctionCallArgumentsDoneEvent | ResponsesErrorEvent)

INPUT = "input"
MAX_OUTPUT_TOKENS = "max_output_tokens"
TEXT_FORMAT = "text.format"


def new_item_id(prefix: str) -> str:
    """An output item's id: ``prefix`` (``msg``, ``rs``, ``fc``), ``_`` and 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ------------------------------------------------------------------ the request
def refuse_stateful(req: ResponsesRequest) -> None:
    """Raise InvalidRequestError (400) naming ``background`` or ``previous_response_id``:
    both need responses stored on the server, and kvpilot stores none."""
    if req.background:
        raise InvalidRequestError(
            "background: true is not supported: a background response must be stored to be fetched later, "
            "and kvpilot stores no responses; send the request without background (stream it to see "
            "progress)", "background")
    if req.previous_response_id is not None:
        raise InvalidRequestError(
            f"previous_response_id {req.previous_response_id!r} cannot be used: kvpilot stores no responses; "
            "send the earlier conversation in input (its output items may be sent back as they are) or in "
            "previous_input_messages", "previous_response_id")


def _text(content: str | list[ResponsesTextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def conversation(req: ResponsesRequest) -> tuple[list[dict[str, Any]], bool]:
    """The chat messages of ``req`` (as dicts, the chat template's keys) and whether the
    last one is an unfinished answer to continue (an assistant message item with status
    ``in_progress`` or ``incomplete`` last, as vLLM reads it).

    Order: ``instructions`` as a system message, ``previous_input_messages`` without
    their system and developer messages, then ``input`` (a string is one user message;
    an empty string after ``previous_input_messages`` adds none). Consecutive assistant
    items merge into one message, as vLLM does: reasoning, then text, then calls."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    for m in req.previous_input_messages or ():
        if m.role not in ("system", "developer"):
            messages.append(m.model_dump(exclude_none=True))
    if isinstance(req.input, str):
        if req.input or not req.previous_input_messages:
            messages.append({"role": "user", "content": req.input})
        return messages, False
    for item in req.input:
        _add_item(messages, item)
    last = req.input[-1]
    cont = (isinstance(last, ResponsesMessageItem) and last.role == "assistant"
            and last.status in ("in_progress", "incomplete"))
    return messages, cont


def _add_item(messages: list[dict[str, Any]], item: Any) -> None:
    """Append ``item`` to ``messages`` (or fold it into the assistant message before)."""
    prev = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    if isinstance(item, ResponsesFunctionCallItem):
        call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        if prev is not None:
            prev.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif isinstance(item, ResponsesFunctionCallOutputItem):
        messages.append({"role": "tool", "content": _text(item.output), "tool_call_id": item.call_id})
    elif isinstance(item, ResponsesReasoningItem):
        texts = item.content or item.summary
        reasoning = texts[0].text if texts else ""
        if prev is not None and "reasoning_content" not in prev:
            prev["reasoning_content"] = prev["reasoning"] = reasoning
        else:
            messages.append({"role": "assistant", "content": None, "reasoning_content": reasoning,
                             "reasoning": reasoning})
    else:
        assert isinstance(item, ResponsesMessageItem)
        text = _text(item.content)
        if item.role == "assistant" and prev is not None and prev.get("content") is None:
            prev["content"] = text
        else:
            messages.append({"role": item.role, "content": text})


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """``req`` as the chat completion request the chat path runs (not validated again:
    every value was validated as a Responses field, with the same bounds)."""
    messages, cont = conversation(req)
    tools = [Tool(type="function", function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)) for t in req.tools or ()]
    choice = req.tool_choice
    tool_choice = (NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
                   if isinstance(choice, ResponsesFunctionChoice) else choice)
    return ChatCompletionRequest.model_construct(
        model=req.model,
        messages=[ChatMessage.model_validate(m) for m in messages],
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, stream=req.stream, stop=req.stop, seed=req.seed,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, top_k=req.top_k,
        min_p=req.min_p, repetition_penalty=req.repetition_penalty, ignore_eos=req.ignore_eos,
        stop_token_ids=req.stop_token_ids, skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output, logit_bias=req.logit_bias,
        cache_salt=req.cache_salt, user=req.user,
        add_generation_prompt=not cont, continue_final_message=cont,
        chat_template_kwargs=req.chat_template_kwargs,
        tools=tools or None, tool_choice=tool_choice, parallel_tool_calls=req.parallel_tool_calls,
        include_reasoning=req.include_reasoning,
    )


def text_constraint(req: ResponsesRequest) -> StructuredOutputsParams | None:
    """The constraint of ``text.format`` (None for ``text`` or none). Raises
    InvalidRequestError naming ``text.format.schema`` for a schema that is not JSON."""
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, ResponsesTextFormatJsonObject):
        return StructuredOutputsParams(json_object=True, param=TEXT_FORMAT)
    if isinstance(fmt, ResponsesTextFormatJsonSchema):
        return StructuredOutputsParams(json=StructuredOutputsParams.schema_text(fmt.schema_, f"{TEXT_FORMAT}.schema"),
                                       strict=fmt.strict is not False, param=TEXT_FORMAT)
    return None


# ------------------------------------------------------------------ the answer
def output_items(parsed: ChoiceOutput) -> list[OutputItem]:
    """A finished answer's output items: its reasoning, its text, its calls (vLLM's
    order); an answer with none of them is one message item without content."""
    items: list[OutputItem] = []
    if parsed.reasoning:
        items.append(ResponsesOutputReasoning(
            id=new_item_id("rs"), type="reasoning", summary=[],
            content=[ResponsesReasoningText(type="reasoning_text", text=parsed.reasoning)], status="completed"))
    if parsed.content:
        items.append(_message(new_item_id("msg"), parsed.content, "completed"))
    for call in parsed.tool_calls:
        items.append(ResponsesOutputFunctionCall(id=new_item_id("fc"), type="function_call", call_id=call.id,
                                                 name=call.name, arguments=call.arguments, status="completed"))
    if not items:
        items.append(_message(new_item_id("msg"), None, "completed"))
    return items


def _output_text(text: str) -> ResponsesOutputText:
    return ResponsesOutputText(type="output_text", text=text, annotations=[], logprobs=[])


def _message(item_id: str, text: str | None, status: Any) -> ResponsesOutputMessage:
    return ResponsesOutputMessage(id=item_id, type="message", role="assistant", status=status,
                                  content=[_output_text(text)] if text else [])


class OutputEvents:
    """The stream events of one answer, made from the chat path's deltas
    (:class:`~kvpilot.engine.server.chat.ChoiceStream`), as vLLM's
    ``SimpleStreamingEventProcessor`` makes them.

    The answer is a sequence of items, one open at a time: reasoning text opens a
    ``reasoning`` item, answer text a ``message`` item, a call's first delta a
    ``function_call`` item (each call its own); a delta of another kind closes the open
    item. An item opens with ``response.output_item.added`` (and, for text,
    ``response.content_part.added``), grows by ``*.delta`` events and closes with
    ``*.done``, ``response.content_part.done`` (text) and ``response.output_item.done``.
    ``sequence_number`` counts every event of the stream, those made elsewhere included
    (:meth:`number`).

    Attributes:
        items: the items closed so far, as their ``output_item.done`` events carry them.
    """

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._seq = 0
        self._kind: str | None = None  # "reasoning", "message", "function_call" or None
        self._id = ""
        self._text = ""
        self._call: tuple[int, str, str] | None = None  # (index, call_id, name) of the open call

    def number(self) -> int:
        """The next event's sequence number (taken)."""
        n = self._seq
        self._seq += 1
        return n

    def feed(self, piece: ChatDelta) -> list[Event]:
        """The events of one chat delta (reasoning, text or tool-call parts)."""
        out: list[Event] = []
        if piece.reasoning_content:
            out += self._append("reasoning", piece.reasoning_content)
        if piece.content:
            out += self._append("message", piece.content)
        for call in piece.tool_calls or ():
            if call.id is not None:  # a call's first delta: its id and name
                out += self.close()
                out += self._open_call(call.index, call.id, call.function.name or "")
            if call.function.arguments and self._call is not None and self._call[0] == call.index:
                self._text += call.function.arguments
                out.append(ResponsesFunctionCallArgumentsDeltaEvent(
                    type="response.function_call_arguments.delta", sequence_number=self.number(), item_id=self._id,
                    output_index=len(self.items), delta=call.function.arguments))
        return out

    def finish(self) -> list[Event]:
        """Close the open item; an answer that streamed nothing gets one message item
        without content, as the non-streamed answer has."""
        out = self.close()
        if not self.items:
            item = _message(new_item_id("msg"), None, "in_progress")
            out.append(ResponsesOutputItemAddedEvent(type="response.output_item.added", sequence_number=self.number(),
                                                     output_index=0, item=item))
            done = item.model_copy(update={"status": "completed"})
            out.append(ResponsesOutputItemDoneEvent(type="response.output_item.done", sequence_number=self.number(),
                                                    output_index=0, item=done))
            self.items.append(done)
        return out

    def _append(self, kind: str, text: str) -> list[Event]:
        out = [] if self._kind == kind else self.close() + self._open_text(kind)
        self._text += text
        index = len(self.items)
        if kind == "reasoning":
            out.append(ResponsesReasoningTextDeltaEvent(
                type="response.reasoning_text.delta", sequence_number=self.number(), item_id=self._id,
                output_index=index, content_index=0, delta=text))
        else:
            out.append(ResponsesTextDeltaEvent(
                type="response.output_text.delta", sequence_number=self.number(), item_id=self._id,
                output_index=index, content_index=0, delta=text, logprobs=[]))
        return out

    def _open_text(self, kind: str) -> list[Event]:
        self._kind, self._text = kind, ""
        index = len(self.items)
        item: OutputItem
        part: ResponsesOutputText | ResponsesReasoningText
        if kind == "reasoning":
            self._id = new_item_id("rs")
            item = ResponsesOutputReasoning(id=self._id, type="reasoning", summary=[], content=[], status="in_progress")
            part = ResponsesReasoningText(type="reasoning_text", text="")
        else:
            self._id = new_item_id("msg")
            item = _message(self._id, None, "in_progress")
            part = _output_text("")
        return [
            ResponsesOutputItemAddedEvent(type="response.output_item.added", sequence_number=self.number(),
                                          output_index=index, item=item),
            ResponsesContentPartAddedEvent(type="response.content_part.added", sequence_number=self.number(),
                                           item_id=self._id, output_index=index, content_index=0, part=part),
        ]

    def _open_call(self, index: int, call_id: str, name: str) -> list[Event]:
        self._kind, self._text, self._id = "function_call", "", new_item_id("fc")
        self._call = (index, call_id, name)
        item = ResponsesOutputFunctionCall(id=self._id, type="function_call", call_id=call_id, name=name,
                                           arguments="", status="in_progress")
        return [ResponsesOutputItemAddedEvent(type="response.output_item.added", sequence_number=self.number(),
                                              output_index=len(self.items), item=item)]

    def close(self) -> list[Event]:
        """Close the open item, if any: its ``done`` events."""
        kind, index, item_id, text = self._kind, len(self.items), self._id, self._text
        out: list[Event] = []
        item: OutputItem
        if kind is None:
            return out
        if kind == "function_call":
            assert self._call is not None
            _, call_id, name = self._call
            out.append(ResponsesFunctionCallArgumentsDoneEvent(
                type="response.function_call_arguments.done", sequence_number=self.number(), item_id=item_id,
                output_index=index, name=name, arguments=text))
            item = ResponsesOutputFunctionCall(id=item_id, type="function_call", call_id=call_id, name=name,
                                               arguments=text, status="completed")
            self._call = None
        elif kind == "reasoning":
            part = ResponsesReasoningText(type="reasoning_text", text=text)
            out.append(ResponsesReasoningTextDoneEvent(
                type="response.reasoning_text.done", sequence_number=self.number(), item_id=item_id,
                output_index=index, content_index=0, text=text))
            out.append(ResponsesContentPartDoneEvent(
                type="response.content_part.done", sequence_number=self.number(), item_id=item_id,
                output_index=index, content_index=0, part=part))
            item = ResponsesOutputReasoning(id=item_id, type="reasoning", summary=[], content=[part],
                                            status="completed")
        else:
            out.append(ResponsesTextDoneEvent(
                type="response.output_text.done", sequence_number=self.number(), item_id=item_id,
                output_index=index, content_index=0, text=text, logprobs=[]))
            out.append(ResponsesContentPartDoneEvent(
                type="response.content_part.done", sequence_number=self.number(), item_id=item_id,
                output_index=index, content_index=0, part=_output_text(text)))
            item = _message(item_id, text, "completed")
        out.append(ResponsesOutputItemDoneEvent(type="response.output_item.done", sequence_number=self.number(),
                                                output_index=index, item=item))
        self.items.append(item)
        self._kind = None
        return out


def sse(event: Event) -> str:
    """One event on the wire: ``event: <type>`` and its JSON (non-ASCII kept)."""
    return sse_event(event, ensure_ascii=False, event=event.type)


# ------------------------------------------------------------------ the handler
@dataclasses.dataclass
class Run:
    """A validated Responses request, ready to generate: the chat request it became,
    the chat path's preparation (prompt ids, constraint, tool mode) and the engine's
    sampling parameters."""

    req: ResponsesRequest
    chat: ChatCompletionRequest
    prep: Prepared
    params: SamplingParams


class ResponsesHandler:
    """``POST /v1/responses`` (and ``/v1/responses/render``) on the chat path of ``chat``."""

    def __init__(self, chat: ChatHandler) -> None:
        self.chat = chat
        self.ctx = chat.ctx

    async def prepare(self, req: ResponsesRequest) -> Run:
        """Validate ``req`` and render its prompt. Raises InvalidRequestError (400: the
        stateful fields, and what the chat path refuses, named by this API's fields),
        ModelNotFound (404)."""
        refuse_stateful(req)
        chat = chat_request(req)
        prep = await self.chat.prepare(chat, input_param=INPUT, max_tokens_param=MAX_OUTPUT_TOKENS,
                                       constraint=text_constraint(req))
        return Run(req, chat, prep, self.chat.sampling_params(chat, prep))

    async def create(self, req: ResponsesRequest, header_id: str | None) -> ResponsesResponse | AsyncIterator[str]:
        """The one entry of ``POST /v1/responses``: the whole response object, or with
        ``stream`` the SSE events (validation errors raise before the stream starts)."""
        run = await self.prepare(req)
        public_id, internal_id = new_request_id("resp", header_id, sep="_")
        deltas = self.ctx.generate(internal_id, [run.prep.ids], run.params, req.cache_salt, grammar=run.prep.grammar,
                                   lora=run.prep.lora)
        if req.stream:
            return self._events(run, public_id, await started(deltas))
        choice: Choice | None = None
        created = int(time.time())
        async for delta in deltas:
            if delta.finished:
                choice = delta.choice
        assert choice is not None, "the engine ended the request without a final output"
        parsed = self.chat.parse_choice(run.chat, run.prep, choice)
        return self.body(run, public_id, created, output_items(parsed), choice)

    async def render(self, req: ResponsesRequest) -> tuple[list[int], SamplingParams]:
        """The entry of ``POST /v1/responses/render``: the prompt token ids and sampling
        parameters :meth:`create` would run ``req`` with; nothing is generated. Refuses
        what :meth:`create` refuses, with the same errors."""
        self.ctx.check_model(req.model)
        self.ctx.require_ready()
        run = await self.prepare(req)
        self.ctx.llm.check_request(run.prep.ids, run.params)
        return run.prep.ids, run.params

    def body(self, run: Run, public_id: str, created: int, output: list[OutputItem],
             choice: Choice | None) -> ResponsesResponse:
        """The response object; ``choice`` None is a response still in progress (the
        first stream events: no output, no usage)."""
        req, params = run.req, run.params
        status: Any = "in_progress"
        incomplete = None
        result_usage = None
        if choice is not None:
            status = {"length": "incomplete", "abort": "cancelled"}.get(choice.finish_reason or "", "completed")
            if status == "incomplete":
                incomplete = ResponsesIncompleteDetails(reason="max_output_tokens")
            u = usage([len(run.prep.ids)], [choice], 1)
            result_usage = ResponsesUsage(
                input_tokens=u.prompt_tokens,
                input_tokens_details=ResponsesInputTokensDetails(
                    cached_tokens=u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0),
                output_tokens=u.completion_tokens,
                output_tokens_details=ResponsesOutputTokensDetails(reasoning_tokens=self.reasoning_tokens(run, choice)),
                total_tokens=u.total_tokens)
        tools = req.tools or []
        # vLLM's echo: `auto` (the default) without tools is `none`.
        tool_choice = req.tool_choice or "auto"
        if not tools and tool_choice == "auto":
            tool_choice = "none"
        return ResponsesResponse(
            id=public_id, created_at=created, incomplete_details=incomplete, instructions=req.instructions,
            metadata=req.metadata, model=self.ctx.model_name(run.prep.lora), object="response", output=output,
            parallel_tool_calls=req.parallel_tool_calls, temperature=params.temperature,
            tool_choice=tool_choice, tools=tools, top_p=params.top_p,
            background=False, max_output_tokens=run.prep.max_tokens, previous_response_id=None, status=status,
            store=False, text=req.text, truncation="disabled", usage=result_usage, user=req.user)

    def reasoning_tokens(self, run: Run, choice: Choice) -> int:
        """How many output tokens are reasoning: those up to the one that completes the
        reasoning parser's end marker (all of them when the marker never came); 0
        without a parser or when the output holds no reasoning."""
        parser = self.chat.reasoning
        if parser is None or not run.prep.reasoning:
            return 0
        reasoning, _ = parser.extract(choice.text)
        ids = choice.token_ids
        if reasoning is None:
            return 0
        decode = self.ctx.tokenizer.decode
        if parser.end not in decode(ids):
            return len(ids)
        lo, hi = 1, len(ids)  # the shortest prefix whose text holds the marker
        while lo < hi:
            mid = (lo + hi) // 2
            if parser.end in decode(ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo

    async def _events(self, run: Run, public_id: str, deltas: AsyncGenerator[Delta, None]) -> AsyncIterator[str]:
        created = int(time.time())
        events = OutputEvents()
        stream = self.chat.choice_stream(run.chat, run.prep)
        first = self.body(run, public_id, created, [], None)
        try:
            yield sse(ResponsesCreatedEvent(type="response.created", sequence_number=events.number(), response=first))
            yield sse(ResponsesInProgressEvent(type="response.in_progress", sequence_number=events.number(),
                                               response=first))
            choice: Choice | None = None
            async for d in deltas:
                pieces = stream.feed(d.text)
                if d.finished:
                    choice = d.choice
                    pieces += stream.finish(d.choice.finish_reason)
                for piece in pieces:
                    for event in events.feed(piece):
                        yield sse(event)
            for event in events.finish():
                yield sse(event)
            assert choice is not None, "the engine ended the request without a final output"
            yield sse(ResponsesCompletedEvent(type="response.completed", sequence_number=events.number(),
                                              response=self.body(run, public_id, created, events.items, choice)))
        except (RequestFailedError, RequestAbortedError, EngineDeadError, InvalidRequestError) as e:
            # After the first event the status cannot change: the failure is the last event.
            code = ("server_error" if isinstance(e, RequestFailedError) else
                    "invalid_value" if isinstance(e, InvalidRequestError) else "service_unavailable")
            yield sse(ResponsesErrorEvent(type="error", sequence_number=events.number(), code=code, message=str(e),
                                          param=getattr(e, "param", None)))
        finally:
            await deltas.aclose()
