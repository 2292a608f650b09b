"""Tool-call parsers (kvpilot.engine.server.tool_parsers): each format's whole-output
parse from a table of real and malformed outputs, and the streamed deltas, which must
reassemble into exactly the whole-output parse however the text is split."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.server.tool_parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    ToolCall,
    get_tool_parser,
    new_tool_call_id,
)

OPENAI_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'

# (id, text, content, [(name, arguments)]) -- "SAME" means the content is the text stripped.
SAME = object()

HERMES_CASES = [
    ("plain", "Hello there!", SAME, []),
    ("empty", "", None, []),
    ("whitespace-only", "  \n ", None, []),
    ("single", f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", WEATHER_ARGS)]),
    (
        "content-before",
        f"Let me check the weather.\n\n<tool_call>\n{WEATHER}\n</tool_call>",
        "Let me check the weather.",
        [("get_weather", WEATHER_ARGS)],
    ),
    (
        "two-calls",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "Europe/Paris"}')],
    ),
    (
        "compact-json-normalized",
        '<tool_call>{"name":"add","arguments":{"a":1,"b":[2,3.5],"c":null,"d":true}}</tool_call>',
        None,
        [("add", '{"a": 1, "b": [2, 3.5], "c": null, "d": true}')],
    ),
    (
        "unicode-arguments",
        '<tool_call>{"name": "translate", "arguments": {"text": "Grüße aus 東京 🌧", "e": "\\u00e9"}}</tool_call>',
        None,
        [("translate", '{"text": "Grüße aus 東京 🌧", "e": "é"}')],
    ),
    (
        "deeply-nested-arguments",
        '<tool_call>{"name": "f", "arguments": {"a": {"b": {"c": [{"d": "}"}]}}}}</tool_call>',
        None,
        [("f", '{"a": {"b": {"c": [{"d": "}"}]}}}')],
    ),
    (
        "marker-inside-argument-string",
        '<tool_call>{"name": "echo", "arguments": {"s": "<tool_call>"}}</tool_call>',
        None,
        [("echo", '{"s": "<tool_call>"}')],
    ),
    (
        "unterminated-final-block",
        'Sure.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n',
        "Sure.",
        [("f", '{"x": 1}')],
    ),
    (
        "closed-then-unterminated",
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": {"y": "z"}}',
        None,
        [("f", "{}"), ("g", '{"y": "z"}')],
    ),
    ("unterminated-incomplete-json", 'Sure.<tool_call>{"name": "f", "argum', SAME, []),
    ("open-tag-only", "<tool_call>", SAME, []),
    ("invalid-json", '<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>', SAME, []),
    ("not-json", 'I will call it.<tool_call>get_weather(city="Paris")</tool_call>', SAME, []),
    ("missing-name", '<tool_call>{"arguments": {"x": 1}}</tool_call>', SAME, []),
    ("name-not-a-string", '<tool_call>{"name": 42, "arguments": {}}</tool_call>', SAME, []),
    ("empty-name", '<tool_call>{"name": "", "arguments": {}}</tool_call>', SAME, []),
    ("json-not-an-object", "<tool_call>[1, 2]</tool_call>", SAME, []),
    ("arguments-not-an-object", '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>', SAME, []),
    ("arguments-string-not-json", '<tool_call>{"name": "f", "arguments": "Paris"}</tool_call>', SAME, []),
    ("arguments-missing", '<tool_call>{"name": "get_time"}</tool_call>', None, [("get_time", "{}")]),
    ("arguments-null", '<tool_call>{"name": "get_time", "arguments": null}</tool_call>', None, [("get_time", "{}")]),
    (
        "arguments-json-string",
        '<tool_call>{"name": "f", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
        None,
        [("f", '{"city": "Paris"}')],
    ),
    (
        "parameters-alias",
        '<tool_call>{"name": "f", "parameters": {"q": "kv cache"}}</tool_call>',
        None,
        [("f", '{"q": "kv cache"}')],
    ),
    (
        "end-tag-inside-argument-string",
        '<tool_call>{"name": "echo", "arguments": {"s": "</tool_call>"}}</tool_call>',
        SAME,
        [],
    ),
    (
        "first-invalid-second-valid",
        '<tool_call>{oops}</tool_call>\n<tool_call>{"name": "f", "arguments": {}}</tool_call>',
        SAME,
        [],
    ),
    (
        "text-after-calls",
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>\nDone.',
        "Done.",
        [("f", "{}")],
    ),
    (
        "text-between-calls",
        'A <tool_call>{"name": "f", "arguments": {}}</tool_call> B <tool_call>{"name": "g", "arguments": {}}</tool_call>',
        "A  B",
        [("f", "{}"), ("g", "{}")],
    ),
    ("near-miss-markers", "Use <tool> or <tool_cal> or <toolcall>, not a call.", SAME, []),
    ("stray-end-tag", "</tool_call> is just text", SAME, []),
]

LLAMA_CASES = [
    (
        "parameters",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        "python-tag",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    ("arguments-key", WEATHER, None, [("get_weather", WEATHER_ARGS)]),
    (
        "two-calls",
        '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": 2}}',
        None,
        [("a", '{"x": 1}'), ("b", '{"y": 2}')],
    ),
    (
        "two-calls-compact-tagged",
        '<|python_tag|>{"name":"a","parameters":{}};{"name":"b","parameters":{"l":[1,2]}}',
        None,
        [("a", "{}"), ("b", '{"l": [1, 2]}')],
    ),
    ("trailing-semicolon", '{"name": "a", "parameters": {}};\n', None, [("a", "{}")]),
    (
        "surrounding-whitespace",
        '\n\n<|python_tag|> {"name": "a", "parameters": {"x": true}}\n',
        None,
        [("a", '{"x": true}')],
    ),
    (
        "deeply-nested",
        '{"name": "f", "parameters": {"a": {"b": {"c": {"d": [1, {"e": null}]}}}}}',
        None,
        [("f", '{"a": {"b": {"c": {"d": [1, {"e": null}]}}}}')],
    ),
    (
        "braces-and-quotes-in-strings",
        '{"name": "echo", "parameters": {"text": "a } b { c \\" d ; e"}}',
        None,
        [("echo", '{"text": "a } b { c \\" d ; e"}')],
    ),
    (
        "unicode",
        '{"name": "say", "parameters": {"text": "naïve café — 你好 👋"}}',
        None,
        [("say", '{"text": "naïve café — 你好 👋"}')],
    ),
    ("missing-arguments", '{"name": "now"}', None, [("now", "{}")]),
    ("empty", "", None, []),
    ("plain-text", "The weather in Paris is sunny.", SAME, []),
    ("text-before-json", 'Here you go: {"name": "a", "parameters": {}}', SAME, []),
    ("json-answer-not-a-call", '{"answer": 42}', SAME, []),
    ("json-array", '[{"name": "a", "parameters": {}}]', SAME, []),
    ("broken-json", '{"name": "a", "parameters": {"x": }}', SAME, []),
    ("unclosed-json", '<|python_tag|>{"name": "a", "parameters": {"x": 1}', SAME, []),
    ("trailing-text", '{"name": "a", "parameters": {}} Hope this helps!', SAME, []),
    ("tag-only", "<|python_tag|>", SAME, []),
    ("tag-then-text", "<|python_tag|>print('hi')", SAME, []),
    ("near-miss-tag", "<|python|> is not the tag", SAME, []),
    ("missing-name", '{"parameters": {"x": 1}}', SAME, []),
    ("first-broken-second-valid", '{bad}; {"name": "a", "parameters": {}}', SAME, []),
    ("parameters-not-an-object", '{"name": "a", "parameters": "x"}', SAME, []),
]

MISTRAL_CASES = [
    (
        "array",
        f"[TOOL_CALLS][{WEATHER}]",
        None,
        [("get_weather", WEATHER_ARGS)],
    ),
    (
        "array-two-calls",
        '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": "2"}}]',
        None,
        [("a", '{"x": 1}'), ("b", '{"y": "2"}')],
    ),
    (
        "content-before",
        f"Let me check.\n[TOOL_CALLS][{WEATHER}]",
        "Let me check.",
        [("get_weather", WEATHER_ARGS)],
    ),
    ("single-object", '[TOOL_CALLS]{"name": "f", "arguments": {}}', None, [("f", "{}")]),
    ("v11-name-form", '[TOOL_CALLS]get_weather{"city": "Paris"}', None, [("get_weather", '{"city": "Paris"}')]),
    (
        "v13-args-form",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        "v13-two-calls",
        '[TOOL_CALLS]a[ARGS]{"x":1}[TOOL_CALLS]b[ARGS]{"y":[1,2]}',
        None,
        [("a", '{"x": 1}'), ("b", '{"y": [1, 2]}')],
    ),
    (
        "content-after",
        '[TOOL_CALLS][{"name": "f", "arguments": {}}]\nDone.',
        "Done.",
        [("f", "{}")],
    ),
    (
        "unicode",
        '[TOOL_CALLS][{"name": "say", "arguments": {"text": "Ça va? 日本 🎌", "u": "\\u00fc"}}]',
        None,
        [("say", '{"text": "Ça va? 日本 🎌", "u": "ü"}')],
    ),
    (
        "arguments-json-string",
        '[TOOL_CALLS][{"name": "f", "arguments": "{\\"a\\": 1}"}]',
        None,
        [("f", '{"a": 1}')],
    ),
    ("arguments-missing", '[TOOL_CALLS][{"name": "now"}]', None, [("now", "{}")]),
    ("empty-array", "[TOOL_CALLS][]", None, []),
    ("plain", "See [1] and [TOOL] docs.", SAME, []),
    ("empty", "", None, []),
    # Malformed: the content is the output with the [TOOL_CALLS] markers removed.
    ("invalid-json", 'Hi [TOOL_CALLS][{"name": "f", "arguments": {]', 'Hi [{"name": "f", "arguments": {]', []),
    ("unclosed-array", '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}', '[{"name": "f", "arguments": {"x": 1}}', []),
    ("missing-name", '[TOOL_CALLS][{"arguments": {}}]', '[{"arguments": {}}]', []),
    ("marker-only", "[TOOL_CALLS]", None, []),
    ("name-without-arguments", "[TOOL_CALLS]get_weather", "get_weather", []),
    ("args-not-an-object", "[TOOL_CALLS]f[ARGS][1]", "f[ARGS][1]", []),
    ("args-marker-without-name", '[TOOL_CALLS][ARGS]{"x": 1}', '[ARGS]{"x": 1}', []),
    ("text-after-marker", "[TOOL_CALLS] sorry, no tool fits", "sorry, no tool fits", []),
]

CASES = {"hermes": HERMES_CASES, "llama3_json": LLAMA_CASES, "mistral": MISTRAL_CASES}

# A well-formed call was already sent when a later one turns out malformed: extract()
# returns all content, the stream keeps the sent call and sends the rest as content.
# (parser, text, streamed content, streamed calls)
DIVERGENT = [
    (
        "hermes",
        'Calling.<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>',
        "Calling.<tool_call>{oops}</tool_call>",
        [("f", "{}")],
    ),
    ("llama3_json", '{"name": "a", "parameters": {}}; oops', "oops", [("a", "{}")]),
    ("mistral", '[TOOL_CALLS]a{"x": 1}[TOOL_CALLS]b{oops', "b{oops", [("a", '{"x": 1}')]),
]


def expected(text, content, calls):
    return (text.strip() or None) if content is SAME else content, calls


def table(parser_names=CASES):
    return [
        pytest.param(name, text, *expected(text, content, calls), id=f"{name}-{case_id}")
        for name in parser_names
        for case_id, text, content, calls in CASES[name]
    ]


def summary(result: ExtractedToolCalls):
    return result.content, [(c.name, c.arguments) for c in result.tool_calls]


def run_stream(parser, chunks):
    """Feed chunks, finish; check every delta's shape; return (content, calls, streamer)."""
    streamer = parser.streamer()
    deltas = []
    for chunk in chunks:
        deltas += streamer.feed(chunk)
    deltas += streamer.finish()
    content = ""
    calls: list[list] = []  # [id, name, arguments]
    for delta in deltas:
        assert len(delta) == 1, delta
        if "content" in delta:
            assert isinstance(delta["content"], str) and delta["content"], delta
            content += delta["content"]
            continue
        (entry,) = delta["tool_calls"]
        if "id" in entry:  # header: a new call
            assert entry["index"] == len(calls), delta
            assert entry["type"] == "function"
            assert entry["function"]["arguments"] == ""
            assert set(entry) == {"index", "id", "type", "function"}
            calls.append([entry["id"], entry["function"]["name"], ""])
        else:
            assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
            assert entry["index"] == len(calls) - 1, "arguments belong to the latest call"
            calls[-1][2] += entry["function"]["arguments"]
    assert [(c.id, c.name, c.arguments) for c in streamer.tool_calls] == [tuple(c) for c in calls]
    return content or None, [(name, args) for _, name, args in calls], streamer


def chunked(text, size):
    return [text[i : i + size] for i in range(0, len(text), size)]


# --- whole outputs ---------------------------------------------------------------------


@pytest.mark.parametrize(("parser_name", "text", "content", "calls"), table())
def test_extract(parser_name, text, content, calls):
    parser = get_tool_parser(parser_name)
    result = parser.extract(text)
    assert summary(result) == (content, calls)
    id_form = MISTRAL_ID if parser_name == "mistral" else OPENAI_ID
    for call in result.tool_calls:
        assert id_form.fullmatch(call.id)
        assert isinstance(json.loads(call.arguments), dict)
    assert len({c.id for c in result.tool_calls}) == len(result.tool_calls)


# --- streaming reassembles into extract(), however the text is split ----------------------


@pytest.mark.parametrize(("parser_name", "text", "content", "calls"), table())
def test_stream_every_chunk_size_matches_extract(parser_name, text, content, calls):
    parser = get_tool_parser(parser_name)
    for size in range(1, max(len(text), 1) + 1):
        got = run_stream(parser, chunked(text, size))[:2]
        assert got == (content, calls), f"chunk size {size}"


@pytest.mark.parametrize(("parser_name", "text", "content", "calls"), table())
def test_stream_every_split_point_matches_extract(parser_name, text, content, calls):
    """Two deltas split at every position: every marker is cut at every point once."""
    parser = get_tool_parser(parser_name)
    for i in range(len(text) + 1):
        assert run_stream(parser, [text[:i], text[i:]])[:2] == (content, calls), f"split at {i}"


FRAGMENTS = {
    "hermes": [
        "Hello", " ", "\n", "é 東京", "<tool_call>", "</tool_call>", "<tool", "_call>", "</",
        '{"name": "f", "arguments": {"a": 1}}', '{"name": "g"}', '{"name": 1}', '{"na',
        "{", "}", '"', "\\", "<", ">",
    ],
    "llama3_json": [
        "<|python_tag|>", "<|py", '{"name": "f", "parameters": {"a": [1, {"b": "}"}]}}',
        '{"name":"g","arguments":"{\\"k\\":2}"}', '{"answer": 1}', ";", " ", "\n", "{", "}",
        '"', "x", "[", "]",
    ],
    "mistral": [
        "[TOOL_CALLS]", "[TOOL", "_CALLS]", "[ARGS]", "get_weather", '{"a": 1}',
        '[{"name": "f", "arguments": {"x": "é"}}]', "[", "]", "{", "}", " ", "Hi", '"', "\\",
    ],
}


@settings(max_examples=300, deadline=None)
@given(data=st.data(), parser_name=st.sampled_from(sorted(FRAGMENTS)))
def test_stream_random_texts_and_splits(data, parser_name):
    """Random texts built from markers, calls and broken pieces, split at random points:
    the stream never depends on the split, and matches extract() unless a sent call was
    followed by a malformed one (then extract() has no calls and the stream has some)."""
    parser = get_tool_parser(parser_name)
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS[parser_name]), max_size=12)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    whole = run_stream(parser, [text])[:2]
    assert run_stream(parser, chunks)[:2] == whole
    extracted = summary(parser.extract(text))
    if extracted[1] or not whole[1]:
        assert whole == extracted
    else:
        assert extracted[0] is not None  # all content


@pytest.mark.parametrize(("parser_name", "text", "content", "calls"), DIVERGENT)
def test_malformed_call_after_a_sent_call(parser_name, text, content, calls):
    """Documented difference: extract() is all-or-nothing, the stream cannot unsend."""
    parser = get_tool_parser(parser_name)
    assert summary(parser.extract(text)) == (text.replace("[TOOL_CALLS]", "").strip(), [])
    for size in range(1, len(text) + 1):
        assert run_stream(parser, chunked(text, size))[:2] == (content, calls)


# --- streaming: what is sent when ---------------------------------------------------------


def test_hermes_stream_deltas_in_order():
    streamer = get_tool_parser("hermes").streamer()
    assert streamer.feed("Let me check.\n") == [{"content": "Let me check."}]
    assert streamer.feed("<tool_call>\n") == []
    assert streamer.feed('{"name": "get_weather", ') == []
    assert streamer.feed('"arguments": {"city":"Paris"}}\n') == []
    deltas = streamer.feed("</tool_call>")
    (call,) = streamer.tool_calls
    assert OPENAI_ID.fullmatch(call.id)
    assert call == ToolCall(call.id, "get_weather", '{"city": "Paris"}')
    assert deltas == [
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]},
    ]
    assert streamer.feed("\n") == []
    assert streamer.finish() == []


@pytest.mark.parametrize(
    ("parser_name", "first", "rest", "sent_first", "sent_rest"),
    [
        # A partial marker is held, then sent as content once it cannot be a marker.
        ("hermes", "Hi <tool", "box> ok", [{"content": "Hi"}], [{"content": " <toolbox> ok"}]),
        ("hermes", "a<", "b", [{"content": "a"}], [{"content": "<b"}]),
        ("mistral", "See [TOOL", "] docs", [{"content": "See"}], [{"content": " [TOOL] docs"}]),
        ("mistral", "x[", "1]", [{"content": "x"}], [{"content": "[1]"}]),
        ("llama3_json", "<|py", "thon|> no", [], [{"content": "<|python|> no"}]),
        ("llama3_json", '{"a"', ": 1} is JSON", [], [{"content": '{"a": 1} is JSON'}]),
    ],
)
def test_partial_marker_held_back(parser_name, first, rest, sent_first, sent_rest):
    streamer = get_tool_parser(parser_name).streamer()
    assert streamer.feed(first) == sent_first
    assert streamer.feed(rest) == sent_rest
    assert streamer.finish() == []
    assert streamer.tool_calls == []


@pytest.mark.parametrize(
    ("parser_name", "before", "after"),
    [
        # Each call is sent as soon as it is known complete, before the output ends.
        ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call>', '<tool_call>{"name": "g"'),
        ("llama3_json", '{"name": "f", "parameters": {}};', ' {"name": "g"'),
        ("mistral", '[TOOL_CALLS]f[ARGS]{"x": 1}', '[TOOL_CALLS]g[ARGS]{"y"'),
        ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]', " [TOOL"),
    ],
)
def test_call_sent_when_complete(parser_name, before, after):
    streamer = get_tool_parser(parser_name).streamer()
    deltas = streamer.feed(before)
    assert [c.name for c in streamer.tool_calls] == ["f"]
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "f"
    assert streamer.feed(after) == []
    assert [c.name for c in streamer.tool_calls] == ["f"]


def test_llama_last_call_waits_for_end_of_output():
    """Text may still follow a complete object (making it all content), so the last call
    is sent by finish()."""
    streamer = get_tool_parser("llama3_json").streamer()
    assert streamer.feed('{"name": "f", "parameters": {"x": 1}}') == []
    deltas = streamer.finish()
    assert [d["tool_calls"][0]["index"] for d in deltas] == [0, 0]
    assert deltas[1]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'


@pytest.mark.parametrize(
    ("parser_name", "text", "flushed"),
    [
        ("hermes", 'Ok <tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu'),
        ("llama3_json", '{"name": "f", "parameters": {"x"', '{"name": "f", "parameters": {"x"'),
        ("mistral", 'Ok [TOOL_CALLS][{"name": "f"', '[{"name": "f"'),
    ],
)
def test_finish_flushes_unfinished_call_as_content(parser_name, text, flushed):
    streamer = get_tool_parser(parser_name).streamer()
    sent = streamer.feed(text)
    assert all("tool_calls" not in d for d in sent)
    rest = streamer.finish()
    content = "".join(d["content"] for d in sent + rest)
    assert content.endswith(flushed)
    assert content == get_tool_parser(parser_name).extract(text).content
    assert streamer.tool_calls == []


def test_streamer_feed_after_finish_raises():
    streamer = get_tool_parser("hermes").streamer()
    streamer.feed("hi")
    streamer.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        streamer.feed("more")
    with pytest.raises(RuntimeError, match="twice"):
        streamer.finish()


def test_streamers_are_independent():
    parser = get_tool_parser("hermes")
    a, b = parser.streamer(), parser.streamer()
    a.feed("<tool_call>")
    assert b.feed("plain") == [{"content": "plain"}]
    assert a.feed('{"name": "f"}</tool_call>')[0]["tool_calls"][0]["index"] == 0
    assert b.tool_calls == []


# --- ids, shapes, registry -----------------------------------------------------------------


@pytest.mark.parametrize(("parser_name", "form"), [("hermes", OPENAI_ID), ("llama3_json", OPENAI_ID), ("mistral", MISTRAL_ID)])
def test_new_tool_call_id(parser_name, form):
    ids = {new_tool_call_id(parser_name) for _ in range(200)}
    assert len(ids) == 200
    assert all(form.fullmatch(i) for i in ids)


def test_tool_call_to_openai():
    call = ToolCall("chatcmpl-tool-" + "0" * 32, "f", '{"a": "é"}')
    assert call.to_openai().model_dump() == {
        "id": "chatcmpl-tool-" + "0" * 32,
        "type": "function",
        "function": {"name": "f", "arguments": '{"a": "é"}'},
    }
    with pytest.raises(AttributeError):
        call.name = "g"  # frozen


def test_registry():
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral"]
    for name, cls in TOOL_PARSERS.items():
        parser = get_tool_parser(name)
        assert isinstance(parser, cls) and parser.name == name


@pytest.mark.parametrize("bad", ["", "Hermes", "llama3", "pythonic"])
def test_get_tool_parser_unknown(bad):
    with pytest.raises(ValueError, match=rf"{bad!r}.*hermes, llama3_json, mistral"):
        get_tool_parser(bad)
