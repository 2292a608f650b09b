"""The agentic API through the official `openai` client: structured outputs
(`response_format`, `structured_outputs`, `guided_*`), tool calls (`auto` parsed by the
hermes parser, `required`, a named function, `none`), `logit_bias`, unknown fields
refused by name, and bad constraints refused with the engine serving on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
SCHEMAS = json.loads((Path(__file__).parents[3] / "benchmarks/data/structured_schemas.json").read_text())["schemas"]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}},
                       "required": ["zone"]},
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_json_schema_strict_and_not_chat_and_completions_n_and_stream(client):
    schema = SCHEMAS["person"]
    for strict in (True, False):
        r = client.chat.completions.create(model=MODEL,
            messages=[{"role": "user", "content": "Invent a person."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": strict}},
            n=3, temperature=1.0, max_tokens=150, seed=int(strict))
        assert len(r.choices) == 3
        for c in r.choices:
            assert c.finish_reason == "stop", c.message.content
            jsonschema.validate(json.loads(c.message.content), schema)
    stream = client.chat.completions.create(model=MODEL,
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
        n=2, temperature=0.9, max_tokens=150, stream=True)
    texts = {0: "", 1: ""}
    reasons = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert reasons == {0: "stop", 1: "stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), schema)
    r = client.completions.create(model=MODEL, prompt="A person as JSON:", max_tokens=150,
                                  temperature=1.0, n=2,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "p", "schema": schema}}})
    for c in r.choices:
        jsonschema.validate(json.loads(c.text), schema)


def test_json_object_and_vllm_extensions(client):
    # json_object constrains the syntax, not the length: a 135M model sampling freely can
    # stay inside one string past any max_tokens. Greedy decoding on a prompt that asks for
    # a small object must stop with one; sampled choices that stop must parse too.
    ask = [{"role": "user", "content": "Give the weather in Paris as a JSON object with the keys city and temperature."}]
    r = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=200,
                                       response_format={"type": "json_object"}, temperature=0)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert json.loads(r.choices[0].message.content)["city"] == "Paris"
    r = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=200, n=4, seed=7,
                                       response_format={"type": "json_object"}, temperature=0.7)
    stopped = [c for c in r.choices if c.finish_reason == "stop"]
    assert stopped, [c.message.content for c in r.choices]
    for c in stopped:
        assert isinstance(json.loads(c.message.content), dict), c.message.content
    for c in r.choices:
        assert c.message.content.startswith("{"), c.message.content
    cases = [
        ({"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}}, lambda t: re.fullmatch(r"\d{4}-\d{2}-\d{2}", t)),
        ({"structured_outputs": {"choice": ["sunny", "rainy"]}}, lambda t: t in ("sunny", "rainy")),
        ({"structured_outputs": {"grammar": 'root ::= "temp=" [0-9] [0-9]? "C"'}}, lambda t: re.fullmatch(r"temp=\d+C", t)),
        ({"structured_outputs": {"json": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}}},
         lambda t: isinstance(json.loads(t), list)),
        ({"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
         lambda t: isinstance(json.loads(t)["ok"], bool)),
        ({"guided_regex": "(yes|no)!"}, lambda t: t in ("yes!", "no!")),
        ({"guided_choice": ["a", "b"]}, lambda t: t in ("a", "b")),
        ({"guided_grammar": 'root ::= "x" | "y"', "guided_decoding_backend": "xgrammar"}, lambda t: t in ("x", "y")),
    ]
    for extra, check in cases:
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40,
                                           temperature=1.0, extra_body=extra)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop" and check(text), (extra, text)
        c = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=40,
                                      temperature=1.0, extra_body=extra)
        assert check(c.choices[0].text), (extra, c.choices[0].text)


def test_max_tokens_cut_is_length_not_stop(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "p", "schema": SCHEMAS["person"]}})
    assert r.choices[0].finish_reason == "length"


def test_tool_choice_named_required_and_none(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       max_tokens=80, temperature=0.8, n=2)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME],
                                       tool_choice="required", max_tokens=150, temperature=0.8, seed=3)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    schemas = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
    for call in c.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME],
                                       tool_choice="required", parallel_tool_calls=False, max_tokens=150)
    assert len(r.choices[0].message.tool_calls) == 1
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER],
                                       tool_choice="none", max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls == [] and r.choices[0].finish_reason in ("stop", "length")


def test_named_and_required_tool_calls_stream_like_vllm(client):
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                tools=[WEATHER, TIME], tool_choice=choice, max_tokens=150,
                                                stream=True, temperature=0.5)
        calls: dict[int, dict] = {}
        finish = None
        for chunk in stream:
            for c in chunk.choices:
                for d in c.delta.tool_calls or []:
                    if d.id is not None:  # the first delta of a call: id, type, name
                        assert d.index not in calls and d.type == "function" and d.function.name
                        calls[d.index] = {"name": d.function.name, "arguments": d.function.arguments or ""}
                    else:
                        calls[d.index]["arguments"] += d.function.arguments or ""
                finish = c.finish_reason or finish
        assert finish == "tool_calls" and calls, choice
        for call in calls.values():
            schema = WEATHER if call["name"] == "get_weather" else TIME
            jsonschema.validate(json.loads(call["arguments"]), schema["function"]["parameters"])


def test_auto_tool_calls_are_parsed_by_the_hermes_parser(client):
    # The embedded model has no tool-call training: bias it into writing a Hermes call.
    # Its output then goes through the parser exactly as a real tool model's would.
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER],
                                       max_tokens=20, temperature=0)
    assert r.choices[0].message.tool_calls == []  # plain text: no calls, content kept
    assert r.choices[0].message.content
    # A constrained answer in Hermes's format: the parser turns it into a call.
    grammar = 'root ::= "<tool_call>" "{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"Paris\\"}}" "</tool_call>"'
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER],
                                       tool_choice="auto", max_tokens=60, extra_body={"guided_grammar": grammar})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert c.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER],
                                            max_tokens=60, stream=True, extra_body={"guided_grammar": grammar})
    args, names, content, finish = "", [], "", None
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                if d.function.name:
                    names.append(d.function.name)
                args += d.function.arguments or ""
            finish = ch.finish_reason or finish
    assert names == ["get_weather"] and json.loads(args) == {"city": "Paris"} and "<tool_call>" not in content
    assert finish == "tool_calls"


def test_earlier_tool_calls_and_results_render_in_the_conversation(client):
    history = [*MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "chatcmpl-tool-1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "21 C and sunny"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                       tool_choice="none", max_tokens=8, temperature=0)
    assert r.choices[0].message.content is not None


def test_logit_bias(client, http):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1,
                                  temperature=0)
    first = r.choices[0].text
    tok = http.post("/tokenize", json={"prompt": first, "add_special_tokens": False}).json()["tokens"][0]
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1,
                                  temperature=0, logit_bias={str(tok): -100})
    assert r.choices[0].text != first


@pytest.mark.parametrize(("body", "param", "text"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format", 'Unsupported type "wat"'),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "regular expression cannot be compiled"),
    ({"guided_grammar": "root ::= foo"}, "guided_grammar", 'Rule "foo" is not defined'),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "give only one"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope' is not among the tools (get_weather)"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools", "must be a JSON schema with \"type\": \"object\""),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "give only one"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "keys must be token ids"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5", "less than or equal to 100"),
    ({"no_such_field": 1}, "no_such_field", "unknown or unsupported field"),
    ({"functions": [{"name": "f"}]}, "functions", "unknown or unsupported field"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "auto"),
    ({"structured_outputs": {"choice": ["a"], "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "unknown or unsupported field"),
    ({"min_tokens": 30, "max_tokens": 40, "guided_choice": ["yes"]}, "guided_choice", "min_tokens"),
    # Field paths without pydantic's union tags (found by a new-user trial).
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "string"}}},
     "response_format.json_schema.schema", "valid dictionary"),
    ({"tool_choice": "requried", "tools": [WEATHER]}, "tool_choice", "'none', 'auto' or 'required'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "intger"}}}}}], "tool_choice": "required"},
     "tools", "intger"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
    # SGLang's fields that vllm-router sends: only their defaults are accepted.
    ({"no_stop_trim": True}, "no_stop_trim", "Input should be False (got True)"),
    ({"separate_reasoning": False}, "separate_reasoning", "Input should be True (got False)"),
    ({"return_hidden_states": True}, "return_hidden_states", "Input should be False"),
])
def test_bad_constraints_are_400s_naming_the_field_and_the_engine_serves_on(http, body, param, text):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and text in err["message"], err
    ok = http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"].startswith(" Paris")


def test_a_dead_end_grammar_mid_stream_ends_with_an_error_event(http):
    body = {"messages": MESSAGES, "max_tokens": 40, "min_tokens": 30, "guided_choice": ["yes"], "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "invalid_request_error" and "min_tokens" in err["message"]


def test_openai_client_errors_are_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                       extra_body={"guided_regex": "(unclosed"})
    assert "guided_regex" in str(e.value)


def test_prompt_logprobs_on_completions_and_chat(http):
    r = http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 1,
                                           "temperature": 0, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    ids = http.post("/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    block = r.json()["choices"][0]["prompt_logprobs"]
    assert len(block) == len(ids) and block[0] is None
    for pos, entry in enumerate(block[1:], start=1):
        own = entry[str(ids[pos])]
        assert own["logprob"] <= 0 and own["rank"] >= 1
        ranks = sorted(v["rank"] for k, v in entry.items() if k != str(ids[pos]) or v["rank"] <= 2)
        assert ranks[:2] == [1, 2]
    chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 0})
    assert chat.status_code == 200 and chat.json()["prompt_logprobs"][0] is None
    streamed = http.post("/v1/completions", json={"prompt": "x", "stream": True, "prompt_logprobs": 1})
    assert streamed.status_code == 400 and "stream" in streamed.json()["error"]["message"]


# What vllm-router 0.1.17 forwards for a plain request (captured from the router in front
# of a recording server): SGLang's fields with their defaults ride along on every request.
ROUTER_CHAT_EXTRAS = {"stream": False, "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
                      "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
                      "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True}
ROUTER_COMPLETION_EXTRAS = {"stream": False, "echo": False, "no_stop_trim": False, "ignore_eos": False,
                            "skip_special_tokens": True, "return_hidden_states": False}


def test_bodies_as_vllm_router_forwards_them_are_served(http):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **ROUTER_CHAT_EXTRAS})
    assert r.status_code == 200, r.text
    r = http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 2,
                                           "temperature": 0, **ROUTER_COMPLETION_EXTRAS})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(" Paris"), r.text


def test_a_function_without_parameters_is_called_with_an_empty_object(http):
    """Found by a new-user trial: under `required` a tool without `parameters` got an
    open object and the model filled it with junk keys until `length`."""
    tools = [{"type": "function", "function": {"name": "noargs"}}]
    for choice in ("required", {"type": "function", "function": {"name": "noargs"}}):
        r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 30, "tools": tools,
                                                    "tool_choice": choice, "temperature": 1.0, "seed": 3,
                                                    "parallel_tool_calls": False})
        body = r.json()
        assert r.status_code == 200, body
        calls = body["choices"][0]["message"]["tool_calls"]
        assert calls and all(c["function"]["name"] == "noargs" and json.loads(c["function"]["arguments"]) == {}
                             for c in calls), calls


def test_required_calls_cut_by_max_tokens_agree_streamed_and_not(http):
    """Found by a new-user trial: a `required` array cut by `max_tokens` returned no call
    (the text as content) while the stream had already sent the complete ones. Both now
    give the calls completed before the cut, with `finish_reason: length`."""
    tools = [{"type": "function", "function": {"name": "noargs"}}]
    body = {"messages": MESSAGES, "max_tokens": 30, "tools": tools, "tool_choice": "required",
            "temperature": 1.0, "seed": 3}
    plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    streamed_calls, finish = [], None
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed_calls += [t["function"]["name"] for t in c["delta"].get("tool_calls", ())
                                       if "id" in t]
                    finish = c.get("finish_reason") or finish
    calls = [c["function"]["name"] for c in plain["message"]["tool_calls"] or []]
    if plain["finish_reason"] == "length":
        assert calls == streamed_calls and finish == "length" and calls, (plain, streamed_calls)
    else:
        assert plain["finish_reason"] == finish == "tool_calls" and calls == streamed_calls
