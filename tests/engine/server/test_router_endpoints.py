"""The endpoints a KV-aware router calls (``/get_server_info``, ``/kv_event_sources``,
``/get_load``, ``/v1/chat/completions/render``, ``/v1/completions/render``), in process
over the embedded SmolLM2.

The render endpoints must return exactly the prompt token ids generation runs with (the
router hashes them into blocks and looks them up in the engines' KV events), so each case
renders a request, then sends it to the real endpoint and compares with the ids the engine
was handed; and they must refuse what the real endpoints refuse, with the same error."""

from __future__ import annotations

import threading
import time

import pytest
from starlette.testclient import TestClient

from kvpilot.engine.config import EngineArgs
from kvpilot.engine.kv_events import KVEventsConfig, ZmqEventPublisher
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.server.api_server import build_app
from kvpilot.engine.server.async_engine import AsyncEngine, wait_until
from kvpilot.engine.server.metrics import EngineMetrics
from kvpilot.engine.server.state import ServerState

pytestmark = pytest.mark.slow

MODEL = "smollm2"
MAX_LEN = 256


class Recorder:
    """Wraps the engine's add_request: the prompt ids and salt of every request queued."""

    def __init__(self, llm: LLMEngine) -> None:
        self.calls: list[tuple[list[int], str | None, int]] = []
        self._add = llm.add_request
        llm.add_request = self  # type: ignore[method-assign]

    def __call__(self, request_id, prompt_token_ids, params, cache_salt=None, arrival_time=None, grammar=None):
        self._add(request_id, prompt_token_ids, params, cache_salt, arrival_time, grammar=grammar)
        self.calls.append((list(prompt_token_ids), cache_salt, params.max_tokens))

    def take(self) -> list[tuple[list[int], str | None, int]]:
        calls, self.calls = self.calls, []
        return calls


@pytest.fixture(scope="module")
def served(smollm2):
    args = EngineArgs(device="cpu", dtype="float32", max_model_len=MAX_LEN, max_num_seqs=8,
                      max_num_batched_tokens=256, kv_cache_memory=0.05)
    engine = AsyncEngine(lambda: LLMEngine(args, loaded=smollm2))
    engine.start()
    try:
        assert wait_until(lambda: engine.is_ready, 120), engine.failure
        recorder = Recorder(engine.engine)
        state = ServerState(engine, EngineMetrics(MODEL), MODEL, kv_block_size=args.block_size, model_path="embedded")
        with TestClient(build_app(state)) as client:
            yield client, recorder, state
    finally:
        engine.shutdown()


def error_of(r) -> tuple[int, str | None, str]:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return r.status_code, err["param"], err["message"]


SYSTEM = "You are a terse assistant. " * 6

CHAT_CASES = [
    {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 1},
    {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Count to 3."}],
     "max_tokens": 1, "cache_salt": "tenant-a", "model": MODEL},
    {"messages": [{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "Ye"}],
     "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 1},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]}],
     "max_completion_tokens": 1, "n": 2, "seed": 3, "temperature": 0.5},
]


@pytest.mark.parametrize("body", CHAT_CASES)
def test_chat_render_returns_the_ids_generation_runs_with(served, body):
    client, recorder, _ = served
    r = client.post("/v1/chat/completions/render", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"request_id", "token_ids", "features", "sampling_params", "model", "stream",
                        "stream_options", "cache_salt", "priority"}
    assert out["request_id"].startswith("chatcmpl-") and out["features"] is None
    assert out["model"] == MODEL and out["cache_salt"] == body.get("cache_salt") and out["stream"] is False
    assert recorder.take() == []  # rendering queues nothing
    real = client.post("/v1/chat/completions", json=body)
    assert real.status_code == 200, real.text
    calls = recorder.take()
    assert len(calls) == body.get("n", 1)
    for ids, salt, max_tokens in calls:
        assert ids == out["token_ids"]
        assert salt == body.get("cache_salt")
        assert max_tokens == out["sampling_params"]["max_tokens"] == 1
    assert real.json()["usage"]["prompt_tokens"] == len(out["token_ids"])
    assert out["sampling_params"]["n"] == body.get("n", 1)


COMPLETION_CASES = [
    {"prompt": "The capital of France is", "max_tokens": 1},
    {"prompt": ["Once upon a time", "Hello there"], "max_tokens": 1, "cache_salt": "s"},
    {"prompt": [1, 2, 3, 400], "max_tokens": 1, "stop": ["\n"]},
    {"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 1, "n": 2},
]


@pytest.mark.parametrize("body", COMPLETION_CASES)
def test_completion_render_returns_one_entry_per_prompt_with_its_ids(served, body):
    client, recorder, _ = served
    r = client.post("/v1/completions/render", json=body)
    assert r.status_code == 200, r.text
    rendered = r.json()
    assert isinstance(rendered, list) and all(e["request_id"].startswith("cmpl-") for e in rendered)
    assert recorder.take() == []
    real = client.post("/v1/completions", json=body)
    assert real.status_code == 200, real.text
    calls = recorder.take()
    n = body.get("n", 1)
    assert [ids for ids, _, _ in calls] == [e["token_ids"] for e in rendered for _ in range(n)]
    assert all(salt == body.get("cache_salt") for _, salt, _ in calls)
    assert real.json()["usage"]["prompt_tokens"] == sum(len(e["token_ids"]) for e in rendered)
    assert all(e["sampling_params"]["stop"] == body.get("stop", []) for e in rendered)


LONG = "word " * (2 * MAX_LEN * 40)

BAD_CHAT = [
    {"messages": []},
    {"messages": [{"role": "user", "content": "hi"}], "model": "other-model"},
    {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
    {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 2.0}},
    {"messages": [{"role": "user", "content": "hi"}], "guided_regex": "(ab"},
    {"messages": [{"role": "user", "content": "hi"}], "no_such_field": 1},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_LEN},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "min_tokens": 5},
    {"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [10**9]},
    {"messages": [{"role": "user", "content": LONG}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
]


@pytest.mark.parametrize("body", BAD_CHAT)
def test_chat_render_refuses_what_chat_refuses(served, body):
    client, recorder, _ = served
    rendered = client.post("/v1/chat/completions/render", json=body)
    real = client.post("/v1/chat/completions", json=body)
    assert rendered.status_code in (400, 404)
    assert error_of(rendered) == error_of(real)
    assert recorder.take() == []


BAD_COMPLETIONS = [
    {"prompt": []},
    {"prompt": [1, 10**8]},
    {"prompt": "x", "suffix": "y"},
    {"prompt": "x", "echo": True, "logprobs": 1},
    {"prompt": "x", "max_tokens": MAX_LEN + 1},
    {"prompt": "x", "best_of": 3},
    {"prompt": "x", "max_tokens": 0},
    {"prompt": "x", "max_tokens": 0, "echo": True, "stream": True},
    {"prompt": LONG},
    {"prompt": "x", "model": "nope"},
    {"prompt": "x", "structured_outputs": {"json": {"type": "wat"}}},
    {"prompt": "x", "logit_bias": {"x": 1}},
]


@pytest.mark.parametrize("body", BAD_COMPLETIONS)
def test_completion_render_refuses_what_completions_refuse(served, body):
    client, recorder, _ = served
    rendered = client.post("/v1/completions/render", json=body)
    real = client.post("/v1/completions", json=body)
    assert rendered.status_code in (400, 404)
    assert error_of(rendered) == error_of(real)
    assert recorder.take() == []


def test_echo_only_render_has_no_sampling(served):
    client, _, _ = served
    r = client.post("/v1/completions/render", json={"prompt": "abc", "max_tokens": 0, "echo": True})
    assert r.status_code == 200
    [entry] = r.json()
    assert entry["sampling_params"] == {"max_tokens": 0} and entry["token_ids"]


def test_server_info_says_what_a_router_needs(served):
    client, _, state = served
    info = client.get("/get_server_info").json()
    assert info == {
        "model_id": MODEL, "model_path": "embedded", "served_model_name": MODEL,
        "instance_id": state.instance_id, "kv_block_size": 16, "max_model_len": MAX_LEN,
        "data_parallel_size": 1, "kv_events": False, "version": info["version"],
    }
    host, started, suffix = state.instance_id.rsplit("-", 2)
    assert host and abs(int(started) - time.time()) < 3600 and len(suffix) == 8


def test_kv_event_sources_is_404_when_events_are_off(served):
    client, _, _ = served
    r = client.get("/kv_event_sources")
    assert r.status_code == 404
    _, _, message = error_of(r)
    assert "KV cache events are off" in message and "--kv-events-config" in message


def test_kv_event_sources_reports_the_bound_publisher(served):
    client, _, state = served
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0",
                         replay_endpoint="tcp://127.0.0.1:0", topic="t", buffer_steps=7)
    pub = ZmqEventPublisher(cfg)
    pub.start()
    state.kv_events, state.kv_publisher = cfg, pub
    try:
        body = client.get("/kv_event_sources").json()
        assert body == {"0": {
            "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint, "topic": "t", "hwm": 100_000,
            "buffer_steps": 7, "max_queue_size": 100_000, "publisher": "zmq", "enable_kv_cache_events": True,
            "encoding": "msgpack", "schema_version": 1,
        }}
        assert not pub.endpoint.endswith(":0")
        assert client.get("/get_server_info").json()["kv_events"] is True
    finally:
        state.kv_events, state.kv_publisher = None, None
        pub.shutdown()


def test_get_load_counts_the_live_requests(served):
    client, _, _ = served
    assert client.get("/get_load").json() == {"load": 0, "num_running_requests": 0, "num_waiting_requests": 0}
    body = {"prompt": "Tell me a long story.", "max_tokens": 150, "ignore_eos": True, "temperature": 0}
    done = threading.Event()
    threading.Thread(target=lambda: (client.post("/v1/completions", json=body), done.set()), daemon=True).start()
    seen = []
    deadline = time.monotonic() + 60
    while not done.is_set() and time.monotonic() < deadline:
        seen.append(client.get("/get_load").json())
        time.sleep(0.02)
    assert done.wait(120)
    busy = [s for s in seen if s["load"]]
    assert busy, seen
    assert all(s["load"] == s["num_running_requests"] + s["num_waiting_requests"] for s in seen)
    assert max(s["num_running_requests"] for s in busy) == 1
    assert client.get("/get_load").json()["load"] == 0


def test_the_new_routes_are_in_the_openapi_schema(served):
    client, _, _ = served
    paths = client.get("/openapi.json").json()["paths"]
    for path, method in (("/get_server_info", "get"), ("/kv_event_sources", "get"), ("/get_load", "get"),
                         ("/v1/chat/completions/render", "post"), ("/v1/completions/render", "post")):
        responses = paths[path][method]["responses"]
        assert "200" in responses and "422" not in responses
    assert "404" in paths["/kv_event_sources"]["get"]["responses"]
    assert "400" in paths["/v1/chat/completions/render"]["post"]["responses"]
