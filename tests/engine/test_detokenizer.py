"""Incremental detokenization with the real SmolLM2 tokenizer: stop strings spanning
tokens never leak (C06), multi-byte characters never show U+FFFD (C07)."""

from __future__ import annotations

import pytest

from kvpilot.engine.detokenizer import IncrementalDetokenizer
from kvpilot.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


def stream(tokenizer, text, params, prompt="Hi"):
    ids = tokenizer.encode(text)
    d = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), params)
    chunks, stop = [], None
    for i, t in enumerate(ids):
        stop = d.add_tokens([t])
        finished = stop is not None or i == len(ids) - 1
        chunks.append(d.take_delta(finished))
        if stop is not None:
            break
    return chunks, stop, d


def test_c07_multibyte_characters_never_show_replacement_chars(tokenizer):
    text = " 日本語のテキスト 😀🚀 naïve café — 中文"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # several characters span several tokens
    chunks, _, d = stream(tokenizer, text, SamplingParams())
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == d.output_text == text


def test_c06_stop_string_across_tokens_never_leaks_into_the_stream(tokenizer):
    stop = "\n\nUser:"
    text = "Sure, here it is.\n\nUser: and then more"
    assert len(tokenizer.encode("\n\nUser:")) > 1
    chunks, matched, d = stream(tokenizer, text, SamplingParams(stop=[stop]))
    assert matched == stop
    joined = "".join(chunks)
    assert joined == d.output_text == "Sure, here it is."
    for i in range(len(chunks)):
        prefix = "".join(chunks[: i + 1])
        assert stop[:2] not in prefix  # not even the first characters of the stop leaked


def test_include_stop_str_in_output_keeps_it(tokenizer):
    chunks, matched, _ = stream(tokenizer, "one two three four", SamplingParams(stop=["three"], include_stop_str_in_output=True))
    assert matched == "three" and "".join(chunks) == "one two three"


def test_earliest_of_several_stop_strings_wins(tokenizer):
    _, matched, d = stream(tokenizer, "alpha beta gamma delta", SamplingParams(stop=["delta", "beta"]))
    assert matched == "beta" and d.output_text == "alpha "


def test_special_tokens_are_skipped_by_default(tokenizer):
    eos = tokenizer.eos_token_id
    d = IncrementalDetokenizer(tokenizer, [1], SamplingParams())
    d.add_tokens([*tokenizer.encode("Hello"), eos])
    assert d.output_text == "Hello"
    d2 = IncrementalDetokenizer(tokenizer, [1], SamplingParams(skip_special_tokens=False))
    d2.add_tokens([*tokenizer.encode("Hello"), eos])
    assert d2.output_text == "Hello" + tokenizer.eos_token
