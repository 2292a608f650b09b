"""The Responses API's parts that need no model: the stream's events made from chat
deltas (:class:`OutputEvents`), the mapping of input items to chat messages, and the
server's guard (loading, draining) in front of ``POST /v1/responses``."""

from __future__ import annotations

import pytest

from kvpilot.engine.server.chat import ChoiceOutput
from kvpilot.engine.server.protocol import (
    ChatDelta,
    FunctionCallDelta,
    ResponsesRequest,
    ToolCallDelta,
)
from kvpilot.engine.server.responses_api import OutputEvents, conversation, output_items
from kvpilot.engine.server.tool_parsers import ToolCall


def head(index: int, call_id: str, name: str) -> ChatDelta:
    return ChatDelta(tool_calls=[ToolCallDelta(index=index, id=call_id, type="function",
                                               function=FunctionCallDelta(name=name, arguments=""))])


def args(index: int, text: str) -> ChatDelta:
    return ChatDelta(tool_calls=[ToolCallDelta(index=index, function=FunctionCallDelta(arguments=text))])


def run(pieces: list[ChatDelta]) -> tuple[OutputEvents, list]:
    events = OutputEvents()
    out = []
    for piece in pieces:
        out += events.feed(piece)
    out += events.finish()
    return events, out


def test_reasoning_then_text_then_two_calls():
    events, out = run([ChatDelta(reasoning_content="Think"), ChatDelta(reasoning_content="ing."),
                       ChatDelta(content="Hi"), ChatDelta(content="!"),
                       head(0, "call-a", "f"), args(0, '{"x":'), args(0, " 1}"),
                       head(1, "call-b", "g"), args(1, "{}")])
    assert [e.type for e in out] == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
    ]
    assert [e.sequence_number for e in out] == list(range(len(out)))
    assert [e.output_index for e in out] == [0] * 7 + [1] * 7 + [2] * 5 + [3] * 4
    items = [i.model_dump() for i in events.items]
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "Thinking."}]
    assert items[1]["content"][0]["text"] == "Hi!"
    assert (items[2]["call_id"], items[2]["name"], items[2]["arguments"]) == ("call-a", "f", '{"x": 1}')
    assert (items[3]["call_id"], items[3]["arguments"]) == ("call-b", "{}")
    assert all(i["status"] == "completed" for i in items)
    # every delta names the item it belongs to, as added
    added = {e.output_index: e.item.id for e in out if e.type == "response.output_item.added"}
    assert all(e.item_id == added[e.output_index] for e in out if hasattr(e, "item_id"))
    assert [e.item for e in out if e.type == "response.output_item.done"] == events.items


def test_a_stream_with_nothing_in_it_still_has_one_empty_message():
    events, out = run([ChatDelta(content="")])
    assert [e.type for e in out] == ["response.output_item.added", "response.output_item.done"]
    assert events.items[0].type == "message" and events.items[0].content == []
    assert [i.type for i in output_items(ChoiceOutput(content=""))] == ["message"]


def test_the_non_streamed_items_are_in_the_streamed_order():
    items = output_items(ChoiceOutput(content="Hi", reasoning="Think",
                                      tool_calls=[ToolCall("call-a", "f", "{}")]))
    assert [(i.type, i.id[:3]) for i in items] == [("reasoning", "rs_"), ("message", "msg"), ("function_call", "fc_")]
    assert items[2].call_id == "call-a" and items[1].content[0].text == "Hi"


def request(**body) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "x", **body})


def test_items_become_chat_messages_as_vllm_maps_them():
    messages, cont = conversation(request(instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "A"}, {"type": "input_text", "text": "B"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
    ]))
    assert not cont
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "AB"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "hmm", "reasoning": "hmm",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "content": "one", "tool_call_id": "c1"},
        {"role": "tool", "content": "two", "tool_call_id": "c2"},
    ]


def test_previous_input_messages_and_the_input_string():
    prev = [{"role": "developer", "content": "old rules"}, {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A"}]
    messages, _ = conversation(request(previous_input_messages=prev, input="Q2"))
    assert messages == [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
                        {"role": "user", "content": "Q2"}]
    assert conversation(request(previous_input_messages=prev, input=""))[0] == messages[:2]
    assert conversation(request(input=""))[0] == [{"role": "user", "content": ""}]


@pytest.mark.parametrize(("status", "cont"), [("incomplete", True), ("in_progress", True), ("completed", False),
                                             (None, False)])
def test_an_unfinished_answer_last_is_continued(status, cont):
    item = {"role": "assistant", "content": "Hel"}
    if status is not None:
        item["status"] = status
    assert conversation(request(input=[{"role": "user", "content": "Say hello"}, item]))[1] is cont


@pytest.mark.parametrize("draining", [False, True])
def test_the_guard_refuses_responses_while_loading_or_draining(draining):
    from fastapi.testclient import TestClient

    from kvpilot.engine.server.api_server import build_app
    from kvpilot.engine.server.async_engine import AsyncEngine
    from kvpilot.engine.server.metrics import EngineMetrics
    from kvpilot.engine.server.state import ServerState

    state = ServerState(AsyncEngine(lambda: None), EngineMetrics("m"), "m", draining=draining)
    with TestClient(build_app(state)) as http:
        r = http.post("/v1/responses", json={"input": "hi"})
    assert r.status_code == 503
    assert ("draining" if draining else "still loading") in r.json()["error"]["message"]


class Decoder:
    """A tokenizer stand-in: token i is ``pieces[i]``."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)


@pytest.mark.parametrize(("pieces", "parser", "want"), [
    (["<think>", "a", "b", "</", "think>", "\n", "Hi"], "deepseek_r1", 5),  # up to the token ending the marker
    (["a", "b", "c"], "deepseek_r1", 3),  # never ended: all reasoning
    (["Hi", "!"], "qwen3", 0),  # qwen3 reasons only after a leading <think>
    (["<think>", "x", "</think>", "y"], "qwen3", 3),
])
def test_reasoning_tokens_count_up_to_the_end_marker(pieces, parser, want):
    from types import SimpleNamespace

    from kvpilot.engine.server.reasoning import get_reasoning_parser
    from kvpilot.engine.server.responses_api import ResponsesHandler
    from kvpilot.engine.server.serving import Choice

    chat = SimpleNamespace(reasoning=get_reasoning_parser(parser), ctx=SimpleNamespace(tokenizer=Decoder(pieces)))
    handler = ResponsesHandler(chat)
    choice = Choice(index=0, prompt_index=0, text="".join(pieces), token_ids=list(range(len(pieces))))
    run = SimpleNamespace(prep=SimpleNamespace(reasoning=True))
    assert handler.reasoning_tokens(run, choice) == want
    assert handler.reasoning_tokens(SimpleNamespace(prep=SimpleNamespace(reasoning=False)), choice) == 0
