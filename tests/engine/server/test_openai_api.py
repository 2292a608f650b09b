"""The OpenAI-compatible API through the official `openai` client against a real
`kvpilot serve` subprocess (embedded SmolLM2)."""

from __future__ import annotations

import json

import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_greedy(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.choices[0].text == " Paris.\n\nThe answer is:"
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 8, 13)


def test_chat_completion(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=30, temperature=0
    )
    msg = r.choices[0].message
    assert msg.role == "assistant" and "4" in msg.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0


def test_chat_streaming_equals_non_streaming(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Name three fruits."}], max_tokens=40, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_n_choices_each_get_a_finish_reason(client):
    r = client.completions.create(model=MODEL, prompt="A short poem:", max_tokens=6, temperature=1.0, n=3, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    fixed = client.completions.create(
        model=MODEL, prompt="A short poem:", max_tokens=6, n=3, extra_body={"ignore_eos": True}
    )
    assert fixed.usage.completion_tokens == 18  # usage covers all three choices
    again = client.completions.create(model=MODEL, prompt="A short poem:", max_tokens=6, temperature=1.0, n=3, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded
    stream = client.completions.create(model=MODEL, prompt="A short poem:", max_tokens=6, temperature=1.0, n=3, seed=7, stream=True)
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason}
    assert sorted(finishes) == [0, 1, 2]


def test_batched_prompts(client):
    r = client.completions.create(model=MODEL, prompt=["The capital of France is", "1, 2, 3,"], max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text.startswith(" Paris")


def test_stop_strings(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=16, temperature=0, stop=["answer"])
    assert r.choices[0].text == " Paris.\n\nThe "
    assert r.choices[0].finish_reason == "stop"


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.token_logprobs) == 3 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=3, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob for c in content)


def test_echo_and_token_id_prompts(client, http):
    ids = http.post("/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, echo=True)
    assert r.choices[0].text.startswith("The capital of France is Paris")
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "The capital of France is"


def test_x_request_id_is_echoed(http):
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"X-Request-Id": "abc-123"})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "abc-123"
    assert r.json()["id"] == "cmpl-abc-123"


def test_cache_salt_separates_prefix_caches(http, server):
    from .metrics_util import scrape

    prompt = "Salted prompt for the cache test. " * 8
    body = {"prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-a"}
    http.post("/v1/completions", json=body)
    before = scrape(server.url)["kvpilot:prefix_cache_hits_total"]
    http.post("/v1/completions", json={**body, "cache_salt": "tenant-b"})
    assert scrape(server.url)["kvpilot:prefix_cache_hits_total"] == before
    http.post("/v1/completions", json=body)
    assert scrape(server.url)["kvpilot:prefix_cache_hits_total"] > before


def test_wrong_api_key_is_401_and_probes_stay_open(server):
    import httpx

    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{server.url}{path}").status_code == 200


def test_sse_wire_format(http):
    with http.stream("POST", "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    for line in lines[:-1]:
        assert json.loads(line[6:])["object"] == "text_completion"


def test_logprobs_of_tokens_inside_a_multibyte_character_carry_their_own_bytes(http):
    """Found in review: such tokens reported the bytes of U+FFFD, "\ufffd" as their token
    (collapsing distinct tokens in top_logprobs) and text offsets that counted each as a
    character. Their bytes now rebuild the text, and offsets point into it."""
    prompt = "Repeat exactly: 😀🎉🔥 😀🎉🔥 😀🎉🔥"
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0,
        "logprobs": True, "top_logprobs": 2}).json()
    choice = chat["choices"][0]
    content = choice["logprobs"]["content"]
    rebuilt = b"".join(bytes(t["bytes"]) for t in content).decode("utf-8", errors="replace")
    assert rebuilt.startswith(choice["message"]["content"][:4])
    assert all(t["token"] != "\ufffd" for t in content)
    partial = [t for t in content if t["token"].startswith("bytes:")]
    assert partial and all(bytes(t["bytes"]) != "\ufffd".encode() for t in partial)

    comp = http.post("/v1/completions", json={
        "prompt": prompt + "\n", "max_tokens": 12, "temperature": 0, "logprobs": 1}).json()
    c = comp["choices"][0]
    offsets = c["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] <= len(c["text"])
    assert all(tok != "\ufffd" for tok in c["logprobs"]["tokens"])
