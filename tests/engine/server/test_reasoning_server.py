"""A server started with vLLM's `--reasoning-parser deepseek_r1` and `--chat-template`:
reasoning goes to `reasoning_content` (streams: `delta.reasoning_content`; the Responses
API: a `reasoning` output item), and a prompt
whose template already closed the reasoning (thinking off) gets a plain answer that a
structured-output constraint governs from the first token. Bad chat flags stop the
server at start with a message naming the flag."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.serverproc import ServerProcess

# The embedded model's own ChatML layout, plus the switch real reasoning templates have:
# thinking on opens <think> in the prompt (DeepSeek-R1), off closes an empty block (Qwen3).
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory):
    template = tmp_path_factory.mktemp("tpl") / "reasoning.jinja"
    template.write_text(TEMPLATE)
    proc = ServerProcess("--reasoning-parser", "deepseek_r1", "--chat-template", str(template),
                         "--kv-cache-memory", "0.25", "--max-model-len", "1024", "--log-level", "warning")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_reasoning_goes_to_reasoning_content(reasoning_server):
    with httpx.Client(base_url=reasoning_server.url, timeout=120) as http:
        body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0}
        r = http.post("/v1/chat/completions", json=body).json()
        msg = r["choices"][0]["message"]
        # No </think> within 12 tokens: all of it is reasoning, nothing is the answer yet.
        assert msg["reasoning_content"] and msg["content"] in (None, "")
        rendered = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": rendered}).json()["prompt"].endswith("<think>\n")
        events = []
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
        streamed = "".join(c["delta"].get("reasoning_content") or "" for e in events for c in e["choices"])
        assert streamed == msg["reasoning_content"]
        assert not any(c["delta"].get("content") for e in events for c in e["choices"])
        off = http.post("/v1/chat/completions", json={**body, "include_reasoning": False}).json()
        assert "reasoning_content" not in off["choices"][0]["message"]


def test_responses_api_returns_the_reasoning_as_a_reasoning_item(reasoning_server):
    question = MESSAGES[0]["content"]
    with httpx.Client(base_url=reasoning_server.url, timeout=120) as http:
        chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 12, "temperature": 0})
        body = {"input": question, "max_output_tokens": 12, "temperature": 0}
        r = http.post("/v1/responses", json=body).json()
        # No </think> before the end: one reasoning item, no answer, every token reasoning.
        assert [item["type"] for item in r["output"]] == ["reasoning"]
        item = r["output"][0]
        assert item["id"].startswith("rs_") and item["summary"] == []
        assert item["content"] == [{"type": "reasoning_text",
                                    "text": chat.json()["choices"][0]["message"]["reasoning_content"]}]
        assert r["usage"]["output_tokens_details"]["reasoning_tokens"] == r["usage"]["output_tokens"] > 0
        with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
        deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
        assert [e["type"] for e in events] == (
            ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
            + ["response.reasoning_text.delta"] * len(deltas)
            + ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
               "response.completed"])
        assert "".join(deltas) == item["content"][0]["text"]
        assert events[-1]["response"]["output"][0]["content"] == item["content"]
        assert events[-1]["response"]["usage"]["output_tokens_details"] == r["usage"]["output_tokens_details"]
        off = http.post("/v1/responses", json={**body, "include_reasoning": False}).json()
        assert off["output"][0]["type"] == "message" and off["output"][0]["content"] == []
        plain = http.post("/v1/responses", json={**body, "max_output_tokens": 20,
                                                 "chat_template_kwargs": {"enable_thinking": False}}).json()
        assert [item["type"] for item in plain["output"]] == ["message"]
        assert plain["output"][0]["content"][0]["text"]
        assert plain["usage"]["output_tokens_details"]["reasoning_tokens"] == 0


def test_thinking_off_answers_plainly_and_the_constraint_applies_at_once(reasoning_server):
    with httpx.Client(base_url=reasoning_server.url, timeout=120) as http:
        body = {"messages": MESSAGES, "max_tokens": 20, "temperature": 1.0,
                "chat_template_kwargs": {"enable_thinking": False}, "guided_choice": ["Paris", "Rome"]}
        msg = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert msg["content"] in ("Paris", "Rome") and "reasoning_content" not in msg


def test_a_constrained_request_does_not_end_while_still_reasoning(reasoning_server):
    """Found by a new-user trial: the constraint starts after </think>, and a model that
    ended its output while reasoning returned `finish_reason: stop` and no answer. End
    tokens are banned until the answer starts: such a request now runs to `length`."""
    schema = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 20}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "strict": True, "schema": schema}}
    with httpx.Client(base_url=reasoning_server.url, timeout=120) as http:
        stopped_while_reasoning = 0
        for seed in range(8):
            body = {"messages": MESSAGES, "max_tokens": 24, "temperature": 1.0, "seed": seed}
            free = http.post("/v1/chat/completions", json=body).json()["choices"][0]
            if free["finish_reason"] == "stop" and not free["message"]["content"]:
                stopped_while_reasoning += 1
                constrained = http.post("/v1/chat/completions", json={**body, "response_format": fmt}).json()
                choice = constrained["choices"][0]
                if choice["finish_reason"] == "stop":
                    assert json.loads(choice["message"]["content"])["city"], choice
                else:
                    assert choice["finish_reason"] == "length", choice
        # The case the fix is about did occur with these seeds (else this test proves nothing).
        assert stopped_while_reasoning > 0


@pytest.mark.parametrize(("flags", "text"), [
    (["--reasoning-parser", "nope"], "--reasoning-parser"),
    (["--tool-call-parser", "nope"], "--tool-call-parser"),
    (["--enable-auto-tool-choice"], "--tool-call-parser"),
    (["--chat-template", "no-such-file.jinja"], "--chat-template"),
])
def test_bad_chat_flags_stop_the_server_naming_the_flag(flags, text):
    p = subprocess.run([sys.executable, "-m", "kvpilot.cli", "serve", *flags], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and text in p.stderr, p.stderr
