"""The adapter sync against fake engines (an httpx mock transport answering vLLM's
runtime LoRA routes per pod IP): what it loads and unloads in each pod, that one pod's
failure leaves the others' sync alone, what it writes to status and which Events it
posts."""

from __future__ import annotations

import json

import httpx
import pytest

from kvpilot.operator import constants as c
from kvpilot.operator.adapters.engine_api import LOAD_TIMEOUT_SECONDS, EngineAdapterApi
from kvpilot.operator.adapters.loop import AdapterSync, has_lora
from kvpilot.operator.adapters.sync import adapters_status, api_key, plan, sync_fleet
from kvpilot.operator.autoscaling.metrics_source import EnginePod
from kvpilot.operator.handlers.context import OperatorContext
from kvpilot.operator.options import OperatorOptions
from kvpilot.operator.spec import parse_spec
from kvpilot.operator.spec.adapters import AdapterSpec

from .fakes import Clock, FakeKubeApi, inference

SQL = AdapterSpec("sql", "s3://adapters/sql", "s3")
CHAT = AdapterSpec("chat", "hf://acme/chat-lora", "hf")
BASE = "llama"


class FakeEngine:
    """One engine pod's LoRA routes, vLLM's answers included."""

    def __init__(self, adapters: dict[str, str] | None = None) -> None:
        self.adapters = dict(adapters or {})
        self.refuse: dict[str, str] = {}  # adapter name -> the engine's 400 message
        self.unreachable = False
        self.unload_status: int | None = None  # force an answer to unloads
        self.calls: list[tuple[str, str]] = []
        self.api_key: str | None = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.unreachable:
            raise httpx.ConnectError("connection refused", request=request)
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            return httpx.Response(401, json={"error": {"message": "Unauthorized", "code": 401}})
        path = request.url.path
        if request.method == "GET" and path == "/v1/models":
            cards = [{"id": BASE, "object": "model", "root": BASE}]
            cards += [{"id": n, "object": "model", "root": r, "parent": BASE}
                      for n, r in self.adapters.items()]
            return httpx.Response(200, json={"object": "list", "data": cards})
        body = json.loads(request.content)
        name = body["lora_name"]
        if path == "/v1/load_lora_adapter":
            self.calls.append(("load", name))
            assert request.extensions["timeout"]["read"] == LOAD_TIMEOUT_SECONDS
            if name in self.refuse:
                return httpx.Response(400, json={"error": {"message": self.refuse[name],
                                                           "type": "BadRequestError", "code": 400}})
            if name in self.adapters:
                return httpx.Response(400, json={"error": {
                    "message": f"The lora adapter '{name}' has already been loaded.", "code": 400}})
            self.adapters[name] = body["lora_path"]
            return httpx.Response(200, text=f"Success: LoRA adapter '{name}' added successfully.")
        if path == "/v1/unload_lora_adapter":
            self.calls.append(("unload", name))
            if self.unload_status is not None:
                return httpx.Response(self.unload_status, json={"error": {"message": "boom"}})
            if self.adapters.pop(name, None) is None:
                return httpx.Response(404, json={"error": {
                    "message": f"The lora adapter '{name}' cannot be found.", "code": 404}})
            return httpx.Response(200, text=f"Success: LoRA adapter '{name}' removed successfully.")
        return httpx.Response(404, text="not found")


class Fleet:
    """Fake engines by pod IP behind one mock transport."""

    def __init__(self, **engines: FakeEngine) -> None:
        self.engines = engines  # pod name -> engine; pod i gets IP 10.0.0.(i+1)
        self.ips = {f"10.0.0.{i + 1}": name for i, name in enumerate(engines)}
        self.headers: list[str | None] = []

    def pods(self) -> list[EnginePod]:
        return [EnginePod(name, ip) for ip, name in self.ips.items()]

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.headers.append(request.headers.get("authorization"))
        return self.engines[self.ips[request.url.host]](request)

    def api(self, api_key: str | None = None) -> EngineAdapterApi:
        return EngineAdapterApi(api_key, httpx.Client(transport=httpx.MockTransport(self.handler)))


# ---------------------------------------------------------------- planning
def test_plan_loads_missing_unloads_removed_and_reloads_a_changed_uri():
    todo = plan([SQL, CHAT], {"chat": "hf://acme/chat-lora-OLD", "gone": "s3://x/gone"})
    assert todo.unload == ("chat", "gone")
    assert todo.load == (SQL, CHAT)
    assert plan([SQL], {"sql": SQL.uri}).empty


# ---------------------------------------------------------------- one round
def test_a_round_brings_every_pod_to_the_spec():
    fleet = Fleet(a=FakeEngine(), b=FakeEngine({"sql": SQL.uri, "old": "s3://x/old",
                                                "chat": "hf://acme/chat-lora-v0"}))
    results = sync_fleet(fleet.api(), fleet.pods(), [SQL, CHAT])
    a, b = fleet.engines["a"], fleet.engines["b"]
    assert a.adapters == b.adapters == {"sql": SQL.uri, "chat": CHAT.uri}
    assert a.calls == [("load", "sql"), ("load", "chat")]
    # b: the removed one and the changed one unloaded first, then the changed one loaded.
    assert b.calls == [("unload", "chat"), ("unload", "old"), ("load", "chat")]
    assert [r.changes for r in results] == [("load sql", "load chat"),
                                            ("unload chat", "unload old", "load chat")]
    # A second round has nothing to do.
    sync_fleet(fleet.api(), fleet.pods(), [SQL, CHAT])
    assert len(a.calls) == 2 and len(b.calls) == 3


def test_one_pod_failing_does_not_stop_the_others():
    fleet = Fleet(a=FakeEngine(), b=FakeEngine(), c=FakeEngine())
    fleet.engines["a"].unreachable = True
    fleet.engines["b"].refuse["sql"] = ("Loading lora sql failed: the adapter's rank 64 is above"
                                        " --max-lora-rank 16")
    results = sync_fleet(fleet.api(), fleet.pods(), [SQL, CHAT])
    a, b, c_ = results
    assert a.unreachable and "ConnectError" in a.unreachable and a.serving == {}
    assert b.errors == {"sql": "load 400: Loading lora sql failed: the adapter's rank 64 is"
                               " above --max-lora-rank 16"}
    assert b.serving == {"chat": CHAT.uri}  # the next adapter was still loaded
    assert c_.serving == {"sql": SQL.uri, "chat": CHAT.uri} and not c_.errors

    report = adapters_status([SQL, CHAT], results)
    assert report.status["adapters"] == [
        {"name": "sql", "uri": SQL.uri, "readyPods": 1, "pods": ["c"],
         "lastError": "b: load 400: Loading lora sql failed: the adapter's rank 64 is above"
                      " --max-lora-rank 16"},
        {"name": "chat", "uri": CHAT.uri, "readyPods": 2, "pods": ["b", "c"]},
    ]
    assert report.status["adaptersReady"] == "0/2"
    assert (report.condition.status, report.condition.reason) == ("False", "AdapterLoadFailed")
    assert "sql on b: load 400: Loading lora sql failed" in report.condition.message
    assert report.failures == (("b", "sql", b.errors["sql"]),)


def test_unloading_what_is_not_loaded_is_done_and_other_unload_failures_are_not():
    engine = FakeEngine({"old": "s3://x/old"})
    fleet = Fleet(a=engine)
    # The engine says 404 (unloaded meanwhile): done, nothing to report.
    engine.unload_status = 404
    (result,) = sync_fleet(fleet.api(), fleet.pods(), [])
    assert result.errors == {} and result.serving == {} and result.changes == ("unload old",)
    engine.unload_status = 500
    (result,) = sync_fleet(fleet.api(), fleet.pods(), [])
    assert result.errors == {"old": "unload: unload 500: boom"}


def test_a_changed_uri_whose_unload_fails_is_not_loaded_over_it():
    engine = FakeEngine({"sql": "s3://adapters/sql-v0"})
    engine.unload_status = 503
    (result,) = sync_fleet(Fleet(a=engine).api(), [EnginePod("a", "10.0.0.1")], [SQL])
    assert engine.calls == [("unload", "sql")]
    assert "unload 503" in result.errors["sql"]
    report = adapters_status([SQL], [result])
    assert report.status["adapters"][0]["readyPods"] == 0


def test_already_loaded_by_a_concurrent_load_is_done():
    engine = FakeEngine()
    api = Fleet(a=engine).api()
    engine.adapters["sql"] = SQL.uri  # loaded between the list and the load
    api.load("http://10.0.0.1:8000", "sql", SQL.uri)


def test_unreachable_pods_and_no_pods_in_the_condition():
    fleet = Fleet(a=FakeEngine(), b=FakeEngine())
    fleet.engines["b"].unreachable = True
    report = adapters_status([SQL], sync_fleet(fleet.api(), fleet.pods(), [SQL]))
    assert (report.condition.status, report.condition.reason) == ("False", "EngineUnreachable")
    assert report.status["adapters"][0]["readyPods"] == 1
    empty = adapters_status([SQL], [])
    assert (empty.condition.status, empty.condition.reason) == ("Unknown", "NoReadyPods")
    assert empty.status["adaptersReady"] == "0/1"


def test_the_api_key_is_sent_and_a_401_says_where_the_operator_looks():
    fleet = Fleet(a=FakeEngine())
    fleet.engines["a"].api_key = "k3y"
    (result,) = sync_fleet(fleet.api("k3y"), fleet.pods(), [SQL])
    assert result.serving == {"sql": SQL.uri}
    assert set(fleet.headers) == {"Bearer k3y"}
    (result,) = sync_fleet(fleet.api(), fleet.pods(), [SQL])
    assert result.unreachable.startswith("GET /v1/models: 401 Unauthorized")
    assert "never from a Secret" in result.unreachable


def test_the_api_key_is_read_only_from_plain_text_in_the_spec():
    model = {"uri": "embedded://smollm2-135m-instruct"}
    assert api_key(parse_spec({"model": model})) is None
    assert api_key(parse_spec({"model": model, "env": [
        {"name": "KVPILOT_API_KEY", "value": "k1"}]})) == "k1"
    assert api_key(parse_spec({"model": model, "env": [
        {"name": "KVPILOT_API_KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]})) is None
    assert api_key(parse_spec({"model": model, "engine": {"extraArgs": ["--api-key", "k2"]}})) == "k2"
    assert api_key(parse_spec({"model": model, "engine": {"extraArgs": ["--api-key=k3"]}})) == "k3"


# ---------------------------------------------------------------- the loop
SPEC = {"model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct"},
        "adapters": [{"name": "sql", "uri": SQL.uri}, {"name": "chat", "uri": CHAT.uri}]}


class Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str, str]] = []

    def __call__(self, body, type_, reason, message) -> None:
        self.posted.append((type_, reason, message))


def setup(spec: dict | None = None):
    api = FakeKubeApi()
    body = inference(spec=spec or SPEC)
    api.put(body)
    api.add_pod("chat", "chat-a", ip="10.0.0.1")
    api.add_pod("chat", "chat-b", ip="10.0.0.2")
    api.add_pod("chat", "chat-c", ready=False)  # starting: loads from its file, not synced
    fleet = Fleet(**{"chat-a": FakeEngine(), "chat-b": FakeEngine()})
    events = Events()
    ctx = OperatorContext(api=api, options=OperatorOptions(engine_image="x"), clock=Clock(),
                          post_event=events)
    sync = AdapterSync(ctx, body, api_factory=lambda api_key: fleet.api(api_key))
    return api, body, fleet, events, sync


def statuses(api: FakeKubeApi) -> list[dict]:
    return [call[4] for call in api.calls if call[0] == "patch_status"]


def test_the_loop_writes_status_and_posts_one_event_per_distinct_failure():
    api, body, fleet, events, sync = setup()
    fleet.engines["chat-b"].refuse["chat"] = "adapter_config.json: target module q_proj missing"
    report = sync.run(body)
    assert report is not None
    (written,) = statuses(api)
    assert written["adaptersReady"] == "1/2"
    assert [a["readyPods"] for a in written["adapters"]] == [2, 1]
    (cond,) = [c_ for c_ in written["conditions"] if c_["type"] == c.ADAPTERS_CONDITION]
    assert (cond["status"], cond["reason"]) == ("False", "AdapterLoadFailed")
    assert "target module q_proj missing" in cond["message"]
    assert events.posted == [("Warning", "AdapterLoadFailed",
                              "adapter chat on pod chat-b: load 400: adapter_config.json: target"
                              " module q_proj missing")]
    stored = api.stored(c.KIND, "llm", "chat")["status"]
    assert stored["adaptersReady"] == "1/2"
    # The same failure again: no new Event, no new status write.
    sync.run(body)
    assert len(events.posted) == 1 and len(statuses(api)) == 1
    # Fixed: the condition turns True, the error goes.
    del fleet.engines["chat-b"].refuse["chat"]
    sync.run(body)
    written = statuses(api)[-1]
    assert written["adaptersReady"] == "2/2"
    assert all("lastError" not in a for a in written["adapters"])
    (cond,) = [c_ for c_ in written["conditions"] if c_["type"] == c.ADAPTERS_CONDITION]
    assert (cond["status"], cond["reason"]) == ("True", "AdaptersLoaded")
    assert len(events.posted) == 1


def test_the_loop_unloads_adapters_the_spec_dropped():
    api, body, fleet, _events, sync = setup()
    sync.run(body)
    assert fleet.engines["chat-a"].adapters == {"sql": SQL.uri, "chat": CHAT.uri}
    smaller = inference(spec={**SPEC, "adapters": [{"name": "chat", "uri": CHAT.uri}]},
                        generation=2)
    sync.run(smaller)
    for engine in fleet.engines.values():
        assert engine.adapters == {"chat": CHAT.uri}
    assert statuses(api)[-1]["adapters"] == [{"name": "chat", "uri": CHAT.uri, "readyPods": 2,
                                              "pods": ["chat-a", "chat-b"]}]


def test_the_loop_does_nothing_with_lora_off_or_an_invalid_spec():
    api, _body, fleet, _events, sync = setup()
    assert sync.run(inference(spec={"model": SPEC["model"]})) is None
    assert sync.run(inference(spec={**SPEC, "adapters": [{"name": "x", "uri": "pvc://c/x"}]})) is None
    assert statuses(api) == [] and all(not e.calls for e in fleet.engines.values())


def test_a_failing_round_is_logged_not_raised():
    api, body, _fleet, _events, sync = setup()
    api.fail_next("list_pods", RuntimeError("bug"))
    sync.run_safely(body)  # logged
    from kvpilot.operator.api import TransientApiError
    api.fail_next("list_pods", TransientApiError("apiserver down", 503))
    sync.run_safely(body)


@pytest.mark.parametrize("spec,on", [
    ({"model": {}}, False), ({"model": {}, "adapters": []}, False),
    ({"model": {}, "adapters": [{"name": "a", "uri": "hf://o/a"}]}, True),
    ({"model": {}, "engine": {"lora": {}}}, True), ({"model": {}, "engine": {}}, False),
])
def test_the_daemon_runs_only_with_lora_on(spec, on):
    assert has_lora(spec) is on


def adapter_sync_statuses() -> list[dict]:
    """Every status patch the loop sends over a failure and its fix (test_status_schema)."""
    api, body, fleet, _events, sync = setup()
    fleet.engines["chat-b"].refuse["chat"] = "bad adapter"
    sync.run(body)
    del fleet.engines["chat-b"].refuse["chat"]
    sync.run(body)
    return statuses(api)
