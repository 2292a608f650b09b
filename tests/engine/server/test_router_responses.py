"""``POST /v1/responses`` through the vLLM project's router (``vllm-router`` 0.1.17,
``--policy kv_aware``) to a ``kvpilot serve`` with an API key: what the router passes on,
what it drops, and what it answers itself (docs/server.md, "Behind a KV-aware router").

The router treats ``/v1/responses`` as a transparent proxy, not as the chat route: it
first asks the engine's ``POST /v1/responses/render`` for the prompt's token ids (to
route by prefix), then forwards the body as the client sent it, but **not the client's
headers**: the client's ``Authorization`` and ``X-Request-Id`` never reach the engine.
With ``--api-key`` it sends its own key instead (and does not check the client's); without
it the engine sees no key at all. Chat completions, and the stored-response routes
(``GET /v1/responses/{id}``, ``POST .../cancel``), keep the client's headers."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest

from tests.serverproc import ServerProcess

from .test_router_kv_aware import RouterProcess

pytestmark = [pytest.mark.slow, pytest.mark.server]

MODEL = "SmolLM2-135M-Instruct"
KEY = "engine-key"
IDS = re.compile(r"\b(resp|msg|fc|rs)_[0-9a-f]{32}")


@pytest.fixture(scope="module")
def engine():
    proc = ServerProcess("--api-key", KEY, "--kv-cache-memory", "0.1", "--max-model-len", "2048",
                         "--log-level", "warning")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def router(engine):
    started: list[RouterProcess] = []

    def start(*extra: str) -> RouterProcess:
        r = RouterProcess(engine.url, extra=extra)
        started.append(r)
        r.wait_ready()
        return r

    yield start
    for r in started:
        r.stop()


def shape(body: dict[str, Any]) -> dict[str, Any]:
    """A response object without what differs from run to run (ids, time, cache hits)."""
    out = json.loads(IDS.sub(r"\1_ID", json.dumps(body)))
    out["created_at"] = 0
    out["usage"]["input_tokens_details"]["cached_tokens"] = 0
    return out


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    blocks = [b for b in text.split("\n\n") if b]
    out = []
    for block in blocks:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        out.append((name[7:], json.loads(data[6:])))
    return out


BODY = {"model": MODEL, "input": "Name three colors.", "max_output_tokens": 12, "temperature": 0}


def test_with_the_router_key_responses_pass_and_are_routed_by_their_rendered_prompt(engine, router):
    r = router("--api-key", KEY)
    direct = httpx.post(f"{engine.url}/v1/responses", json=BODY, headers={"Authorization": f"Bearer {KEY}"},
                        timeout=120)
    assert direct.status_code == 200, direct.text
    # The client's key is not checked (the router sends its own), so any key is answered.
    client = openai.OpenAI(base_url=f"{r.url}/v1", api_key="not-the-engine-key", max_retries=0, timeout=120)
    via = client.responses.create(**BODY)
    assert via.output_text == direct.json()["output"][0]["content"][0]["text"]
    assert shape(via.to_dict()) == shape(direct.json())
    # The router asked the engine's render endpoint for the prompt's tokens first.
    n = direct.json()["usage"]["input_tokens"]
    assert re.search(rf"KV prefix decision outcome=\S+ worker=\S+ input_tokens={n}\b", r.logs()), r.logs()[-3000:]

    # A stream passes through as the engine sent it: event lines, numbering, final object.
    streamed = httpx.post(f"{r.url}/v1/responses", json={**BODY, "stream": True}, timeout=120)
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.text)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert [n for n, _ in events][:2] == ["response.created", "response.in_progress"]
    assert events[-1][0] == "response.completed"
    assert shape(events[-1][1]["response"]) == shape(direct.json())

    # X-Request-Id is echoed to the client by the router, but the engine never sees it:
    # the response is not named after it, as it is when sent to the engine directly.
    named = httpx.post(f"{r.url}/v1/responses", json=BODY, headers={"X-Request-Id": "via-router"}, timeout=120)
    assert named.headers["x-request-id"] == "via-router"
    assert named.json()["id"] != "resp_via-router" and named.json()["id"].startswith("resp_")

    # The body is forwarded as sent: what kvpilot refuses comes back with its 400.
    for extra, param in (({"background": True}, "background"), ({"previous_response_id": "resp_1"},
                                                                 "previous_response_id"), ({"include": []}, "include")):
        refused = httpx.post(f"{r.url}/v1/responses", json={**BODY, **extra}, timeout=60)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == param

    # The stored-response routes reach the engine with the client's headers, not the
    # router's key (kvpilot stores nothing: 404 with the engine's key, 401 without);
    # DELETE is the router's own 501.
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{r.url}/v1/responses/resp_1", headers=auth, timeout=30).status_code == 404
    assert httpx.get(f"{r.url}/v1/responses/resp_1", timeout=30).status_code == 401
    assert httpx.post(f"{r.url}/v1/responses/resp_1/cancel", headers=auth, timeout=30).status_code == 404
    deleted = httpx.delete(f"{r.url}/v1/responses/resp_1", timeout=30)
    assert deleted.status_code == 501 and "not implemented" in deleted.text


def test_without_a_router_key_the_clients_key_is_dropped(engine, router):
    r = router()
    auth = {"Authorization": f"Bearer {KEY}"}
    # Chat completions carry the client's key to the engine ...
    chat = httpx.post(f"{r.url}/v1/chat/completions", headers=auth, timeout=120,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert chat.status_code == 200, chat.text
    # ... a Responses request does not: the engine sees no key and answers 401.
    refused = httpx.post(f"{r.url}/v1/responses", headers=auth, json=BODY, timeout=120)
    assert refused.status_code == 401, refused.text
    assert refused.json()["error"]["type"] == "authentication_error"
