"""The server's wire bytes, compared byte for byte with golden files.

Each case sends one request to the session's ``kvpilot serve`` (embedded SmolLM2, greedy)
and compares the response (status line, content type and the exact body bytes; an SSE
stream as it arrived) with ``golden/<case>.http``. Only values that differ from run to
run are replaced by fixed tokens before the comparison: request, response, output item
and tool-call ids, ``created`` (``created_at``), ``instance_id`` and, where ``n`` > 1,
``cached_tokens``. Nothing else is normalised: key order, separators,
escaping, floats and event framing must all stay what they are.

Every generation case starts its prompt with its own name, so no case hits a prefix-cache
block of another request (the usage's ``cached_tokens`` and the prefill's numerics stay
the same whatever ran before).

Floats are the one exception to byte equality: a logprob is the model's arithmetic, and
another CPU (AVX-512 on Intel or AMD, other kernel paths) rounds its last digits
differently. Every float literal must be where the golden file has one, written the
same way (``json.dumps``'s shortest repr), and equal to it within 1e-4; everything
between the floats is compared byte for byte.

Regenerate the files with ``KVPILOT_REGEN_GOLDEN=1`` (then read the diff: a change here
is a change of the API's wire format).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

GOLDEN = Path(__file__).parent / "golden"
REGEN = os.environ.get("KVPILOT_REGEN_GOLDEN") == "1"
MODEL = "SmolLM2-135M-Instruct"

# (pattern, replacement) applied to the body bytes, in order.
NORMALISE: list[tuple[re.Pattern[bytes], bytes]] = [
    (re.compile(rb"chatcmpl-tool-[0-9a-f]{32}"), b"chatcmpl-tool-ID"),
    (re.compile(rb"(chatcmpl|cmpl)-[0-9a-f]{32}"), rb"\1-ID"),
    (re.compile(rb"\b(resp|msg|fc|rs)([-_])[0-9a-f]{32}"), rb"\1\2ID"),
    (re.compile(rb'("created(?:_at)?":\s*)\d+'), rb"\g<1>0"),
    (re.compile(rb'("instance_id":\s*")[^"]*"'), rb'\g<1>ID"'),
]

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
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def chat(case: str, text: str, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "system", "content": f"Case {case}."},
                                         {"role": "user", "content": text}],
            "temperature": 0, **kw}


def response(case: str, question: str, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "instructions": f"Case {case}.", "input": question, "temperature": 0, **kw}


def completion(case: str, text: str, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": f"Case {case}. {text}", "temperature": 0, **kw}


# name -> (method, path, JSON body or None, extra headers or None)
CASES: dict[str, tuple[str, str, Any, dict[str, str] | None]] = {
    # chat completions
    "chat_plain": ("POST", "/v1/chat/completions", chat("chat_plain", "What is 2+2?", max_tokens=12), None),
    "chat_stream": ("POST", "/v1/chat/completions",
                    chat("chat_stream", "Name three fruits.", max_tokens=12, stream=True,
                         stream_options={"include_usage": True}), None),
    "chat_tool_named": ("POST", "/v1/chat/completions",
                        chat("chat_tool_named", "What is the weather in Paris?", tools=[WEATHER],
                             tool_choice={"type": "function", "function": {"name": "get_weather"}},
                             max_tokens=40), None),
    "chat_tool_named_stream": ("POST", "/v1/chat/completions",
                               chat("chat_tool_named_stream", "What is the weather in Rome?", tools=[WEATHER],
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                    max_tokens=40, stream=True), None),
    "chat_tool_required": ("POST", "/v1/chat/completions",
                           chat("chat_tool_required", "What is the weather in Oslo?", tools=[WEATHER],
                                tool_choice="required", max_tokens=60), None),
    "chat_tool_auto": ("POST", "/v1/chat/completions",
                       chat("chat_tool_auto", "Say hello.", tools=[WEATHER], tool_choice="auto",
                            max_tokens=10), None),
    "chat_tool_none": ("POST", "/v1/chat/completions",
                       chat("chat_tool_none", "Say hello.", tools=[WEATHER], tool_choice="none",
                            max_tokens=8), None),
    "chat_json_schema": ("POST", "/v1/chat/completions",
                         chat("chat_json_schema", "Invent a person.", max_tokens=40,
                              response_format={"type": "json_schema",
                                               "json_schema": {"name": "person", "schema": PERSON}}), None),
    "chat_json_schema_stream": ("POST", "/v1/chat/completions",
                                chat("chat_json_schema_stream", "Invent a person.", max_tokens=40, stream=True,
                                     response_format={"type": "json_schema",
                                                      "json_schema": {"name": "person", "schema": PERSON}}), None),
    "chat_logprobs": ("POST", "/v1/chat/completions",
                      chat("chat_logprobs", "Say yes.", max_tokens=4, logprobs=True, top_logprobs=2), None),
    "chat_logprobs_stream": ("POST", "/v1/chat/completions",
                             chat("chat_logprobs_stream", "Say no.", max_tokens=4, logprobs=True, top_logprobs=2,
                                  stream=True), None),
    "chat_n2": ("POST", "/v1/chat/completions", chat("chat_n2", "Say hi.", max_tokens=5, n=2), None),
    "chat_request_id": ("POST", "/v1/chat/completions", chat("chat_request_id", "Hi.", max_tokens=3),
                        {"X-Request-Id": "golden-1"}),
    "chat_render": ("POST", "/v1/chat/completions/render",
                    chat("chat_render", "Hi.", max_tokens=3, seed=1), None),
    # the Responses API
    "resp_plain": ("POST", "/v1/responses", response("resp_plain", "What is 2+2?", max_output_tokens=12), None),
    "resp_stream": ("POST", "/v1/responses", response("resp_stream", "Name three fruits.", max_output_tokens=8,
                                                      stream=True), None),
    "resp_tool_named": ("POST", "/v1/responses",
                        response("resp_tool_named", "What is the weather in Paris?",
                                 tools=[{"type": "function", **WEATHER["function"]}],
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40),
                        None),
    "resp_tool_named_stream": ("POST", "/v1/responses",
                               response("resp_tool_named_stream", "What is the weather in Rome?",
                                        tools=[{"type": "function", **WEATHER["function"]}],
                                        tool_choice={"type": "function", "name": "get_weather"},
                                        max_output_tokens=40, stream=True), None),
    "resp_json_schema": ("POST", "/v1/responses",
                         response("resp_json_schema", "Invent a person.", max_output_tokens=40,
                                  text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}}),
                         None),
    "resp_request_id": ("POST", "/v1/responses", response("resp_request_id", "Hi.", max_output_tokens=3),
                        {"X-Request-Id": "golden-2"}),
    "resp_render": ("POST", "/v1/responses/render", response("resp_render", "Hi.", max_output_tokens=3, seed=1),
                    None),
    "err_resp_background": ("POST", "/v1/responses", response("err", "Hi.", background=True), None),
    "err_resp_previous_response_id": ("POST", "/v1/responses",
                                      response("err", "Hi.", previous_response_id="resp_1"), None),
    "err_resp_bad_item": ("POST", "/v1/responses",
                          {"model": MODEL, "input": [{"type": "item_reference", "id": "msg_1"}]}, None),
    # completions
    "cmpl_plain": ("POST", "/v1/completions", completion("cmpl_plain", "The capital of France is", max_tokens=8),
                   None),
    "cmpl_stream": ("POST", "/v1/completions",
                    completion("cmpl_stream", "The capital of Italy is", max_tokens=8, stream=True,
                               stream_options={"include_usage": True}), None),
    "err_echo_logprobs": ("POST", "/v1/completions",
                           completion("cmpl_echo_logprobs", "One, two,", max_tokens=3, echo=True, logprobs=2),
                           None),
    "cmpl_echo": ("POST", "/v1/completions", completion("cmpl_echo", "Five, six,", max_tokens=3, echo=True), None),
    "cmpl_logprobs": ("POST", "/v1/completions",
                      completion("cmpl_logprobs", "Seven, eight,", max_tokens=3, logprobs=2), None),
    "cmpl_logprobs_stream": ("POST", "/v1/completions",
                             completion("cmpl_logprobs_stream", "Three, four,", max_tokens=3, logprobs=1,
                                        stream=True), None),
    "cmpl_batch": ("POST", "/v1/completions",
                   {"model": MODEL, "prompt": ["Case cmpl_batch a. 1, 2,", "Case cmpl_batch b. A, B,"],
                    "max_tokens": 3, "temperature": 0}, None),
    "cmpl_n2": ("POST", "/v1/completions", completion("cmpl_n2", "Red, green,", max_tokens=3, n=2), None),
    "cmpl_json_schema": ("POST", "/v1/completions",
                         completion("cmpl_json_schema", "A person as JSON:", max_tokens=40,
                                    response_format={"type": "json_schema",
                                                     "json_schema": {"name": "person", "schema": PERSON}}), None),
    "cmpl_render": ("POST", "/v1/completions/render", completion("cmpl_render", "Hi", max_tokens=3), None),
    # other endpoints
    "models": ("GET", "/v1/models", None, None),
    "openapi": ("GET", "/openapi.json", None, None),
    "health": ("GET", "/health", None, None),
    "ready": ("GET", "/ready", None, None),
    "tokenize_prompt": ("POST", "/tokenize", {"model": MODEL, "prompt": "Hello world"}, None),
    "tokenize_messages": ("POST", "/tokenize",
                          {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]}, None),
    "detokenize": ("POST", "/detokenize", {"model": MODEL, "tokens": [19556, 905]}, None),
    "get_server_info": ("GET", "/get_server_info", None, None),
    "get_load": ("GET", "/get_load", None, None),
    "kv_event_sources_off": ("GET", "/kv_event_sources", None, None),
    # errors
    "err_unknown_field": ("POST", "/v1/chat/completions", chat("err", "Hi.", max_tokens=3, foo=1), None),
    "err_bad_value": ("POST", "/v1/completions", completion("err", "Hi", max_tokens=3, temperature=-1), None),
    "err_bad_type": ("POST", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, None),
    "err_top_logprobs": ("POST", "/v1/chat/completions", chat("err", "Hi.", max_tokens=3, top_logprobs=2), None),
    "err_too_long": ("POST", "/v1/completions", completion("err", "Hi", max_tokens=5000), None),
    "err_unknown_model": ("POST", "/v1/chat/completions", {**chat("err", "Hi."), "model": "nope"}, None),
    "err_unknown_model_cmpl": ("POST", "/v1/completions", {**completion("err", "Hi"), "model": "nope"}, None),
    "err_unknown_model_tokenize": ("POST", "/tokenize", {"model": "nope", "prompt": "Hi"}, None),
    "err_bad_token": ("POST", "/detokenize", {"model": MODEL, "tokens": [10**9]}, None),
    "err_not_json": ("POST", "/v1/completions", b"{not json", None),
    "err_no_path": ("GET", "/v1/nothing", None, None),
    "err_method": ("GET", "/v1/completions", None, None),
    "err_no_key": ("GET", "/v1/models", None, {"Authorization": ""}),
    "err_wrong_key": ("GET", "/v1/models", None, {"Authorization": "Bearer wrong"}),
}


# Cases with n > 1: the choices of one request are admitted in one step or one after the
# other, as the engine thread's timing falls; a later one reuses the first's prompt blocks,
# so their usage's cached_tokens varies from run to run (the answers do not).
CACHED_TOKENS = re.compile(rb'("cached_tokens":\s*)\d+')
RACY_CACHE = {"chat_n2", "cmpl_n2"}


def normalise(body: bytes, case: str) -> bytes:
    for pattern, repl in NORMALISE:
        body = pattern.sub(repl, body)
    if case in RACY_CACHE:
        body = CACHED_TOKENS.sub(rb"\g<1>N", body)
    return body


def wire(response: Any, body: bytes, case: str) -> bytes:
    head = f"{response.status_code} {response.headers.get('content-type', '')}\n"
    request_id = response.headers.get("x-request-id")
    if request_id is not None:
        head += f"x-request-id: {request_id}\n"
    return head.encode() + b"\n" + normalise(body, case)


# A JSON number with a fraction or an exponent (integers are compared as bytes).
FLOAT = re.compile(rb"-?\d+(?:\.\d+(?:[eE][-+]?\d+)?|[eE][-+]?\d+)")
FLOAT_TOLERANCE = 1e-4


def assert_same_wire(got: bytes, want: bytes, case: str) -> None:
    """``got`` is ``want`` byte for byte outside float literals; the floats are equal
    within FLOAT_TOLERANCE (absolute or relative) and as many."""
    hint = "(regenerate with KVPILOT_REGEN_GOLDEN=1 if meant)"
    assert FLOAT.sub(b"<float>", got) == FLOAT.sub(b"<float>", want), f"{case}: the wire bytes changed {hint}"
    got_f = [float(x) for x in FLOAT.findall(got)]
    want_f = [float(x) for x in FLOAT.findall(want)]
    off = [(i, g, w) for i, (g, w) in enumerate(zip(got_f, want_f, strict=True))
           if not math.isclose(g, w, rel_tol=FLOAT_TOLERANCE, abs_tol=FLOAT_TOLERANCE)]
    assert not off, f"{case}: floats (index, got, golden) differ beyond {FLOAT_TOLERANCE}: {off[:5]} {hint}"


def test_float_comparison_can_fail():
    """The float-tolerant comparison still catches what it must."""
    assert_same_wire(b'{"logprob":-0.91735124}', b'{"logprob":-0.91735121}', "same")
    with pytest.raises(AssertionError, match="floats"):
        assert_same_wire(b'{"logprob":-0.9}', b'{"logprob":-0.8}', "value")
    with pytest.raises(AssertionError, match="wire bytes"):
        assert_same_wire(b'{"logprob": -0.9}', b'{"logprob":-0.9}', "spacing")
    with pytest.raises(AssertionError, match="wire bytes"):
        assert_same_wire(b'{"logprob":-0.9,"rank":1}', b'{"logprob":-0.9,"rank":2}', "integer")


@pytest.mark.parametrize("case", list(CASES))
def test_wire_golden(http, case):
    method, path, body, headers = CASES[case]
    kwargs: dict[str, Any] = {"headers": headers}
    if isinstance(body, bytes):
        kwargs["content"] = body
        kwargs["headers"] = {**(headers or {}), "Content-Type": "application/json"}
    elif body is not None:
        kwargs["json"] = body
    with http.stream(method, path, **kwargs) as r:
        got = wire(r, r.read(), case)
    path_ = GOLDEN / f"{case}.http"
    if REGEN:
        GOLDEN.mkdir(exist_ok=True)
        path_.write_bytes(got)
        return
    assert path_.exists(), f"no golden file {path_.name}; run with KVPILOT_REGEN_GOLDEN=1"
    assert_same_wire(got, path_.read_bytes(), case)
