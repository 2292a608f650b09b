"""``POST /v1/responses`` against a real ``kvpilot serve`` (embedded SmolLM2, greedy):
the official ``openai`` client's ``client.responses.create``, streamed and not; function
tools forced by ``tool_choice``; JSON output under ``text.format``; the conversation
mapping (compared token for token with the chat endpoint's render); the stream's events
(order, sequence numbers, the final response equal to the non-streamed one); and the
400s naming the field for what kvpilot refuses."""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

import jsonschema
import openai
import pytest

from .metrics_util import scrape, wait_metric

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
IDS = [
    (re.compile(r"chatcmpl-tool-[0-9a-f]{32}"), "chatcmpl-tool-ID"),
    (re.compile(r"\b(resp|msg|fc|rs)_[0-9a-f]{32}"), r"\1_ID"),
]


def normalised(value: Any) -> Any:
    """``value`` with the ids and times that differ from run to run replaced."""
    text = json.dumps(value)
    for pattern, repl in IDS:
        text = pattern.sub(repl, text)
    out = json.loads(text)
    if isinstance(out, dict) and "created_at" in out:
        out["created_at"] = 0
    return out


def events_of(http, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The (event name, data) pairs of a streamed ``/v1/responses`` request, checking
    the SSE framing: every event is an ``event:`` line, a ``data:`` line, a blank line."""
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    out = []
    for i in range(0, len(lines), 3):
        name, data, blank = [*lines[i:i + 3], "", "", ""][:3]
        assert name.startswith("event: ") and data.startswith("data: ") and blank == "", lines[i:i + 3]
        out.append((name[7:], json.loads(data[6:])))
    return out


def check_sequence(events: list[tuple[str, dict[str, Any]]]) -> None:
    """Each event's name is its type; sequence numbers count 0, 1, 2, ...; the stream
    opens with created and in_progress and ends with completed."""
    assert [name for name, _ in events] == [data["type"] for _, data in events]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    names = [name for name, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed"
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []


# ------------------------------------------------------------------ the openai client
def test_client_create_answers_like_the_chat_endpoint(client):
    """The same conversation through both APIs gives the same prompt and the same
    greedy answer: the Responses API runs the chat path."""
    r = client.responses.create(model=MODEL, input="What is 2+2?", instructions="Answer in one sentence.",
                                max_output_tokens=30, temperature=0)
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=30, temperature=0,
        messages=[{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": "What is 2+2?"}])
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.output_text == chat.choices[0].message.content
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].id.startswith("msg_")
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.to_dict()["store"] is False
    assert (r.model, r.instructions, r.temperature, r.top_p, r.max_output_tokens) == (
        MODEL, "Answer in one sentence.", 0.0, 1.0, 30)


def test_client_stream(client):
    plain = client.responses.create(model=MODEL, input="Name three fruits.", max_output_tokens=20, temperature=0)
    events = list(client.responses.create(model=MODEL, input="Name three fruits.", max_output_tokens=20,
                                          temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text
    done = events[-1]
    assert done.type == "response.completed"
    assert done.response.output_text == plain.output_text
    assert done.response.usage.output_tokens == plain.usage.output_tokens


def test_client_function_call_forced_by_name(client):
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
                                temperature=0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and r.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("chatcmpl-tool-") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert r.tool_choice.name == "get_weather" and r.tools[0].name == "get_weather"


def test_client_function_call_required_streamed(client):
    events = list(client.responses.create(model=MODEL, input="What is the weather in Oslo?", tools=[WEATHER],
                                          tool_choice="required", parallel_tool_calls=False,
                                          max_output_tokens=60, temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"]
    assert added[0].item.arguments == "" and added[0].item.status == "in_progress"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == deltas and done.name == "get_weather"
    jsonschema.validate(json.loads(done.arguments), WEATHER["parameters"])
    final = events[-1].response.output
    assert [item.type for item in final] == ["function_call"]
    assert final[0].arguments == deltas and final[0].call_id == added[0].item.call_id


@pytest.mark.parametrize("stream", [False, True])
def test_client_json_schema_output_matches(client, stream):
    kw = dict(model=MODEL, input="Invent a person.", max_output_tokens=40, temperature=0,
              text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    if stream:
        events = list(client.responses.create(**kw, stream=True))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert events[-1].response.output_text == text
    else:
        r = client.responses.create(**kw)
        assert r.status == "completed" and r.text.format.type == "json_schema"
        text = r.output_text
    jsonschema.validate(json.loads(text), PERSON)


def test_client_json_object_output_parses(client):
    r = client.responses.create(model=MODEL, input="Give a JSON object with a color.", max_output_tokens=30,
                                temperature=0, text={"format": {"type": "json_object"}})
    assert r.status == "completed"
    assert isinstance(json.loads(r.output_text), dict)


# ------------------------------------------------------------------ the event stream
def test_stream_events_and_final_response_equal_the_non_streamed_answer(http):
    body = {"model": MODEL, "input": "Count to five.", "max_output_tokens": 12, "temperature": 0,
            "ignore_eos": True, "metadata": {"case": "stream"}}
    # Each request its own cache salt: neither finds the other's prompt in the prefix
    # cache, so their usage (cached_tokens) is the same.
    whole = http.post("/v1/responses", json={**body, "cache_salt": uuid.uuid4().hex})
    assert whole.status_code == 200, whole.text
    events = events_of(http, {**body, "cache_salt": uuid.uuid4().hex})
    check_sequence(events)
    names = [name for name, _ in events]
    deltas = [d for n, d in events if n == "response.output_text.delta"]
    assert names == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * len(deltas)
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.completed"])
    text = "".join(d["delta"] for d in deltas)
    item_id = events[2][1]["item"]["id"]
    assert all(d["item_id"] == item_id and d["output_index"] == 0 and d["content_index"] == 0 for d in deltas)
    assert events[-4][1]["text"] == text and events[-3][1]["part"]["text"] == text
    assert events[-2][1]["item"] == events[-1][1]["response"]["output"][0]
    assert events[-1][1]["response"]["output"][0]["id"] == item_id
    # The final response is the non-streamed answer (ids and times aside), field for field.
    assert normalised(events[-1][1]["response"]) == normalised(whole.json())
    assert whole.json()["status"] == "incomplete"  # ignore_eos: max_output_tokens cut it
    assert whole.json()["incomplete_details"] == {"reason": "max_output_tokens"}
    assert whole.json()["metadata"] == {"case": "stream"} and whole.json()["store"] is False


def test_stream_of_a_forced_call_equals_the_non_streamed_answer(http):
    body = {"model": MODEL, "input": "What is the weather in Rome?", "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 60, "temperature": 0}
    whole = http.post("/v1/responses", json={**body, "cache_salt": uuid.uuid4().hex}).json()
    events = events_of(http, {**body, "cache_salt": uuid.uuid4().hex})
    check_sequence(events)
    names = [n for n, _ in events]
    k = names.count("response.function_call_arguments.delta")
    assert k >= 1
    assert names == (["response.created", "response.in_progress", "response.output_item.added"]
                     + ["response.function_call_arguments.delta"] * k
                     + ["response.function_call_arguments.done", "response.output_item.done", "response.completed"])
    assert normalised(events[-1][1]["response"]) == normalised(whole)


def test_x_request_id_names_the_response(http):
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi.", "max_output_tokens": 2},
                  headers={"X-Request-Id": "abc-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-1"
    assert r.json()["id"] == "resp_abc-1"


# ------------------------------------------------------------------ the conversation
def render(http, path: str, body: dict[str, Any]) -> list[int]:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()["token_ids"]


def test_items_render_as_the_equivalent_chat_messages(http):
    """Earlier output items sent back (a call, its output) and the instructions give
    exactly the prompt of the chat messages they stand for."""
    first = http.post("/v1/responses", json={
        "model": MODEL, "input": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
        "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 60, "temperature": 0}).json()
    call = first["output"][0]
    assert call["type"] == "function_call"
    follow_up = {"model": MODEL, "instructions": "Be brief.", "tools": [WEATHER], "tool_choice": "none",
                 "input": [{"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                              "text": "Weather in Paris?"}]},
                           *first["output"],
                           {"type": "function_call_output", "call_id": call["call_id"], "output": "22 C, sunny"}]}
    chat = {"model": MODEL, "tool_choice": "none",
            "tools": [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": call["call_id"], "type": "function",
                              "function": {"name": call["name"], "arguments": call["arguments"]}}]},
                         {"role": "tool", "tool_call_id": call["call_id"], "content": "22 C, sunny"}]}
    ids = render(http, "/v1/responses/render", follow_up)
    assert ids == render(http, "/v1/chat/completions/render", chat)
    r = http.post("/v1/responses", json={**follow_up, "max_output_tokens": 8})
    assert r.status_code == 200 and r.json()["output"][0]["type"] == "message"
    assert r.json()["usage"]["input_tokens"] == len(ids)


def test_items_the_openai_sdk_dumps_are_accepted_back(client, http):
    """``[o.model_dump() for o in r.output]`` carries the SDK's own null fields (``phase``,
    ``async_``, ``caller``, ``namespace``) and ``truncation`` the answer's value: sent back,
    they render as the items do without them."""
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=60,
                                    temperature=0)
    assert first.truncation == "disabled"
    call_output = {"type": "function_call_output", "call_id": first.output[0].call_id, "output": "22 C"}
    bodies = [{"model": MODEL, "tools": [WEATHER], "tool_choice": "none", "truncation": first.truncation,
               "input": [{"role": "user", "content": "Weather in Paris?"},
                         *items, call_output]}
              for items in ([o.model_dump() for o in first.output],
                            [o.model_dump(by_alias=True) for o in first.output],
                            [o.model_dump(exclude_none=True) for o in first.output])]
    rendered = [render(http, "/v1/responses/render", body) for body in bodies]
    assert rendered[0] == rendered[1] == rendered[2]
    answer = client.responses.create(**{**bodies[0], "max_output_tokens": 4})
    assert answer.status in ("completed", "incomplete") and answer.output[0].type == "message"


def test_previous_input_messages_come_before_the_input_without_their_system_messages(http):
    body = {"model": MODEL, "instructions": "Now.", "input": "And 3+3?",
            "previous_input_messages": [{"role": "system", "content": "Then."},
                                        {"role": "user", "content": "What is 2+2?"},
                                        {"role": "assistant", "content": "4."}]}
    chat = {"model": MODEL, "messages": [{"role": "system", "content": "Now."},
                                         {"role": "user", "content": "What is 2+2?"},
                                         {"role": "assistant", "content": "4."},
                                         {"role": "user", "content": "And 3+3?"}]}
    assert render(http, "/v1/responses/render", body) == render(http, "/v1/chat/completions/render", chat)
    # An empty input adds no user message after them (vLLM's rule).
    empty = render(http, "/v1/responses/render", {**body, "input": ""})
    assert empty == render(http, "/v1/chat/completions/render", {**chat, "messages": chat["messages"][:3]})


def test_an_unfinished_assistant_message_last_is_continued(http):
    body = {"model": MODEL, "input": [{"role": "user", "content": "Say hello."},
                                      {"type": "message", "role": "assistant", "status": "incomplete",
                                       "content": [{"type": "output_text", "text": "Hello"}]}]}
    chat = {"model": MODEL, "continue_final_message": True, "add_generation_prompt": False,
            "messages": [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello"}]}
    assert render(http, "/v1/responses/render", body) == render(http, "/v1/chat/completions/render", chat)


def test_render_names_the_sampling_parameters_that_would_run(http):
    r = http.post("/v1/responses/render", json={"model": MODEL, "input": "Hi.", "max_output_tokens": 7,
                                                "temperature": 0.5, "stop": ["x"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["request_id"].startswith("resp-") and body["stream_options"] is None
    sp = body["sampling_params"]
    assert (sp["max_tokens"], sp["temperature"], sp["stop"]) == (7, 0.5, ["x"])


# ------------------------------------------------------------------ metrics and abort
def test_a_response_counts_in_the_metrics_like_a_chat_completion(http, server):
    before = scrape(server.url).get("kvpilot:request_success_total[('finished_reason', 'length')]", 0)
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi.", "max_output_tokens": 3,
                                         "ignore_eos": True})
    assert r.status_code == 200
    wait_metric(server.url, "kvpilot:request_success_total[('finished_reason', 'length')]",
                lambda v: v == before + 1)


def test_a_stream_the_client_leaves_is_aborted(http, server):
    wait_metric(server.url, "kvpilot:num_requests_running", lambda v: v == 0)
    aborted = scrape(server.url).get("kvpilot:request_success_total[('finished_reason', 'abort')]", 0)
    body = {"model": MODEL, "input": "Tell me a very long story.", "max_output_tokens": 900, "ignore_eos": True,
            "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("event: response.output_text.delta")
            if seen == 3:
                assert scrape(server.url)["kvpilot:num_requests_running"] == 1
                break
    t0 = time.monotonic()
    wait_metric(server.url, "kvpilot:num_requests_running", lambda v: v == 0)
    assert time.monotonic() - t0 < 10
    wait_metric(server.url, "kvpilot:request_success_total[('finished_reason', 'abort')]", lambda v: v > aborted)


# ------------------------------------------------------------------ refused
@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"background": True}, "background", "kvpilot stores no responses"),
        ({"previous_response_id": "resp_123"}, "previous_response_id", "'resp_123' cannot be used"),
        ({"reasoning": {"effort": "low"}}, "reasoning", "unknown or unsupported field"),
        ({"truncation": "auto"}, "truncation", "'disabled'"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "async": True}]},
         "input.0.async", "asynchronous function calls are not supported"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "async": 0}]},
         "input.0.async", "valid boolean"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}",
                     "namespace": "ns"}]}, "input.0.namespace", "None"),
        ({"no_such_field": 1}, "no_such_field", "unknown or unsupported field"),
        ({"input": 5}, "input", "a string (one user message) or a list of input items"),
        ({"input": []}, "input", "at least 1 item"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0", "item_reference needs stored responses"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
         "input.0.content.0.type", "'input_text' or 'output_text'"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input.0.role", "'user'"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id", "Field required"),
        ({"temperature": "hot"}, "temperature", "valid number"),
        ({"max_output_tokens": "ten"}, "max_output_tokens", "valid integer"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"max_output_tokens": 5000}, "max_output_tokens", "lower max_output_tokens to at most"),
        ({"input": "x" * 200000}, "input", "characters cannot fit"),
        ({"stream": 1}, "stream", "valid boolean"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "'function'"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "'nope'"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"text": {"format": {"type": "json_schema", "name": "p"}}}, "text.format.schema", "Field required"),
        ({"text": {"format": {"type": "xml"}}}, "text.format", "text, json_object or json_schema"),
        ({"text": {"format": {"type": "json_object"}}, "tools": [WEATHER], "tool_choice": "required"},
         "text.format", "give only one of them"),
        ({"model": "nope"}, "model", "does not exist"),
    ],
)
def test_refused_with_a_400_naming_the_field(http, body, param, words):
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi.", "max_output_tokens": 4, **body})
    assert r.status_code == (404 if param == "model" else 400), r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert words in err["message"], err


def test_the_client_sees_the_refusal(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hi.", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"
