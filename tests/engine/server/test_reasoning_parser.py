"""Reasoning parsers (kvpilot.engine.server.reasoning): the ``<think>...</think>`` split of
whole outputs from a table, and the streamed split, which must reassemble into exactly
the whole-output split however the text is cut."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.server.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    get_reasoning_parser,
)

# (id, text, reasoning_content, content)
DEEPSEEK_CASES = [
    ("both-tags", "<think>Let me add.</think>4", "Let me add.", "4"),
    ("start-tag-in-prompt", "Let me add 2 and 2.\n</think>\n\n2 + 2 = 4.", "Let me add 2 and 2.\n", "\n\n2 + 2 = 4."),
    ("whitespace-before-start-tag", "\n <think>\nr\n</think>\nc", "\nr\n", "\nc"),
    ("no-end-all-reasoning", "<think>still thinking", "still thinking", None),
    ("no-tags-all-reasoning", "just thinking aloud", "just thinking aloud", None),
    ("empty-reasoning", "<think></think>answer", None, "answer"),
    ("end-tag-first", "</think>answer", None, "answer"),
    ("both-empty", "<think></think>", None, None),
    ("empty", "", None, None),
    ("whitespace-only", " \n", " \n", None),
    ("second-end-tag-is-content", "a</think>b</think>c", "a", "b</think>c"),
    ("start-tag-mid-text-kept", "a<think>b</think>c", "a<think>b", "c"),
    ("start-tag-twice", "<think><think>x</think>y", "<think>x", "y"),
    ("partial-tags-are-text", "<thin</thin>k </think", "<thin</thin>k </think", None),
    ("unicode", "<think>Überlegung 🤔 思考</think>答案: 4", "Überlegung 🤔 思考", "答案: 4"),
    ("content-whitespace-kept", "r</think>  ", "r", "  "),
]

QWEN3_CASES = [
    ("both-tags", "<think>Let me add.</think>4", "Let me add.", "4"),
    ("template-style", "<think>\nreasoning\n</think>\n\nanswer", "\nreasoning\n", "\n\nanswer"),
    ("whitespace-before-start-tag", "\n\n<think>r</think>c", "r", "c"),
    ("no-start-tag-all-content", "Let me add.</think>4", None, "Let me add.</think>4"),
    ("no-tags-all-content", "Hello!", None, "Hello!"),
    ("unclosed-all-reasoning", "<think>r and more", "r and more", None),
    ("text-before-start-tag", "Hi <think>r</think>c", None, "Hi <think>r</think>c"),
    ("empty-think", "<think>\n\n</think>\n\nHello", "\n\n", "\n\nHello"),
    ("empty-reasoning", "<think></think>Hello", None, "Hello"),
    ("empty", "", None, None),
    ("whitespace-only", "  ", None, "  "),
    ("second-end-tag-is-content", "<think>a</think>b</think>c", "a", "b</think>c"),
    ("near-miss-start-tag", "<thinking>x</thinking>", None, "<thinking>x</thinking>"),
    ("unicode", "<think>ça 🤔</think>答案", "ça 🤔", "答案"),
]

CASES = {"deepseek_r1": DEEPSEEK_CASES, "qwen3": QWEN3_CASES}


def table():
    return [
        pytest.param(name, text, reasoning, content, id=f"{name}-{case_id}")
        for name, cases in CASES.items()
        for case_id, text, reasoning, content in cases
    ]


def run_stream(parser, chunks):
    """Feed chunks, finish; returns (reasoning, content) joined, None when empty."""
    streamer = parser.streamer()
    reasoning = content = ""
    for chunk in chunks:
        r, c = streamer.feed(chunk)
        assert not c or streamer.reasoning_done, "content only once reasoning is over"
        reasoning += r
        content += c
    r, c = streamer.finish()
    reasoning += r
    content += c
    return reasoning or None, content or None


@pytest.mark.parametrize(("parser_name", "text", "reasoning", "content"), table())
def test_extract(parser_name, text, reasoning, content):
    assert get_reasoning_parser(parser_name).extract(text) == (reasoning, content)


@pytest.mark.parametrize(("parser_name", "text", "reasoning", "content"), table())
def test_stream_every_chunk_size_matches_extract(parser_name, text, reasoning, content):
    parser = get_reasoning_parser(parser_name)
    for size in range(1, max(len(text), 1) + 1):
        chunks = [text[i : i + size] for i in range(0, len(text), size)]
        assert run_stream(parser, chunks) == (reasoning, content), f"chunk size {size}"


@pytest.mark.parametrize(("parser_name", "text", "reasoning", "content"), table())
def test_stream_every_split_point_matches_extract(parser_name, text, reasoning, content):
    """Two deltas split at every position: each marker is cut at every point once."""
    parser = get_reasoning_parser(parser_name)
    for i in range(len(text) + 1):
        assert run_stream(parser, [text[:i], text[i:]]) == (reasoning, content), f"split at {i}"


FRAGMENTS = ["<think>", "</think>", "<th", "ink>", "</", "<", ">", "/", " ", "\n", "a", "é 思", "think"]


@settings(max_examples=400, deadline=None)
@given(
    data=st.data(),
    parser_name=st.sampled_from(sorted(REASONING_PARSERS)),
    pieces=st.lists(st.sampled_from(FRAGMENTS), max_size=14),
)
def test_stream_random_texts_and_splits(data, parser_name, pieces):
    parser = get_reasoning_parser(parser_name)
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert run_stream(parser, chunks) == parser.extract(text)


@pytest.mark.parametrize(
    ("parser_name", "feeds"),
    [
        # (delta, (reasoning sent, content sent)) in order; held text comes out later.
        ("deepseek_r1", [("<th", ("", "")), ("ink>abc</th", ("abc", "")), ("ink>def", ("", "def"))]),
        ("deepseek_r1", [("abc</", ("abc", "")), ("b>", ("</b>", ""))]),
        ("deepseek_r1", [(" ", ("", "")), ("<", ("", "")), ("x", (" <x", ""))]),
        ("qwen3", [("\n<thi", ("", "")), ("nk>x", ("x", "")), ("</think", ("", "")), (">y", ("", "y"))]),
        ("qwen3", [("<th", ("", "")), ("ought>", ("", "<thought>"))]),
        ("qwen3", [("Hello", ("", "Hello")), (" </think>", ("", " </think>"))]),
    ],
)
def test_stream_holds_partial_markers(parser_name, feeds):
    streamer = get_reasoning_parser(parser_name).streamer()
    for delta, sent in feeds:
        assert streamer.feed(delta) == sent, delta
    assert streamer.finish() == ("", "")


@pytest.mark.parametrize(
    ("parser_name", "text", "flushed"),
    [
        ("deepseek_r1", "abc</thi", ("</thi", "")),
        ("deepseek_r1", "<thi", ("<thi", "")),
        ("qwen3", "<think>abc</think", ("</think", "")),
        ("qwen3", " <thi", ("", " <thi")),
    ],
)
def test_finish_flushes_held_text(parser_name, text, flushed):
    streamer = get_reasoning_parser(parser_name).streamer()
    streamer.feed(text)
    assert streamer.finish() == flushed


@pytest.mark.parametrize(
    ("parser_name", "text", "done"),
    [
        ("deepseek_r1", "<think>r", False),
        ("deepseek_r1", "r</think>", True),
        ("qwen3", "<think>r", False),
        ("qwen3", "<think>r</think>c", True),
        ("qwen3", "plain", True),  # no reasoning at all
        ("qwen3", "<thi", False),  # undecided
    ],
)
def test_reasoning_done(parser_name, text, done):
    streamer = get_reasoning_parser(parser_name).streamer()
    streamer.feed(text)
    assert streamer.reasoning_done is done


def test_streamer_feed_after_finish_raises():
    streamer = get_reasoning_parser("deepseek_r1").streamer()
    streamer.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        streamer.feed("x")
    with pytest.raises(RuntimeError, match="twice"):
        streamer.finish()


def test_registry_and_markers():
    assert dict(REASONING_PARSERS) == {
        "deepseek_r1": DeepSeekR1ReasoningParser,
        "qwen3": Qwen3ReasoningParser,
    }
    for name, cls in REASONING_PARSERS.items():
        parser = get_reasoning_parser(name)
        assert isinstance(parser, cls) and parser.name == name
        assert (parser.start, parser.end) == ("<think>", "</think>")


@pytest.mark.parametrize("bad", ["", "deepseek", "Qwen3", "granite"])
def test_get_reasoning_parser_unknown(bad):
    with pytest.raises(ValueError, match=rf"{bad!r}.*deepseek_r1, qwen3"):
        get_reasoning_parser(bad)
